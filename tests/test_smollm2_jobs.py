"""The SmolLM2 GPU job files (jobs/smollm2-*-8xh100.yaml): `ringray plan` on one node of 8
H100s says they fit, with the ring's transfers hidden, and their headers quote its verdict.
They read the converted checkpoint's config.json (`ringray models make smollm2-135m`, made
here once and reused)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringray.cli import app
from ringray.model.gguf_import import cached_model
from ringray.spec import JobSpecError, load_job_spec

ROOT = Path(__file__).resolve().parent.parent

JOBS = {  # file: (seq_len, YaRN factor, dp, cp, the plan's verdict)
    "jobs/smollm2-32k-8xh100.yaml": (32768, 4.0, 2, 4, "fits: 34.0 GiB of 72.0 GiB"),
    "jobs/smollm2-128k-8xh100.yaml": (131072, 16.0, 1, 8, "fits: 18.4 GiB of 72.0 GiB"),
}


@pytest.fixture(scope="module", autouse=True)
def smollm2() -> Path:
    return cached_model("smollm2-135m")


@pytest.mark.parametrize("job", sorted(JOBS))
def test_the_gpu_job_fits_one_node_of_8_h100s(job: str) -> None:
    seq_len, factor, dp, cp, verdict = JOBS[job]
    result = CliRunner().invoke(app, ["plan", str(ROOT / job), "--cluster", "1x8xH100"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"mesh: dp {dp} x cp {cp} (zigzag) = 8 devices; seq {seq_len}" in out
    assert f"yarn x{factor:g} from 8192 tokens" in out
    assert "134.52M parameters, 30 layers, dim 576, heads 9/3" in out  # SmolLM2-135M
    assert "communication hidden" in out
    assert f"verdict: {verdict}" in out
    header = "".join(line for line in (ROOT / job).read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    assert verdict in " ".join(header.replace("#", " ").split())  # the header quotes it


def test_a_laptop_plans_the_job_from_the_checkpoints_config_alone(
        smollm2: Path, tmp_path: Path) -> None:
    """Planning reads the job file and the model's config.json, nothing else: a directory
    holding only config.json (no weights, no tokenizer) and a data path this machine lacks give
    the same verdict, where `ringray train` would refuse both."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_bytes((smollm2 / "config.json").read_bytes())
    job = "jobs/smollm2-32k-8xh100.yaml"
    overrides = ["--set", f"model.from_pretrained={tmp_path / 'model'}",
                 "--set", "run_dir=/proc/no-run-dir-here"]
    result = CliRunner().invoke(app, ["plan", str(ROOT / job), "--cluster", "1x8xH100",
                                      *overrides])
    assert result.exit_code == 0, result.output
    assert f"verdict: {JOBS[job][-1]}" in result.output
    with pytest.raises(JobSpecError, match="model.from_pretrained: .*no model.safetensors"):
        load_job_spec(ROOT / job, [o for o in overrides if o != "--set"])
