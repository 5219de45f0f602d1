"""``RUN/job.yaml``: written only once a job has started (a refused run changes nothing in
the run directory), and read from wherever the run directory is now (a moved run resumes
and exports from its own checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringray.cli.train import _RunSpecWriter, job_started
from ringray.cluster.status import JobStatus
from ringray.spec import JobSpecError, load_job_spec
from ringray.spec.run_spec import load_run_spec, relocation, write_run_spec

ROOT = Path(__file__).resolve().parent.parent


def _spec(run_dir: Path, *overrides: str):
    return load_job_spec(ROOT / "jobs/quickstart.yaml",
                         [f"run_dir={run_dir}", "train.seq_len=512", *overrides],
                         check_paths=False)


def test_relocation_moves_run_dir_and_a_checkpoint_path_inside_it_only() -> None:
    recorded = {"run_dir": "/old/run", "checkpoint": {"path": "/old/run/ckpt/a"}}
    assert relocation(recorded, Path("/new/place")) == {
        "run_dir": "/new/place", "checkpoint.path": "/new/place/ckpt/a"}
    for elsewhere in ("/shared/ckpt", "s3://bucket/run/ckpt", "/old/run-other/ckpt", None):
        data = {"run_dir": "/old/run", "checkpoint": {"path": elsewhere}}
        assert relocation(data, Path("/new")) == {"run_dir": "/new"}, elsewhere
    assert relocation({"checkpoint": None}, Path("/new")) == {"run_dir": "/new"}


def test_a_moved_run_directory_is_read_from_where_it_is(tmp_path: Path,
                                                          monkeypatch) -> None:
    """The default checkpoint location and one given inside the run directory both follow
    the directory; relative local paths were recorded absolute, so the cwd does not matter."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text to train on\n")
    first = tmp_path / "runs" / "a"
    first.mkdir(parents=True)
    write_run_spec(_spec(Path("runs/a"), "data.source=files", "data.path=corpus"),
                   run_dir="runs/a")
    moved = tmp_path / "elsewhere" / "b"
    moved.parent.mkdir()
    first.rename(moved)
    monkeypatch.chdir(ROOT)
    options = load_run_spec(moved, ["train.steps=7"]).train_options()
    assert options.run_dir == str(moved)
    assert options.checkpoint_location == f"{moved}/checkpoints"
    assert options.data.path == str(tmp_path / "corpus")
    assert options.train.steps == 7

    inside = tmp_path / "c"
    inside.mkdir()
    write_run_spec(_spec(inside, f"checkpoint.path={inside}/ckpts"), run_dir=str(inside))
    inside.rename(tmp_path / "d")
    assert load_run_spec(tmp_path / "d").train_options().checkpoint_location == \
        str(tmp_path / "d" / "ckpts")


def test_a_directory_without_job_yaml_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="no job.yaml here"):
        load_run_spec(tmp_path)


def test_an_empty_or_undecodable_job_yaml_is_one_line_naming_it(tmp_path: Path) -> None:
    """An empty job.yaml was read as the all-defaults spec ("parallel.cp: required by
    `ringray train`"); one not in UTF-8 was a traceback."""
    (tmp_path / "job.yaml").write_text("")
    with pytest.raises(JobSpecError, match=r"job.yaml: empty, so not the job file `ringray "
                                           r"train` wrote"):
        load_run_spec(tmp_path)
    (tmp_path / "job.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(JobSpecError, match=r"job.yaml: not UTF-8 text \(byte 9"):
        load_run_spec(tmp_path)


def _status(state: str, *, stepped: bool = False) -> JobStatus:
    return JobStatus(job_name="j", state=state, step=0, total_steps=10, dp=0, target_dp=1,
                     cp=2, restarts=(), failures_used=0, resizes=0,
                     last_stats=object() if stepped else None,  # only its presence counts
                     last_checkpoint_step=None, workers=(), plan=None, error=None, events=())


def test_job_yaml_is_written_once_the_job_has_started_and_never_by_a_refused_run(
    tmp_path: Path,
) -> None:
    """A run refused by the lock or by its checkpoints ends failed without having run: it
    must not write job.yaml. One that got as far as running writes it once."""
    spec = _spec(tmp_path)
    path = tmp_path / "job.yaml"
    said: list[str] = []
    refused = _RunSpecWriter(spec, str(tmp_path), say=said.append, written=False)
    for state in ("placing", "starting", "recovering", "failed", "stopped"):
        refused.update(_status(state))
    assert not path.exists() and not said

    writer = _RunSpecWriter(spec, str(tmp_path), say=said.append, written=False)
    writer.update(_status("running"))
    assert path.is_file()
    path.write_text("kept")
    writer.update(_status("checkpointing"))
    assert path.read_text() == "kept"  # once

    assert job_started(_status("finished")) and job_started(_status("evaluating"))
    # a short job the driver saw only after it stopped: it did train
    assert job_started(_status("stopped", stepped=True))
    assert not job_started(_status("failed"))
