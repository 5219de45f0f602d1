"""A checkpoint location that the ranks do not share (a node-local disk on a job of several
nodes) is refused at the first save, on every rank, in one line, and never committed: the
marker lists the files every rank wrote, and rank 0 must see them all."""

from __future__ import annotations

from distributed import run_gloo_ranks
from train_cases import tiny_options


def _save_to(rank: int, world: int, location: str) -> str:
    import faulty_fs  # noqa: F401 - registers nodemem:// in this rank's process

    from ringray.train import Trainer
    from ringray.train.checkpoint import CheckpointStore, CheckpointWriteError

    trainer = Trainer(tiny_options("/tmp/unused", parallel={"cp": 2, "fsdp": True}))
    trainer.step()
    store = CheckpointStore(location)
    try:
        trainer.save_checkpoint(store)
    except CheckpointWriteError as exc:
        assert store.committed() == []  # nothing committed on any rank's view
        return str(exc)
    return "saved"


def test_a_location_the_ranks_do_not_share_is_refused_in_one_line() -> None:
    messages = run_gloo_ranks(2, _save_to, "nodemem://ck", timeout_seconds=240)
    assert messages[0] == messages[1]
    assert "\n" not in messages[0]
    assert messages[0].startswith("checkpoint.path: nodemem://ck is not shared by every rank: "
                                  "rank 0 does not see 1 file(s) the others wrote")


def test_a_shared_location_saves(tmp_path) -> None:
    assert run_gloo_ranks(2, _save_to, str(tmp_path / "ck"), timeout_seconds=240) == [
        "saved", "saved"]


def _open_session(rank: int, world: int, location: str) -> str:
    import faulty_fs  # noqa: F401 - registers nodemem:// in this rank's process

    from ringray.train.checkpoint import CheckpointWriteError
    from ringray.train.checkpoint_runs import RunPlan
    from ringray.train.session import TrainingSession

    options = tiny_options("/tmp/unused", parallel={"cp": 2},
                           checkpoint={"path": location})
    try:
        session = TrainingSession(options, RunPlan(lineage="l", restore=()))
    except CheckpointWriteError as exc:
        return str(exc)
    return f"opened at step {session.step_count}"


def test_a_location_the_ranks_do_not_share_is_refused_when_the_session_opens() -> None:
    """Before any step: every rank gets the same one line, no training is lost to it."""
    messages = run_gloo_ranks(2, _open_session, "nodemem://ck", timeout_seconds=240)
    assert messages[0] == messages[1]
    assert messages[0] == ("checkpoint.path: nodemem://ck is not shared by every rank: rank 0 "
                           "does not see what rank(s) 1 wrote there; a job on several nodes "
                           "needs a location every node reads, such as a shared filesystem "
                           "or an object store URL (s3://, gs://)")


def test_a_shared_location_opens_and_is_left_as_it_was_found(tmp_path) -> None:
    location = tmp_path / "ck"
    assert run_gloo_ranks(2, _open_session, str(location), timeout_seconds=240) == [
        "opened at step 0", "opened at step 0"]
    assert not location.exists()  # the probes and the directory they needed are gone
