"""Memory the plan once left out (issue 41), and the plan now agreeing with what is held.

- **FSDP with packed documents.** A rank runs its rows one at a time; under FSDP each row's
  backward reduce-scatters into the gradient shards. Real gloo processes (FSDP2 over dp 1 ×
  cp 2, a 6-layer model, 2 rows a rank): between rows every rank keeps exactly the plan's
  gradient term (4 bytes × its shard of the parameters) and no unsharded gradient. The way
  the trainer used to run (reduce-scatter in the last row only, gradient sync off before)
  keeps every parameter's full float32 gradient, 4 bytes × all parameters, which the plan
  never counted; both give the same summed gradients (1e-6), so syncing each row changes
  nothing but memory and traffic. (The allocator's total at the end of the first row, 3 runs
  × 2 ranks of this model: 24.3 MB the former way, 12.1-20.0 MB now; it also holds a varying
  number of blocks' reduce-scatter buffers that FSDP keeps for reuse, too noisy on CPU to
  assert, and so does the peak of two rows, dominated by the last, where both ways
  reduce-scatter: 33-47 MB either way. The gradients held are exact.)
- **NCCL's buffers** (:mod:`ringray.capacity.nccl`): the arithmetic of a ring of 8 on one
  H100 node under zigzag (every rank exchanges with all 7 others, from the transfer plan the
  ring runs) against a ring whose blocks only go to the next rank (each rank then talks to
  its 2 neighbours: K/V one way, dK/dV sums back), a ring spanning two nodes (the
  network's shared pools), the FSDP communicator, and ``ringray plan`` showing them as
  their own lines, in the JSON, and in the total that must fit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from distributed import run_gloo_ranks
from train_cases import gradients, tiny_options
from typer.testing import CliRunner

from ringray.attention import make_layout
from ringray.attention.transfer_plan import TransferPlan, transfer_rounds
from ringray.attention.transfers import plan_transfers
from ringray.capacity import (
    GIB,
    PlanInputs,
    comm_buffers,
    nccl_channels,
    parse_cluster,
    plan,
    plan_footprint,
    transfer_peers,
)
from ringray.capacity.nccl import (
    RECEIVE_BYTES,
    SEND_BYTES,
    collective_buffer_bytes,
    every_peer,
    p2p_buffer_bytes,
)
from ringray.cli import app
from ringray.model import model_preset
from ringray.train import TrainOptions

MIB = 2**20
JOB_1B = str(Path(__file__).resolve().parents[1] / "jobs" / "llama-1b-128k-h100.yaml")
# Large enough that the gradients outweigh a row's activations (64 tokens), so the peak shows
# what the rows keep; small enough for a few seconds on CPU.
ROWS_MODEL = model_preset("debug", dim=256, n_layers=6, n_heads=4, n_kv_heads=2,
                          ffn_hidden=1024)


# ------------------------------------------------------------------ FSDP and packed rows
def _fsdp_gradient_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(sharded, unsharded) gradient bytes this rank holds now: FSDP2's gradient shards, and
    the full gradients it keeps while a module's gradient sync is off (its accumulated
    float32 gradient, or the unsharded parameter's own)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = unsharded = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                if param.sharded_param.grad is not None:
                    local = param.sharded_param.grad.to_local()
                    sharded += local.numel() * local.element_size()
                full = [param.unsharded_accumulated_grad,
                        getattr(getattr(param, "_unsharded_param", None), "grad", None)]
                unsharded += sum(g.numel() * g.element_size() for g in full if g is not None)
    return sharded, unsharded


def rank_rows_kept(rank: int, world: int, options: TrainOptions, sync_last_row_only: bool
                   ) -> dict:
    """One warm-up step, then the next batch's rows' backward: the gradient bytes the rank
    holds after each row, and the summed gradients. ``sync_last_row_only``: the trainer's
    former way, gradient sync off for every row but the last (set before each row, as it
    did)."""
    from ringray.train import Trainer

    trainer = Trainer(options)
    trainer.step()
    rows, kept = trainer.loader.local_batch, []
    backward = trainer._loss_sum_backward

    def one_row(*args, **kwargs):
        if sync_last_row_only:
            trainer.model.set_requires_gradient_sync(len(kept) == rows - 1)
        loss = backward(*args, **kwargs)
        kept.append(_fsdp_gradient_bytes(trainer.model))
        return loss

    trainer._loss_sum_backward = one_row
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer._documents_backward()
    return {"kept": kept, "grads": gradients(trainer), "rows": rows,
            "params": sum(p.numel() for p in trainer.model.parameters())}


@pytest.fixture(scope="module")
def rows_runs(tmp_path_factory) -> dict[bool, list[dict]]:
    """Both ways, each on 2 gloo ranks: {sync_last_row_only: per-rank records}."""
    corpus = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    with (corpus / "documents.jsonl").open("w") as f:
        for length in [1, 5, 2, 13, 3, 17, 9, 30, 1, 11, 6, 23, 2, 40, 7, 19, 4, 70] * 3:
            f.write(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in
                                                range(length))}) + "\n")
    options = _rows_options(str(tmp_path_factory.mktemp("run")), str(corpus))
    return {old: run_gloo_ranks(2, rank_rows_kept, options, old, timeout_seconds=300)
            for old in (False, True)}


def _rows_options(run_dir: str, corpus: str) -> TrainOptions:
    return tiny_options(run_dir, model=ROWS_MODEL,
                        data={"source": "files", "path": corpus, "documents": True},
                        parallel={"dp": 1, "cp": 2, "fsdp": True},
                        train={"global_batch": 2, "seq_len": 64})


def test_fsdp_rows_keep_the_plans_gradient_term(rows_runs, tmp_path) -> None:
    """Between rows each rank holds its gradient shard, 4 B × its share of the parameters:
    the plan's ``gradients_bytes`` (2 ranks: an even split, no padding), and nothing more."""
    options = _rows_options(str(tmp_path), str(tmp_path))
    planned = plan_footprint(PlanInputs.of_mesh(options, dp=1, cp=2, name="rows", bf16=False,
                                                foreach=False))
    for record in rows_runs[False]:
        assert record["rows"] == 2
        assert planned.gradients_bytes == 4 * record["params"] // 2
        assert record["kept"] == [(planned.gradients_bytes, 0)] * record["rows"]


