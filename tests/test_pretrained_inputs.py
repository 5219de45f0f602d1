"""A broken ``model.from_pretrained`` checkpoint is refused before Ray starts, in one line that
names the file and what is wrong with it (issue 28, items 4 and 5): the job spec's up-front
check (:func:`ringray.spec.load_job_spec`, which ``ringray train`` runs first) raises a
one-line ``ValueError``, and ``ringray train`` prints it as its only line and exits 2 without
calling ``ray.init``. Where a worker would read the same file, it raises the same
``ValueError`` (which the controller does not retry)."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
import yaml
from hf_cases import write_tokenizer
from typer.testing import CliRunner

from ringray.cli import app
from ringray.model import ModelConfig, Transformer, load_pretrained, save_pretrained
from ringray.spec import JobSpecError, load_job_spec


def _checkpoint(directory: Path) -> Path:
    """A tiny checkpoint that loads: ringray's debug model (320-token vocabulary, room for
    the tiny tokenizer's 261) saved by ringray's own ``save_pretrained``, with a tokenizer."""
    save_pretrained(Transformer(ModelConfig()), directory)
    write_tokenizer(directory)
    return directory


def _spec(tmp_path: Path, from_pretrained: Path) -> Path:
    spec = {
        "name": "broken-pretrained", "run_dir": str(tmp_path / "run"),
        "model": {"from_pretrained": str(from_pretrained)},
        "parallel": {"dp": 1, "cp": 1},
        "train": {"steps": 2, "global_batch": 1, "seq_len": 64},
        "eval": {"passkey_lengths": []},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _header_claims_a_petabyte(ckpt: Path) -> Path:
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = struct.pack("<Q", 10**15)
    weights.write_bytes(bytes(data))
    return ckpt


def _five_bytes(ckpt: Path) -> Path:
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 5)
    return ckpt


def _a_file_not_a_directory(ckpt: Path) -> Path:
    return ckpt / "model.safetensors"


def _config_is_a_list(ckpt: Path) -> Path:
    (ckpt / "config.json").write_text("[1, 2]")
    return ckpt


def _broken_tokenizer(ckpt: Path) -> Path:
    text = (ckpt / "tokenizer.json").read_text()
    (ckpt / "tokenizer.json").write_text(text[: len(text) // 2])
    return ckpt


def _truncated_weights(ckpt: Path) -> Path:
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1000])
    return ckpt


# case -> (what breaks the checkpoint and returns the from_pretrained path, the file the
# message names relative to the checkpoint, what the message says is wrong)
BROKEN: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    "header length of 10**15": (
        _header_claims_a_petabyte, "model.safetensors",
        r"header length 1000000000000000 bytes is more than the \d+ bytes after it"),
    "5-byte model.safetensors": (
        _five_bytes, "model.safetensors", "5 bytes, too short for a safetensors file"),
    "from_pretrained names a file": (
        _a_file_not_a_directory, "model.safetensors",
        "is a file; give the checkpoint's directory"),
    "config.json holds [1, 2]": (
        _config_is_a_list, "config.json", r"expected a JSON object, got \[1, 2\]"),
    "broken tokenizer.json": (
        _broken_tokenizer, "tokenizer.json", "not a tokenizer the tokenizers library reads"),
    "truncated model.safetensors": (
        _truncated_weights, "model.safetensors",
        r"truncated: tensor \S+ ends at byte \d+ but the file has \d+ bytes"),
}


def _expected(ckpt: Path, case: str) -> str:
    _, file, what = BROKEN[case]
    return rf"model\.from_pretrained: {re.escape(str(ckpt))}/{file}: .*{what}"


@pytest.mark.parametrize("case", list(BROKEN))
def test_the_up_front_check_names_the_file_in_one_line(tmp_path: Path, case: str) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    breaks, _, _ = BROKEN[case]
    spec_path = _spec(tmp_path, breaks(ckpt))
    with pytest.raises(JobSpecError) as raised:
        load_job_spec(spec_path)
    message = str(raised.value)
    assert isinstance(raised.value, ValueError) and "\n" not in message, message
    assert re.search(_expected(ckpt, case), message), message


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting Ray fails the test: a broken checkpoint must be reported before it."""

    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init was called for a broken checkpoint")

    monkeypatch.setattr(ray, "init", tripwire)


@pytest.mark.parametrize("case", list(BROKEN))
def test_ringray_train_refuses_it_in_one_line_before_ray(
    tmp_path: Path, case: str, no_ray: None
) -> None:
    import re

    ckpt = _checkpoint(tmp_path / "ckpt")
    breaks, _, _ = BROKEN[case]
    result = CliRunner().invoke(app, ["train", str(_spec(tmp_path, breaks(ckpt)))])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.search(r"^error: " + _expected(ckpt, case), lines[0]), lines[0]
    assert not (tmp_path / "run").exists()  # nothing written for a refused job


@pytest.mark.parametrize("case", ["header length of 10**15", "5-byte model.safetensors",
                                  "truncated model.safetensors"])
def test_a_worker_loading_it_gets_the_same_value_error(tmp_path: Path, case: str) -> None:
    """A worker loads with :func:`load_pretrained`: the same one-line ``ValueError``, which the
    controller reports as a job error instead of retrying the workers."""
    ckpt = _checkpoint(tmp_path / "ckpt")
    breaks, file, what = BROKEN[case]
    with pytest.raises(ValueError, match=rf"^{re.escape(str(ckpt))}/{file}: .*{what}"):
        load_pretrained(breaks(ckpt))
