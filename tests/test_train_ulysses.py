"""Ulysses × ring training is the same training as one device.

Real gloo processes (4 ranks) train the tiny model (4 query heads, 2 kv heads, head_dim 16)
for three AdamW steps, float32, SDPA kernel, and every rank's per-step losses, gradients and
final weights are compared with a one-process run (cp 1) on the same global batch:

- cp 4 as ring 2 × ulysses 2 (zigzag): Ulysses groups {0, 1}, {2, 3}; rings {0, 2},
  {1, 3} (the other layouts' grids are pinned against SDPA in tests/test_ulysses_exact.py);
- the same with FSDP (weights, gradients and AdamW state sharded over the 4 ranks: FSDP's
  mesh is the flattened world, whatever the grid);
- ring 1 × ulysses 2 with dp 2 (two replicas, one sequence each);
- ring 1 × ulysses 4, where the 2 kv heads are repeated onto 4 ranks (GQA with U > kv heads:
  the repeat's backward sums the copies' gradients).

The same launch measures what ``ringray plan`` predicts for Ulysses (ringray/capacity/,
ringray/train/footprint.py): the bytes a forward and backward send in all-to-alls (from the
exchanged buffers, ``RingStats``) and the activations autograd saves per token (saved-tensor
hooks at two lengths, as tests/test_capacity.py does without Ulysses).

Tolerances as in tests/test_train_exact.py: losses and gradients of every step atol = rtol =
1e-5; the final weights atol 1e-4, rtol 1e-5. AdamW divides each element's update by its own
gradient scale, so for an element whose gradient is ~0 a 1e-7 difference in the gradient
becomes a visible share of lr (measured: one element of 8192 of ring 2 × ulysses 2's
``layers.1.feed_forward.w2.weight`` is 1.4e-5 off after three steps, every gradient within
1e-5). Bad degrees and head counts are one-line errors naming ``parallel.ulysses`` before
anything trains.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from distributed import run_gloo_ranks
from train_cases import TINY_MODEL, changed, gradients, record_steps, snapshot, tiny_options

from ringray.attention import RingStats, grid_groups, make_layout
from ringray.capacity import a2a_bytes_per_layer, activation_bytes_per_token
from ringray.model import RingContext, Transformer
from ringray.spec import JobSpecError, parse_job_spec
from ringray.train import Trainer, TrainOptions
from ringray.train.mesh import MeshShape, resolve_mesh_shape

STEPS = 3
TOL = {"atol": 1e-5, "rtol": 1e-5}
WEIGHT_TOL = {"atol": 1e-4, "rtol": 1e-5}
# (name, parallel section, global batch); each runs on 4 gloo ranks.
GRIDS = (
    ("ring2-ulysses2-zigzag", {"dp": 1, "cp": 4, "ulysses": 2, "layout": "zigzag"}, 2),
    ("ring2-ulysses2-fsdp", {"dp": 1, "cp": 4, "ulysses": 2, "layout": "zigzag",
                             "fsdp": True}, 2),
    ("dp2-ring1-ulysses2", {"dp": 2, "cp": 2, "ulysses": 2, "layout": "zigzag"}, 2),
    ("ring1-ulysses4-repeated-kv", {"dp": 1, "cp": 4, "ulysses": 4, "layout": "zigzag"}, 2),
)
_cache: dict = {}


def rank_grids_and_measures(rank: int, world: int, runs: list[TrainOptions],
                            steps: int) -> tuple[list[dict], dict]:
    return rank_record_grid_steps(rank, world, runs, steps), rank_measure(rank, world)


def rank_record_grid_steps(rank: int, world: int, runs: list[TrainOptions],
                           steps: int) -> list[dict]:
    """For each run: the per-step losses and gradients and the final weights (as
    ``train_cases.record_steps``), with each step's all-to-all seconds and ring bytes of
    this rank and the groups' sizes."""
    out = []
    for options in runs:
        trainer = Trainer(options)
        record: dict = {"losses": [], "grads": [], "a2a_seconds": [], "ring_bytes": []}
        for _ in range(steps):
            stats = trainer.step()
            record["losses"].append(stats.loss)
            record["grads"].append(gradients(trainer))
            record["a2a_seconds"].append(stats.a2a_seconds[rank])
            record["ring_bytes"].append(stats.ring_bytes_sent[rank])
        record["weights"] = snapshot(trainer)
        mesh = trainer.mesh
        record["group_ranks"] = (
            torch.distributed.get_process_group_ranks(mesh.ring_group),
            None if mesh.ulysses_group is None
            else torch.distributed.get_process_group_ranks(mesh.ulysses_group))
        out.append(record)
    return out


