"""The advertised 64-GPU jobs, simulated: one rank of the 8B/1M and the 70B/256k job is built
on the ``meta`` device over PyTorch's fake process group (in a process of its own), and its
mesh, its FSDP shards and the bytes of its weights and AdamW state agree with the memory
model ``ringray plan`` uses. Activations are not simulated (the ring does not run on a fake
backend); they are the plan's own arithmetic, checked elsewhere against measured runs."""

from __future__ import annotations

import math
import multiprocessing as mp

import pytest

from ringray.spec import load_job_spec
from ringray.train.footprint import rank_footprint

JOBS = ["jobs/llama-8b-1m-64xh100.yaml", "jobs/llama-70b-256k-64xh100.yaml"]
WORLD = 64


def _simulate(job: str, ranks: tuple[int, ...], out) -> None:
    from ringray.bench.simulate import simulate_rank

    options = load_job_spec(job).train_options()
    out.put([simulate_rank(options, world_size=WORLD, rank=rank) for rank in ranks])


def _simulated(job: str, ranks: tuple[int, ...]) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_simulate, args=(job, ranks, out))
    proc.start()
    try:
        return out.get(timeout=240)
    finally:
        proc.join(timeout=30)


@pytest.mark.parametrize("job", JOBS)
def test_a_simulated_rank_holds_what_the_plan_predicts(job: str) -> None:
    options = load_job_spec(job).train_options()
    cfg, parallel = options.model, options.parallel
    plan = rank_footprint(cfg, local_tokens=options.train.seq_len // parallel.cp, cp=parallel.cp,
                          shards=WORLD, bf16=True,
                          checkpointing=options.train.activation_checkpointing)
    ranks = (0, WORLD - 1)
    for rank, sim in zip(ranks, _simulated(job, ranks), strict=True):
        assert (sim.dp_rank, sim.cp_rank) == divmod(rank, parallel.cp)
        assert sim.group_sizes == {"dp": parallel.dp, "ring": parallel.cp, "ulysses": 1,
                                   "cp": parallel.cp, "fsdp": WORLD}
        # fully_shard splits dim 0 in WORLD chunks of ceil(rows / WORLD); the last ranks may
        # hold fewer (or none).
        wq = sim.shard_shapes["layers.0.attention.wq.weight"]
        rows = cfg.n_heads * cfg.head_dim
        chunk = math.ceil(rows / WORLD)
        assert wq == (max(0, min(chunk, rows - rank * chunk)), cfg.dim)
        # The plan counts ceil(params / shards) per rank; padding per tensor makes ranks
        # differ by a fraction of a percent.
        assert sim.weights_bytes == pytest.approx(plan.weights_bytes, rel=0.01)
        assert sim.optimizer_bytes == pytest.approx(plan.optimizer_bytes, rel=0.01)
        assert 2 * sim.weights_bytes == pytest.approx(sim.optimizer_bytes)
