"""``RUN/job.yaml``: written only once a job has started (a refused run changes nothing in
the run directory), and read from wherever the run directory is now (a moved run resumes
and exports from its own checkpoints)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ringray.cli.train import _with_absolute_paths
from ringray.cluster.placement import PlacementPlan, RankPlacement, RingCost
from ringray.cluster.record import JobRecord
from ringray.spec import JobSpecError, load_job_spec
from ringray.spec.run_spec import load_run_spec, relocation, run_spec_text, write_run_spec

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


def test_job_yaml_is_written_by_the_controllers_record_once_the_job_has_started(
    tmp_path: Path,
) -> None:
    """The controller writes job.yaml (``JobOptions.run_spec``, made by the driver), so the
    run directory has one writer wherever `ringray train` runs. Not before the workers
    built (a refused run never gets there), once per controller, and an unwritable place is
    a warning event, not a failure."""
    spec = _spec(tmp_path / "run")
    text = run_spec_text(spec, run_dir=str(tmp_path / "run"))
    job = replace(_with_absolute_paths(spec.job_options()), run_spec=text)
    record = JobRecord(job, tmp_path / "run", metrics=None)
    path = tmp_path / "run" / "job.yaml"
    assert not path.exists()
    plan = PlacementPlan(dp=1, cp=1, ranks=(RankPlacement(rank=0, node_id="n", slot=0),),
                         rings=(RingCost(ring=0, ranks=(0,), nodes=("n",), cross_node_hops=0,
                                         step_transfer_seconds=None),))
    record.started(plan, step=0, restored=None)
    assert path.read_text() == text
    assert load_run_spec(tmp_path / "run").train_options() == spec.train_options()
    path.write_text("kept")
    record.started(plan, step=4, restored=None)  # a restart: not written again
    assert path.read_text() == "kept"

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    record = JobRecord(job, blocked, metrics=None)
    (blocked / "job.yaml").mkdir()  # os.replace onto a directory fails
    record.started(plan, step=0, restored=None)
    assert any(e.message.startswith(f"warning: cannot write {blocked}/job.yaml")
               for e in record.status().events)
