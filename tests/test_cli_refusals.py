"""What `ringray train`, `resume` and `export` refuse before anything starts, each in one line
with exit code 2 and never a traceback (issue 28): an address where no Ray answers (within
seconds, not minutes), a job whose workers cannot fit this machine's memory, a resume past its
own train.steps, an embedded Ray that does not start, an export onto a file."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ringray.cli import app
from ringray.spec import load_job_spec
from ringray.spec.run_spec import write_run_spec
from ringray.train import CheckpointStore

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
RINGRAY = str(Path(sys.executable).parent / "ringray")


def _ringray(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    try:
        result = subprocess.run([RINGRAY, *args], cwd=ROOT, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ringray {' '.join(args[:2])} gave no answer within {timeout:.0f} s")
    return result, time.monotonic() - started


def _one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _short(run_dir: Path) -> list[str]:
    return ["--set", f"run_dir={run_dir}", "--set", "train.seq_len=512", "--set",
            "parallel.cp=2", "--set", "eval.passkey_lengths=[]", "--set", "metrics.port=null"]


def test_an_address_where_nothing_listens_fails_within_seconds(tmp_path: Path) -> None:
    """It waited 290 s and more, with only Ray's warnings, before."""
    port = _free_port()
    result, took = _ringray("train", "jobs/quickstart.yaml", "--address",
                            f"127.0.0.1:{port}", *_short(tmp_path / "run"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]  # the job's banner comes first
    assert line.startswith("error: ") and "Ray" not in result.stdout
    assert f"--address 127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}: connection " \
           f"refused" in line
    assert took < 60  # the probe waits 5 s at most; the rest is Python and torch starting


def test_an_address_from_ray_address_is_named_as_such(tmp_path: Path, monkeypatch) -> None:
    """An address taken from $RAY_ADDRESS was reported as --address, which the user never
    gave (issue 40)."""
    port = _free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    result, _ = _ringray("train", "jobs/quickstart.yaml", *_short(tmp_path / "run"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"on Ray at 127.0.0.1:{port} (from $RAY_ADDRESS)" in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: $RAY_ADDRESS 127.0.0.1:{port}: nothing answers"), line


def test_a_job_that_cannot_fit_this_machine_is_refused_before_ray(tmp_path: Path) -> None:
    """seq 16M on CPU: the plan's per-worker peak is hundreds of GiB; refused with the
    figures (it ran, workers grew to 9 GB each until Ray killed them, before)."""
    run_dir = tmp_path / "run"
    result, took = _ringray("train", "jobs/quickstart.yaml", *_short(run_dir),
                            "--set", "train.seq_len=16777216", timeout=90)
    assert result.returncode == 2, result.stderr[-3000:]
    line = _one_line(result.stderr)
    assert "memory: one worker needs about" in line
    assert "this host's available memory" in line and "shared by 2 workers" in line
    assert "(--force starts it anyway)" in line
    assert not run_dir.exists()  # nothing was started, nothing written


def test_a_resume_below_its_checkpoints_step_is_refused(tmp_path: Path) -> None:
    """It restored step 20, trained nothing and said "finished at step 20/10" before."""
    run_dir = tmp_path / "run"
    CheckpointStore(str(run_dir / "checkpoints"), lineage="old").save(
        20, {"w": torch.zeros(2)}, keep=3)
    result, _ = _ringray("train", "jobs/quickstart.yaml", "--steps", "10", *_short(run_dir))
    assert result.returncode == 2, result.stderr[-3000:]
    line = _one_line(result.stderr)
    assert "train.steps: 10 is below step 20 of the checkpoint this run resumes" in line
    assert "set train.steps to 20 or more (--steps with ringray train)" in line


def test_an_embedded_ray_that_does_not_start_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """Ray's start timing out on a loaded machine raised a plain Exception: a traceback."""
    import ray

    def times_out(**kwargs):
        raise Exception("The current node timed out during startup. This could happen "
                        "because some of the raylet failed to startup or the GCS has become "
                        "overloaded.")

    monkeypatch.setattr(ray, "init", times_out)
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, ["train", "jobs/quickstart.yaml",
                                      *_short(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "error: cannot start a local Ray (The current node timed out during startup. " \
           "This could happen" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_an_export_onto_a_file_names_it(tmp_path: Path, monkeypatch) -> None:
    """It said "[Errno 17] File exists" before, naming neither the path nor the problem."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = load_job_spec(ROOT / "jobs/quickstart.yaml", [f"run_dir={run_dir}"],
                         check_paths=False)
    write_run_spec(spec, run_dir=str(run_dir))
    target = tmp_path / "model.safetensors"
    target.write_text("not a directory")
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, ["export", str(run_dir), "--hf", str(target)])
    assert result.exit_code == 2, result.output
    assert _one_line(result.output) == f"error: --hf: '{target}' is a file; give a directory"
    result = CliRunner().invoke(app, ["export", str(run_dir), "--hf", f"{target}/out"])
    assert result.exit_code == 2
    assert f"cannot be created: {target} is a file" in _one_line(result.output)


def test_an_export_shard_size_that_is_not_a_size_is_refused_in_one_line(tmp_path: Path) -> None:
    for bad, why in (("5XB", "is not a size"), ("0", "must be at least 1 byte"),
                     ("-1GB", "is not a size")):
        result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--hf",
                                          str(tmp_path / "out"), "--max-shard-size", bad])
        assert result.exit_code == 2, result.output
        line = _one_line(result.output)
        assert line.startswith(f"error: --max-shard-size: '{bad}' {why}"), line
    assert not (tmp_path / "out").exists()  # refused before anything is read or written


def _checkpointed_run(tmp_path: Path, *, trained: list[str], described: list[str],
                      steps: tuple[int, ...] = (2,)) -> Path:
    """A run directory whose job.yaml describes the model ``described`` (overrides of the
    quickstart), holding checkpoints at ``steps`` of the model ``trained``."""
    from ringray.model import Transformer

    run_dir = tmp_path / "run"
    spec = load_job_spec(ROOT / "jobs/quickstart.yaml", [f"run_dir={run_dir}", *trained],
                         check_paths=False)
    options = spec.train_options()
    torch.manual_seed(0)
    weights = {k: v.detach() for k, v in Transformer(options.model).named_parameters()}
    store = CheckpointStore(options.checkpoint_location, lineage="run")
    for step in steps:
        store.save(step, {"model": weights}, keep=3,
                   extra={"model_config": options.model.to_dict()})
    described_spec = load_job_spec(ROOT / "jobs/quickstart.yaml",
                                   [f"run_dir={run_dir}", *described], check_paths=False)
    write_run_spec(described_spec, run_dir=str(run_dir))
    return run_dir


def test_an_export_whose_job_file_describes_another_model_is_refused(
        tmp_path: Path, monkeypatch) -> None:
    """A 3-layer checkpoint under a job.yaml of 2 layers exported 2 layers, silently dropping
    the third, before; a changed rope_theta was written into config.json."""
    monkeypatch.chdir(ROOT)
    for described, field in ((["model.n_layers=2"], "n_layers: 3 in the checkpoint, 2 now"),
                             (["model.n_layers=3", "model.rope_theta=500.0"], "rope_theta")):
        run_dir = _checkpointed_run(tmp_path / field.split(":")[0], trained=["model.n_layers=3"],
                                    described=described)
        out = tmp_path / f"out-{field.split(':')[0]}"
        result = CliRunner().invoke(app, ["export", str(run_dir), "--hf", str(out)])
        assert result.exit_code == 2, result.output
        line = _one_line(result.output)
        assert line.startswith("error: model: checkpoint ") and field in line, line
        assert "the run directory's job.yaml does not describe it" in line
        assert not (out / "config.json").exists()
    run_dir = _checkpointed_run(tmp_path / "same", trained=["model.n_layers=3"],
                                described=["model.n_layers=3"])
    result = CliRunner().invoke(app, ["export", str(run_dir), "--hf", str(tmp_path / "ok")])
    assert result.exit_code == 0, result.output
    assert '"num_hidden_layers": 3' in (tmp_path / "ok" / "config.json").read_text()


def test_an_export_names_the_damaged_checkpoints_it_passes_over(
        tmp_path: Path, monkeypatch) -> None:
    """Step 3's marker cut short: the export took step 2 without a word before."""
    monkeypatch.chdir(ROOT)
    run_dir = _checkpointed_run(tmp_path, trained=[], described=[], steps=(2, 3))
    (marker,) = (run_dir / "checkpoints").glob("step_00000003*/ringray-complete.json")
    marker.write_text('{"format": 3, "st')
    result = CliRunner().invoke(app, ["export", str(run_dir), "--hf", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "refused checkpoint " in result.output and "step_00000003" in result.output
    assert "is unreadable (JSONDecodeError" in result.output
    assert "exported step 2" in result.output
    result = CliRunner().invoke(app, ["export", str(run_dir), "--hf", str(tmp_path / "out3"),
                                      "--step", "3"])
    assert result.exit_code == 2, result.output
    line = _one_line(result.output)
    assert "step_00000003" in line and "is unreadable (JSONDecodeError" in line, line


@pytest.mark.parametrize(("args", "line"), [
    (["--cluster", "[/b]"],  # rich markup: a MarkupError traceback before
     "error: --cluster: '[/b]' is not of the form NODESxGPUSxACCELERATOR, e.g. 4x8xH100"),
    (["--cluster", "1x8xH100", "--documents", "lognormal:100:0"],  # ':100:' became an emoji
     "error: --documents: 'lognormal:100:0': SIGMA must be a number in (0, 4], e.g. "
     "lognormal:100:2"),
    (["--cluster", "1x8xH100", "--set", "eval.passkey_lengths=[abc"],  # '[abc...' swallowed
     "error: --set 'eval.passkey_lengths=[abc': the value is not valid YAML"),
])
def test_an_error_is_printed_as_it_is_not_as_rich_markup(args: list[str], line: str) -> None:
    result = CliRunner().invoke(app, ["plan", str(ROOT / "jobs/quickstart.yaml"), *args])
    assert result.exit_code == 2, result.output
    assert _one_line(result.output).startswith(line), result.output


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:10001", "auto"])
def test_a_jobs_address_that_is_not_a_url_is_refused_at_once(address: str) -> None:
    """Ray took host:port for a GCS address and ray:// for a Ray Client one: 30-40 s and
    Ray's own warnings before the error."""
    started = time.monotonic()
    result = CliRunner().invoke(app, ["status", "nope", "--address", address])
    assert result.exit_code == 2, result.output
    assert _one_line(result.output) == (f"error: --address {address!r}: give the Ray "
                                        f"dashboard's URL (the Jobs API), e.g. http://head:8265")
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(("args", "line"), [
    (["status"], "error: Missing argument 'ID'. (see ringray status --help)"),
    (["bench", "ring", "--world", "0"], "error: Invalid value for '--world': Input should be "
                                        "greater than or equal to 1 (see ringray bench ring "
                                        "--help)"),
])
def test_a_usage_error_of_the_command_is_one_line(args: list[str], line: str) -> None:
    """click's usage errors were a five-line box; exit code 2 either way."""
    result, _ = _ringray(*args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert _one_line(result.stderr) == line


@pytest.mark.parametrize("submission_id", ["", "../../api/version", "a b"])
def test_a_submission_id_that_cannot_be_one_is_refused_before_asking(submission_id: str) -> None:
    """The SDK's parsing errors came back as the message ("JobDetails() argument after **
    must be a mapping"), after a round trip to the cluster."""
    for command in ("status", "logs", "stop", "resume"):
        result = CliRunner().invoke(app, [command, submission_id, "--address",
                                          "http://127.0.0.1:9"])
        assert result.exit_code == 2, result.output
        expected = (f"error: ID: {submission_id!r} is not a submission id"
                    if submission_id or command != "resume" else "error: RUN: empty; give a "
                    "run directory")  # resume took "" for the current directory
        assert _one_line(result.output).startswith(expected), result.output


def test_a_resume_with_no_committed_checkpoint_says_it_starts_over(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The only save crashed before its commit: the resume trained from step 0 without a
    word before."""
    from ringray.cli.jobs import _say_when_nothing_resumes

    run_dir = tmp_path / "run"
    spec = load_job_spec(ROOT / "jobs/quickstart.yaml", [f"run_dir={run_dir}"],
                         check_paths=False)
    (run_dir / "checkpoints" / "step_00000002-0a1b2c3d").mkdir(parents=True)  # no marker
    _say_when_nothing_resumes(spec, str(run_dir))
    line = _one_line(capsys.readouterr().err)
    assert line == (f"warning: {run_dir / 'checkpoints'} holds no committed checkpoint (a save "
                    f"that did not complete is not one); {run_dir} trains again from step 0")
    CheckpointStore(str(run_dir / "checkpoints"), lineage="run").save(
        4, {"w": torch.zeros(2)}, keep=3)
    _say_when_nothing_resumes(spec, str(run_dir))
    assert capsys.readouterr().err == ""
