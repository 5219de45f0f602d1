"""The real-model quickstart (`make run-real`, jobs/smollm2-quickstart.yaml): SmolLM2-135M, a
few fine-tuning steps over a ring of 2 at 2048 tokens through `ringray train` on an embedded
Ray, then passkey retrieval at 4096 tokens through the ring, scored by exact match. The job
and the target are checked fast; the run itself (about 4.5 minutes on 2 cores) is `slow`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringray.model.gguf_import import cached_model, default_cache_root
from ringray.spec import load_job_spec

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs/smollm2-quickstart.yaml"
RINGRAY = str(Path(sys.executable).parent / "ringray")


def test_the_job_fine_tunes_smollm2_over_a_ring_of_2_then_scores_passkey_at_4k() -> None:
    """What the README promises of it: the converted SmolLM2 from the model cache, a ring of 2
    at 2048 tokens, a handful of steps at a fine-tuning learning rate (1e-5: 6/6 exact match
    afterwards; the default 3e-3 is a from-scratch rate), passkey at 4096 through the ring."""
    cached_model("smollm2-135m")
    spec = load_job_spec(JOB)  # the local checks too: the checkpoint and its tokenizer
    options = spec.train_options()
    assert Path(options.pretrained).expanduser() == default_cache_root() / "smollm2-135m"
    assert options.model.num_params() == pytest.approx(134.5e6, rel=1e-3)
    assert (spec.parallel.dp, spec.parallel.cp) == (1, 2)
    assert (options.train.seq_len, options.train.steps, options.train.global_batch) == (
        2048, 4, 1)
    assert options.train.optimizer.lr <= 2e-5
    assert options.eval.passkey_lengths == (4096,)
    assert len(options.eval.passkey_depths) * options.eval.passkey_samples == 6
    assert spec.cluster.accelerator == "cpu"


def test_make_run_real_makes_the_model_starts_over_and_trains_the_job() -> None:
    """`make run-real`: the model made (or reused), the run directory cleared, the job trained
    on an embedded Ray; `make run` is still the debug quickstart."""
    def recipe(target: str) -> list[str]:
        dry = subprocess.run(["make", "-n", "--no-print-directory", "-o",
                              ".venv/.ringray-installed", target],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        return dry.stdout.splitlines()

    assert recipe("run-real") == [
        ".venv/bin/ringray models make smollm2-135m >/dev/null",
        "rm -rf runs/smollm2-quickstart",
        ".venv/bin/ringray train jobs/smollm2-quickstart.yaml",
    ]
    assert recipe("run") == [".venv/bin/ringray train jobs/quickstart.yaml"]
    assert "make run-real" in (ROOT / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_real_quickstart_retrieves_through_the_ring(tmp_path: Path) -> None:
    """The job end to end, its output piped (as CI's is): it finishes, its passkey line
    leads with exact match, SmolLM2 answers (at least 5 of 6 prompts at 4096; 6/6 measured),
    and the metrics line and the live line's end are printed once each, whole."""
    cached_model("smollm2-135m")
    run_dir = tmp_path / "run"
    result = subprocess.run([RINGRAY, "train", str(JOB), "--set", f"run_dir={run_dir}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "job 'smollm2-quickstart' finished at step 4/4" in result.stdout
    report = json.loads((run_dir / "passkey.json").read_text())
    assert report["lengths"] == [4096]
    assert report["accuracy"] >= 5 / 6, report
    err = result.stderr
    passkey = [line for line in err.splitlines() if "passkey: exact match" in line]
    assert len(passkey) == 1 and "prompts; 4096: " in passkey[0], err
    assert err.count("metrics: http") == 1, err
    finished = [line for line in err.splitlines() if line.startswith("finished ")]
    assert len(finished) == 1 and finished[0].endswith("restarts 0"), err
    assert "…" not in err