MEASURED_GRIDS = (2, 4)  # ulysses on the 4 ranks: ring 2 x ulysses 2, ring 1 x ulysses 4
MEASURED_SEQS = (64, 128)
MEASURED_BATCH = 2  # (with one row the all-to-all's q is a view of its whole receive buffer)


def _saved_bytes(model: Transformer, tokens: torch.Tensor, labels: torch.Tensor,
                 ring: RingContext) -> int:
    """Bytes autograd saves for the backward (distinct storages, parameters excluded) in a
    forward and the trainer's loss over this rank's tokens."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens, ring, labels=labels)  # the trainer's loss: chunked, no logits kept
    return sum(saved.values())


def rank_measure(rank: int, world: int) -> dict:
    """Per Ulysses degree: this rank's saved bytes at each length, and the all-to-all bytes
    one forward and backward sent (float32, the tiny model, two sequences)."""
    model = Transformer(TINY_MODEL)
    out = {}
    for ulysses in MEASURED_GRIDS:
        ring_group, ulysses_group = grid_groups(ulysses)
        saved, sent = [], []
        for seq in MEASURED_SEQS:
            layout = make_layout("zigzag", world, seq, ulysses=ulysses)
            stats = RingStats()
            ring = RingContext(layout=layout, rank=rank, group=ring_group,
                               ulysses_group=ulysses_group, backend="sdpa", stats=stats)
            generator = torch.Generator().manual_seed(seq)
            tokens = torch.randint(0, 256, (MEASURED_BATCH, seq), generator=generator)
            local, labels = layout.shard(tokens, rank), layout.shard(tokens.roll(-1, 1), rank)
            saved.append(_saved_bytes(model, local, labels, ring))
            stats.clear()  # count one forward and its backward
            model(local, ring).sum().backward()
            sent.append(stats.totals().a2a_bytes_sent)
        out[ulysses] = {"saved": saved, "a2a_bytes": sent}
    return out


def _single_device(tmp_path_factory) -> dict:
    if "single" not in _cache:
        run_dir = str(tmp_path_factory.mktemp("single"))
        options = tiny_options(run_dir, parallel={"dp": 1, "cp": 1})
        _cache["single"] = record_steps(options, STEPS)
    return _cache["single"]


def _launch(tmp_path_factory) -> list[tuple[list[dict], dict]]:
    """Every grid's run and the measurements, on each of the 4 ranks (one launch)."""
    if "launch" not in _cache:
        run_dir = str(tmp_path_factory.mktemp("grids"))
        runs = [tiny_options(f"{run_dir}/{name}", parallel=parallel,
                             train={"global_batch": batch})
                for name, parallel, batch in GRIDS]
        _cache["launch"] = run_gloo_ranks(4, rank_grids_and_measures, runs, STEPS,
                                          timeout_seconds=300)
    return _cache["launch"]


def _grids(tmp_path_factory) -> list[list[dict]]:
    """Every grid's run on each of the 4 ranks (the runs one after another)."""
    return [grids for grids, _ in _launch(tmp_path_factory)]


