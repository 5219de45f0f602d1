"""Every process group ringray makes times out with the job's collective timeout (the default
group's), not the backend's default (gloo: 30 minutes): the mesh's dp, ring, Ulysses and cp
groups, FSDP's flattened mesh, the Ulysses grid of the standalone API and the CPU agreement
side group. A rank that stops answering fails its peers after that timeout."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from distributed import run_gloo_ranks

JOB_TIMEOUT_SECONDS = 7.0


def _timeouts_of_every_group(rank: int, world: int) -> dict[str, float]:
    from ringray.attention import grid_groups
    from ringray.attention.comm import agreement_group
    from ringray.attention.groups import group_timeout
    from ringray.train.mesh import MeshShape, build_mesh

    mesh = build_mesh(MeshShape(dp=2, cp=4, ulysses=2))
    grid_ring, grid_ulysses = grid_groups(2)
    groups = {
        "dp": mesh.dp_group, "ring": mesh.ring_group, "ulysses": mesh.ulysses_group,
        "cp": mesh.cp_group, "fsdp": mesh.fsdp_mesh.get_group(),
        "grid ring": grid_ring, "grid ulysses": grid_ulysses,
        "agreement": agreement_group(mesh.ring_group),
    }
    return {name: group_timeout(group).total_seconds() for name, group in groups.items()}


def test_every_group_gets_the_jobs_timeout() -> None:
    results = run_gloo_ranks(8, _timeouts_of_every_group, timeout_seconds=240,
                             collective_timeout_seconds=JOB_TIMEOUT_SECONDS)
    for timeouts in results:
        assert timeouts == dict.fromkeys(timeouts, JOB_TIMEOUT_SECONDS)


def _silent_peer(rank: int, world: int, done: str) -> float | str:
    """Rank 1 stops answering (it waits for rank 0 to be done); rank 0's all-reduce on the
    ring must fail after the job's timeout."""
    import torch
    import torch.distributed as dist

    from ringray.train.mesh import MeshShape, build_mesh

    mesh = build_mesh(MeshShape(dp=1, cp=2))
    if rank == 1:
        deadline = time.monotonic() + 120
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return "silent"
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=mesh.ring_group)
    except RuntimeError:
        return time.monotonic() - start
    finally:
        Path(done).touch()
    return "the all-reduce did not fail"


def test_a_silent_peer_fails_the_ring_after_the_jobs_timeout(tmp_path: Path) -> None:
    failed_after, silent = run_gloo_ranks(2, _silent_peer, str(tmp_path / "done"),
                                          timeout_seconds=180,
                                          collective_timeout_seconds=JOB_TIMEOUT_SECONDS)
    assert silent == "silent"
    assert isinstance(failed_after, float), failed_after
    # gloo reports the timeout once it has passed (not before), well short of its default
    assert JOB_TIMEOUT_SECONDS - 0.5 <= failed_after < JOB_TIMEOUT_SECONDS + 20
    assert failed_after < timedelta(minutes=30).total_seconds()
