"""CheckpointStore across two real gloo processes, where one process's failure reaches the
other only through DCP's collectives:

- a peer that dies while a checkpoint is being restored makes the survivor raise a retryable
  :class:`CheckpointIOError` (not a ``ValueError``), never :class:`CheckpointCorrupt`: the
  checkpoint is good, and marking it corrupt would fail the job with no retry;
- a full disk at a run's first checkpoint (nothing earlier to size a probe write by) is named
  in one line, as a :class:`CheckpointWriteError` that no retry can fix, although DCP sends
  the failing rank's error to the others without the ``OSError`` beneath it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from distributed import free_loopback_port, run_gloo_ranks
from faulty_fs import QuotaLocalFS
from torch.distributed.checkpoint import FileSystemReader

from ringray.train import CheckpointStore
from ringray.train.checkpoint import CheckpointCorrupt, CheckpointIOError, CheckpointWriteError

_DIES_WITH = 17  # the exit status of the rank that dies mid-restore


def _outcome(exc: BaseException | None) -> dict:
    if exc is None:
        return {"raised": None}
    return {"raised": type(exc).__name__, "message": str(exc),
            "bases": [c.__name__ for c in type(exc).__mro__]}


def rank_saves_then_loads(rank: int, world: int, location: str) -> dict:
    """Both ranks save a checkpoint where each writes a shard of its own, then load it."""
    weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    store = CheckpointStore(location, lineage="run")
    ref = store.save(2, {"weights": weights, f"rank{rank}": torch.full((8,), float(rank))},
                     keep=2)
    state = {"weights": torch.zeros(64, 64), f"rank{rank}": torch.zeros(8)}
    store.load(ref, state)
    torch.testing.assert_close(state["weights"], weights, rtol=0, atol=0)
    torch.testing.assert_close(state[f"rank{rank}"], torch.full((8,), float(rank)), rtol=0,
                               atol=0)
    return store.marker(ref)


def test_every_ranks_files_are_checksummed_as_written(tmp_path: Path) -> None:
    """Each rank hashes the files it writes; rank 0's marker lists every file with its
    CRC-32C, and the checkpoint verifies when read back in one process."""
    location = str(tmp_path / "ck")
    markers = run_gloo_ranks(2, rank_saves_then_loads, location, timeout_seconds=300)
    marker = markers[0]
    assert marker == markers[1] and marker["world_size"] == 2
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(marker["files"])
    assert set(marker["crc32c"]) == set(marker["files"])
    store = CheckpointStore(location)
    store.verify(store.latest())


def _rank_restores_while_rank1_dies(rank: int, world: int, port: int, location: str,
                                    outcome_dir: str) -> None:
    """Restore the newest checkpoint at ``location`` on both ranks; rank 1 exits while DCP reads
    its share of the files (after every file verified), as a killed process would. Rank 0
    writes what its load raised to ``outcome_dir/rank0.json``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    if rank == 1:
        def die(self, plan, planner):
            os._exit(_DIES_WITH)

        FileSystemReader.read_data = die
    store = CheckpointStore(location)
    state = {"weights": torch.zeros(256, 256), "step": 0}
    try:
        store.load(store.latest(), state)
        raised = None
    except BaseException as exc:  # noqa: BLE001 - report whatever the survivor saw
        raised = exc
    Path(outcome_dir, f"rank{rank}.json").write_text(json.dumps(_outcome(raised)))
    os._exit(0)  # no destroy_process_group: its peer is gone


def test_a_peer_dying_during_a_restore_is_retryable_not_corrupt(tmp_path: Path) -> None:
    """Rank 1 dies inside ``dcp.load``; rank 0's load fails in the collective that follows.
    The files verified, so the failure is the peer's: a :class:`CheckpointIOError` (the
    service retries it), and the checkpoint is still the newest one and still loads."""
    location = str(tmp_path / "ck")
    store = CheckpointStore(location, lineage="run")
    weights = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    store.save(3, {"weights": weights, "step": 3}, keep=2)

    ctx = mp.get_context("spawn")
    port = free_loopback_port()
    procs = [ctx.Process(target=_rank_restores_while_rank1_dies,
                         args=(rank, 2, port, location, str(tmp_path)))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    for proc in procs:  # only the processes started here
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert procs[1].exitcode == _DIES_WITH, "rank 1 died inside dcp.load"
    outcome = json.loads((tmp_path / "rank0.json").read_text())
    assert outcome["raised"] is not None, "the survivor's load cannot succeed alone"
    assert "CheckpointCorrupt" not in outcome["bases"], outcome["message"]
    assert "CheckpointIOError" in outcome["bases"] and "ValueError" not in outcome["bases"], \
        outcome
    assert "\n" not in outcome["message"] and location in outcome["message"]

    assert store.latest().step == 3
    state = {"weights": torch.zeros(256, 256), "step": 0}
    store.load(store.latest(), state)
    torch.testing.assert_close(state["weights"], weights, rtol=0, atol=0)
    assert issubclass(CheckpointIOError, RuntimeError) and not issubclass(
        CheckpointIOError, (ValueError, CheckpointCorrupt))


def rank_saves_on_a_full_disk(rank: int, world: int, root: str) -> dict:
    """Both ranks save a first checkpoint (4 MiB of weights) on a 3 MiB quota; returns what
    the save raised, and whether the uncommitted directory is gone."""
    QuotaLocalFS.limit(root, 3 << 20)
    store = CheckpointStore(f"quotafile://{root}/ck", lineage="run")
    try:
        store.save(5, {"weights": torch.ones(1024, 1024), "step": 5}, keep=2)
        raised = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        raised = exc
    dist.barrier()
    left = sorted(p.name for p in Path(root, "ck").glob("step_*"))
    return {**_outcome(raised), "left": left}


def test_a_full_disk_at_the_first_checkpoint_is_named_and_not_retried(tmp_path: Path) -> None:
    """DCP pickles a rank's error to send it to the others, which drops the ``OSError`` torch's
    serializer hid under ``RuntimeError: unexpected pos``; and at a first checkpoint a probe
    write has nothing to be sized by, so it fits. The error must still be the full disk, in
    one line naming the location, as a :class:`CheckpointWriteError` on every rank."""
    root = tmp_path / "small-disk"
    root.mkdir()
    outcomes = run_gloo_ranks(2, rank_saves_on_a_full_disk, str(root), timeout_seconds=300)
    for rank, outcome in enumerate(outcomes):
        assert outcome["raised"] == CheckpointWriteError.__name__, (rank, outcome)
        message = outcome["message"]
        assert "\n" not in message and "unexpected pos" not in message, message
        assert f"checkpoint.path: quotafile://{root}/ck is full" in message, message
        assert "ENOSPC (No space left on device)" in message, message
        assert "CheckpointIOError" not in outcome["bases"], "a retry cannot free the disk"
        assert outcome["left"] == [], "the uncommitted directory is removed"