@pytest.mark.parametrize("grid", [name for name, _, _ in GRIDS])
def test_ulysses_ring_equals_single_device(tmp_path_factory, grid: str) -> None:
    """Every rank ends each step with the single-device loss and gradients, and the final
    weights agree."""
    want = _single_device(tmp_path_factory)
    index = [name for name, _, _ in GRIDS].index(grid)
    for rank, rank_runs in enumerate(_grids(tmp_path_factory)):
        got = rank_runs[index]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   **TOL, msg=lambda m, r=rank: f"rank {r} losses: {m}")
        for step, (g_step, w_step) in enumerate(zip(got["grads"], want["grads"], strict=True)):
            for name in w_step:
                torch.testing.assert_close(
                    g_step[name], w_step[name], **TOL,
                    msg=lambda m, n=name, s=step, r=rank: f"rank {r} {n} step {s}: {m}")
        for name in want["weights"]:
            torch.testing.assert_close(got["weights"][name], want["weights"][name], **WEIGHT_TOL,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


# The groups each grid forms on ranks 0..3 (the mesh's convention), per rank:
# (ring group's ranks, Ulysses group's ranks).
GROUPS = {
    "ring2-ulysses2-zigzag": [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]),
                              ([1, 3], [2, 3])],
    "dp2-ring1-ulysses2": [([0], [0, 1]), ([1], [0, 1]), ([2], [2, 3]), ([3], [2, 3])],
    "ring1-ulysses4-repeated-kv": [([r], [0, 1, 2, 3]) for r in range(4)],
}


@pytest.mark.parametrize("grid", list(GROUPS))
def test_the_ulysses_path_really_ran(tmp_path_factory, grid: str) -> None:
    """The runs above went through the grid: the mesh formed the issue's groups, every step
    timed all-to-alls on every rank, and a ring of one sent no K/V block."""
    index = [name for name, _, _ in GRIDS].index(grid)
    for rank, rank_runs in enumerate(_grids(tmp_path_factory)):
        got = rank_runs[index]
        assert tuple(got["group_ranks"]) == GROUPS[grid][rank]
        assert all(seconds > 0 for seconds in got["a2a_seconds"]), got["a2a_seconds"]
        ring_size = len(GROUPS[grid][rank][0])
        assert all((sent > 0) == (ring_size > 1) for sent in got["ring_bytes"])


def test_the_reference_trains(tmp_path_factory) -> None:
    """The single-device run compared above really trains (a test of the reference)."""
    losses = _single_device(tmp_path_factory)["losses"]
    assert losses[-1] < losses[0] - 0.5


def test_mesh_grid_coordinates() -> None:
    """Global rank = dp_index × cp + ring_index × ulysses + ulysses_index."""
    shape = resolve_mesh_shape(world_size=8, dp=2, cp=None, ulysses=2)
    assert (shape.dp, shape.cp, shape.ring, shape.ulysses) == (2, 4, 2, 2)
    dp_rank, cp_rank = shape.coords(7)
    assert (dp_rank, *shape.grid_coords(cp_rank)) == (1, 1, 1)
    assert shape.grid_coords(shape.coords(5)[1]) == (0, 1)
    assert MeshShape(dp=1, cp=4).ring == 4