def test_syncing_only_the_last_row_kept_every_full_gradient(rows_runs) -> None:
    """The former way: after the first row every parameter's full float32 gradient is held
    (4 B × all parameters: twice the plan's term on 2 ranks, 32 GB at 8B however many ranks
    share it), none of it sharded; the last row reduce-scatters either way, and the summed
    gradients are the same (1e-6)."""
    for old, new in zip(rows_runs[True], rows_runs[False], strict=True):
        assert old["kept"][0] == (0, 4 * old["params"])
        assert old["kept"][0][1] == 2 * new["kept"][0][0]
        assert old["kept"][-1] == new["kept"][-1]
        for name, grad in new["grads"].items():
            torch.testing.assert_close(old["grads"][name], grad, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ NCCL's buffers
def _neighbour_plan(world: int) -> TransferPlan:
    """A ring whose every block is read by the next rank alone."""
    reads = tuple(tuple(s == (r - 1) % world for s in range(world)) for r in range(world))
    return TransferPlan(world_size=world, reads=reads, rounds=transfer_rounds(reads),
                        block_rows=64)


def test_ring_p2p_buffers_of_a_zigzag_ring_and_a_neighbour_ring() -> None:
    """cp 8 on one H100 node, 32 channels a peer: a receiving connection holds 10 MiB (LL
    512 KiB + LL128 4.7 MiB + Simple 4 MiB, at the 2 MiB cuMem granularity) and a sending
    one 2 MiB per channel. Zigzag: every rank sends to and receives from the 7 others (the
    planner's own transfer plan): 32 × 7 × (10 + 2) MiB = 2688 MiB. Neighbours only: K/V to
    the next rank, dK/dV sums back to the previous one, so 2 peers each way: 768 MiB."""
    assert (RECEIVE_BYTES, SEND_BYTES) == (10 * MIB, 2 * MIB)
    one_node = nccl_channels(parse_cluster("1x8xH100"), ranks=8)
    assert (one_node.per_peer, one_node.collective, one_node.nodes) == (32, 32, 1)

    zigzag = transfer_peers(plan_transfers(make_layout("zigzag", 8, 1024), True))
    assert zigzag == every_peer(8)
    assert all(len(sends) == len(receives) == 7 for sends, receives in zigzag)
    neighbours = transfer_peers(_neighbour_plan(8))
    assert neighbours[3] == (frozenset({4, 2}), frozenset({2, 4}))
    assert all(len(sends) == len(receives) == 2 for sends, receives in neighbours)

    node = [0] * 8
    assert p2p_buffer_bytes(zigzag, nodes=node, channels=one_node) == 32 * 7 * 12 * MIB
    assert p2p_buffer_bytes(neighbours, nodes=node, channels=one_node) == 32 * 2 * 12 * MIB
    assert 32 * 7 * 12 * MIB / GIB == pytest.approx(2.625)


def test_a_ring_across_nodes_and_the_fsdp_communicator() -> None:
    """A ring of 16 on 2 nodes: the communicator spans nodes, so 2 channels a peer (the
    network's count, issue #1453); 7 peers on the node × 2 × 12 MiB, and the network's two
    shared pools (send, receive) of 16 P2P channels × 16 steps × 128 KiB for the 8 peers on
    the other node: 168 + 64 = 232 MiB. The FSDP communicator over the 16 ranks: 16
    collective channels × 12 MiB; over one node's 8: 32 × 12 MiB."""
    cluster = parse_cluster("2x8xH100")
    spanning = nccl_channels(cluster, ranks=16)
    assert (spanning.per_peer, spanning.collective, spanning.p2p, spanning.nodes) == (
        2, 16, 16, 2)
    nodes = [r // 8 for r in range(16)]
    assert p2p_buffer_bytes(every_peer(16), nodes=nodes, channels=spanning) == 232 * MIB
    assert collective_buffer_bytes(spanning) == 16 * 12 * MIB
    assert collective_buffer_bytes(nccl_channels(cluster, ranks=8)) == 32 * 12 * MIB
    # A PCIe card gets NCCL's 2 channels a peer inside a node too.
    assert nccl_channels(parse_cluster("1x8xL40S"), ranks=8).per_peer == 2


def _inputs(cp: int, **fields) -> PlanInputs:
    cfg = model_preset("debug", dim=256, n_layers=4, n_heads=8, n_kv_heads=2,
                       ffn_hidden=1024)
    return PlanInputs(name="comm", model=cfg, seq_len=8192, global_batch=1, dp=1, cp=cp,
                      layout="zigzag", bf16=True, activation_checkpointing="none", **fields)


def test_the_plan_adds_nccl_buffers_to_the_device_total() -> None:
    """The plan's own figures: the ring's, the FSDP communicator's (only with FSDP), the
    Ulysses group's all-to-all (3 peers in a group of 4, one node); a ring of one has no
    peer. Each is outside the footprint's peak and inside the total that must fit."""
    h100 = parse_cluster("1x8xH100")
    replicated = comm_buffers(_inputs(8), h100)
    assert (replicated.ring_peers, replicated.ring_channels) == (7, 32)
    assert (replicated.ring_bytes, replicated.fsdp_bytes) == (32 * 7 * 12 * MIB, 0)
    sharded = comm_buffers(_inputs(8, fsdp=True), h100)
    assert sharded.fsdp_bytes == 32 * 12 * MIB
    assert sharded.total_bytes == 32 * 8 * 12 * MIB
    grid = comm_buffers(_inputs(8, ulysses=4), h100)
    assert (grid.ring_peers, grid.ulysses_peers) == (1, 3)
    assert (grid.ring_bytes, grid.ulysses_bytes) == (32 * 12 * MIB, 32 * 3 * 12 * MIB)
    assert comm_buffers(_inputs(1), h100).total_bytes == 0

    report = plan(_inputs(8, fsdp=True), h100)
    memory = report.memory
    assert memory.device_bytes == memory.peak_bytes + 32 * 8 * 12 * MIB
    assert memory.fits == (memory.device_bytes <= memory.usable_bytes)
    assert report.verdict.startswith(f"fits: {memory.device_bytes / GIB:.1f} GiB")
    data = report.to_dict()["memory"]
    assert (data["nccl_bytes"], data["device_bytes"]) == (
        32 * 8 * 12 * MIB, memory.device_bytes)
    assert data["comm"]["ring_bytes"] == 32 * 7 * 12 * MIB


def test_ringray_plan_prints_the_nccl_lines() -> None:
    """`ringray plan` on the 1B job: the lines between the peak and the usable memory."""
    result = CliRunner().invoke(app, ["plan", JOB_1B, "--cluster", "1x8xH100"])
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.stdout.splitlines()]
    peak = next(i for i, line in enumerate(lines) if line.startswith("peak (at the"))
    assert [" ".join(line.split()) for line in lines[peak + 1: peak + 5]] == [
        "NCCL ring P2P (7 peers x 32 channels) 2.62",
        "NCCL FSDP communicator (32 channels) 0.38",
        "per device (peak + NCCL buffers) 50.16",
        "usable (80 GiB less 10% reserve) 72.00",
    ]
