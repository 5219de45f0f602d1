"""Invalid job specs through the real CLI entry: ``ringray train jobs/quickstart.yaml --set ...``
exits with code 2 and exactly one line on stderr that names the field, the bad value and what
would be valid; no traceback, and Ray is never started (the spec is checked first).

The table runs in-process through typer's runner (``ringray.cli.app``, with ``ray.init``
replaced by a tripwire); two cases also run the installed ``ringray`` console script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import ray
from typer.testing import CliRunner

from ringray.cli import app

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "jobs/quickstart.yaml")

# (id, --set overrides, pieces the one line must contain: the field, the value, what is valid)
CASES: list[tuple[str, list[str], list[str]]] = [
    ("wrong type: word for an integer", ["train.steps=ten"],
     ["train.steps: 'ten' is not an integer", "e.g. 100"]),
    ("wrong type: fraction for an integer", ["train.global_batch=2.5"],
     ["train.global_batch: 2.5 is not an integer"]),
    ("wrong type: quoted number", ['train.seq_len="4096"'],
     ["train.seq_len: '4096' is not an integer"]),
    ("wrong type: boolean for an integer", ["parallel.cp=true"],
     ["parallel.cp: true is not an integer"]),
    ("wrong type: word for a number", ["train.optimizer.lr=fast"],
     ["train.optimizer.lr: 'fast' is not a number", "e.g. 0.003"]),
    ("wrong type: number for a boolean", ["checkpoint.resume=1"],
     ["checkpoint.resume: 1 is not a boolean", "true or false"]),
    ("wrong type: scalar for a section", ["train.optimizer=3"],
     ["train.optimizer: 3 is not a section", "lr, min_lr_ratio, warmup_steps"]),
    ("wrong type: scalar for a list", ["eval.passkey_lengths=4096"],
     ["eval.passkey_lengths: 4096 is not a list", "e.g. [1024, 4096]"]),
    ("not a finite number", ["train.optimizer.lr=.nan"],
     ["train.optimizer.lr: nan is not a finite number"]),
    ("unknown key", ["train.stepz=3"],
     ["train.stepz: unknown field; valid: steps, global_batch, seq_len"]),
    ("unknown section", ["trainer.steps=3"],
     ["trainer: unknown field; valid: name, run_dir, model, data"]),
    ("unknown choice", ["parallel.layout=spiral"],
     ["parallel.layout: 'spiral' is not one of 'contiguous', 'zigzag', 'striped'"]),
    ("literal choice", ["cluster.accelerator=tpu"],
     ["cluster.accelerator: 'tpu' is not one of 'cpu', 'gpu'"]),
    ("impossible divisibility: layout over the ring", ["parallel.cp=3"],
     ["train.seq_len: 4096 cannot be split by layout 'zigzag' over cp=3 ranks",
      "use a multiple of 6"]),
    ("impossible divisibility: batch over dp", ["parallel.dp=3"],
     ["train.global_batch: 2 does not split over parallel.dp=3 replicas", "multiple of 3"]),
    ("impossible divisibility: heads over kv heads", ["model.n_kv_heads=3"],
     ["model.n_kv_heads: n_heads=4 is not divisible by n_kv_heads=3"]),
    ("dp range", ["cluster.dp_min=2"],
     ["cluster.dp_min: 2 is larger than parallel.dp=1", "use a value from 1 to 1"]),
    ("fractional GPUs for a GPU job",
     ["cluster.accelerator=gpu", "cluster.worker_resources={GPU: 0.5, CPU: 4}"],
     ["cluster.worker_resources: GPU: 0.5 with accelerator gpu", "give GPU: 1"]),
    ("GPUs for a CPU job", ["cluster.worker_resources={GPU: 1}"],
     ["cluster.worker_resources: GPU: 1 with accelerator cpu",
      "set cluster.accelerator: gpu, or leave GPU out"]),
    ("zero of a resource", ["cluster.worker_resources={CPU: 0}"],
     ["cluster.worker_resources.CPU: 0 is not positive", "amount > 0"]),
    ("resource name in the wrong case", ["cluster.worker_resources={cpu: 1}"],
     ["cluster.worker_resources.cpu: Ray's resource names are case-sensitive; write CPU"]),
    ("negative interval", ["checkpoint.interval=-5"],
     ["checkpoint.interval: -5 is too small; use an integer >= 0"]),
    ("zero log interval", ["train.log_every=0"],
     ["train.log_every: 0 is too small; use an integer >= 1"]),
    ("missing data path", ["data.source=files", "data.path=no/such/corpus"],
     ["data.path: 'no/such/corpus' does not exist", "give a directory of .txt/.jsonl files"]),
    ("data path required", ["data.source=files"],
     ["data.path: required when source is 'files'"]),
    ("run directory under a file", ["run_dir=README.md/run"],
     ["run_dir: 'README.md/run' cannot be created", "README.md is a file"]),
    ("unknown checkpoint URL scheme", ["checkpoint.path=bucket://x/y"],
     ["checkpoint.path: 'bucket://x/y' has a URL scheme 'bucket' that fsspec does not know",
      "s3://"]),
    ("passkey depth outside [0, 1]", ["eval.passkey_depths=[0.5, 1.5]"],
     ["eval.passkey_depths[1]: 1.5 is too large; use a number <= 1"]),
    ("passkey length too short for the needle", ["eval.passkey_lengths=[64]"],
     ["eval.passkey_lengths: [64] cannot hold the needle", "at least 166"]),
    ("passkey length repeated", ["eval.passkey_lengths=[1024, 1024]"],
     ["eval.passkey_lengths: [1024, 1024] repeats [1024]; give each value once"]),
    ("sequence length past the sane bound", ["train.seq_len=1000000000"],
     ["train.seq_len: 1000000000 is too large; use an integer from 2 to 16777216"]),
    ("metrics address not a host", ["metrics.address=local host"],
     ["metrics.address: 'local host' is not an IP address or a host name", "127.0.0.1"]),
    ("port out of range", ["metrics.port=70000"],
     ["metrics.port: 70000 is too large; use an integer from 0 to 65535"]),
    ("unsafe job name", ["name=../other-job"],
     ["name: '../other-job' is not a safe job name", "letters, digits, '-', '_' and '.'"]),
    ("null for a required value", ["train.steps=null"],
     ["train.steps: null is not allowed here; e.g. 100"]),
    ("malformed override", ["train.steps"],
     ["--set 'train.steps': expected section.key=value"]),
]


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting Ray fails the test: an invalid spec must be reported before it."""

    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init was called for an invalid spec")

    monkeypatch.setattr(ray, "init", tripwire)


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 20
    assert len({case_id for case_id, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize(("overrides", "pieces"), [(o, p) for _, o, p in CASES],
                         ids=[case_id for case_id, _, _ in CASES])
def test_invalid_spec_is_one_line_with_field_value_and_fix(
    overrides: list[str], pieces: list[str], no_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # relative paths in the table are from the repository
    args = ["train", QUICKSTART] + [arg for item in overrides for arg in ("--set", item)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    line = _one_error_line(result.stderr)
    assert line.startswith("error: ")
    for piece in pieces:
        assert piece in line
    assert result.stdout == ""


@pytest.mark.parametrize("overrides", [["train.steps=ten"],
                                       ["parallel.cp=3", "train.optimizer.lr=fast"]])
def test_the_console_script_prints_one_line(overrides: list[str]) -> None:
    """The installed ``ringray`` script in a real process (rich's console, no terminal): one
    line however long the message, even with two problems, exit code 2."""
    script = Path(sys.executable).with_name("ringray")
    args = [str(script), "train", QUICKSTART]
    args += [arg for item in overrides for arg in ("--set", item)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    line = _one_error_line(result.stderr)
    assert "is not" in line and ("train.steps" in line or "train.optimizer.lr" in line)