def _one_line_error(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message.strip(), message
    return message


@pytest.mark.parametrize("parallel, model, message", [
    ({"cp": 4, "ulysses": 3}, {}, "ulysses: 3 does not divide cp=4"),
    ({"cp": 8, "ulysses": 8}, {},
     "parallel.ulysses: 8 does not divide model.n_heads=4"),
    ({"cp": 2, "ulysses": 2}, {"dim": 96, "n_heads": 6, "n_kv_heads": 3},
     "parallel.ulysses: 2 neither divides nor is a multiple of model.n_kv_heads=3"),
])
def test_bad_ulysses_is_a_one_line_error_before_training(tmp_path, parallel, model,
                                                         message) -> None:
    """Options that cannot form the grid, or heads that cannot be shared over a Ulysses
    group, are refused when the options are made (so before any process group exists)."""
    base = tiny_options(str(tmp_path))
    with pytest.raises(ValueError) as raised:
        changed(base, parallel=parallel, model=replace(base.model, **model))
    assert message in _one_line_error(raised.value)


def test_bad_ulysses_in_a_job_spec_names_the_field() -> None:
    with pytest.raises(JobSpecError) as raised:
        parse_job_spec({"model": {"preset": "debug"}, "parallel": {"cp": 4, "ulysses": 3},
                        "train": {"seq_len": 64, "global_batch": 2}})
    assert "parallel.ulysses: 3 does not divide cp=4" in str(raised.value)
    spec = parse_job_spec({"model": {"preset": "debug"}, "parallel": {"cp": 4, "ulysses": 2},
                           "train": {"seq_len": 64, "global_batch": 2}})
    assert spec.train_options().parallel.ulysses == 2
    # zigzag over a ring of 2: 4 | S; the grid of 4 ranks: 4 | S (ringray.attention.layouts)
    with pytest.raises(JobSpecError) as raised:
        parse_job_spec({"model": {"preset": "debug"}, "parallel": {"cp": 4, "ulysses": 2},
                        "train": {"seq_len": 66, "global_batch": 2}})
    assert ("train.seq_len: 66 cannot be split by layout 'zigzag' over cp=4 ranks (ring 2 × "
            "ulysses 2); use a multiple of 4") in str(raised.value)


def test_ulysses_that_does_not_divide_an_inferred_cp_fails_in_the_trainer(tmp_path) -> None:
    """Under torchrun cp may be inferred from the world size; one process gives cp 1, which
    ulysses 2 does not divide: refused before the mesh is built."""
    options = tiny_options(str(tmp_path), parallel={"dp": 1, "cp": None, "ulysses": 2})
    with pytest.raises(ValueError) as raised:
        Trainer(options)
    assert "parallel.ulysses: 2 does not divide cp = 1" in _one_line_error(raised.value)


@pytest.mark.parametrize("ulysses", [2, 4])
def test_plan_counts_the_all_to_alls_and_activations_of_a_real_run(tmp_path_factory,
                                                                   ulysses: int) -> None:
    """``a2a_bytes_per_layer`` equals what a forward and backward of the tiny model really
    sent in all-to-alls on every rank (2 layers; K/V repeated x2 at ulysses 4), and
    ``activation_bytes_per_token`` equals the bytes autograd saves per local token (the
    trainer's chunked loss keeps no logits), measured at two lengths so
    the constant part cancels. Two rows per rank: with one, the all-to-all's q is a view that
    keeps its whole receive buffer (q, k and v heads) alive, 2ker bytes per token more
    (reported: ``ringray.attention.ulysses.unpack_heads`` is not contiguous for one row)."""
    cfg = TINY_MODEL
    for rank, (_, measured) in enumerate(_launch(tmp_path_factory)):
        got = measured[ulysses]
        for seq, sent in zip(MEASURED_SEQS, got["a2a_bytes"], strict=True):
            forward, backward = a2a_bytes_per_layer(
                cfg, local_tokens=MEASURED_BATCH * seq // 4, ulysses=ulysses, bf16=False)
            assert sent == cfg.n_layers * (forward + backward), (rank, seq)
        tokens = MEASURED_BATCH * (MEASURED_SEQS[1] - MEASURED_SEQS[0]) // 4
        per_token = (got["saved"][1] - got["saved"][0]) / tokens
        # The rotary tables (8e per position) are shared by the rows; the formula, made per
        # token, counts them per row, so one row's worth is all that is saved here.
        rotary_per_row = 8 * cfg.head_dim * (MEASURED_BATCH - 1) // MEASURED_BATCH
        # A ring of 4 / U ranks: at U = 2 attention saves its own K/V block and the last one
        # received (ring 2), at U = 4 only its own (ring 1).
        expected = (activation_bytes_per_token(cfg, bf16=False, checkpointing="none",
                                               ulysses=ulysses, ring=4 // ulysses)
                    - rotary_per_row)
        assert per_token == expected, rank
