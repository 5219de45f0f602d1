"""Extend a pretrained model's context on CPU, end to end, and show what it bought.

    python examples/context_extension.py          # the whole demonstration (make extend-demo)
    python examples/context_extension.py --fresh  # delete the two run directories first

The stages (README: "Extending a pretrained model's context: a CPU demonstration"):

1. ``ringray train jobs/extend-1-short.yaml``: the debug model learns passkey retrieval at a
   short context (512 tokens), with the loss on the tokens only retrieval predicts.
2. ``ringray export runs/extend-1-short --hf runs/extend-1-short/hf``: a Hugging Face
   checkpoint (config.json, safetensors, tokenizer.json).
3. Before: that checkpoint, loaded as ``model.from_pretrained`` does, scored at the long
   length with the RoPE it was trained with and with the extension's RoPE change, with no
   fine-tune: ``runs/extend-2-long/passkey-before-*.json``. The evaluation's settings (lengths,
   depths, samples, seed) are the stage-2 job's, so before and after score the same prompts.
4. ``ringray train jobs/extend-2-long.yaml``: start from the export with a raised RoPE base and
   fine-tune briefly at 8192 tokens over a ring of 2; its own evaluation is the "after"
   (``passkey.json``).
5. ``ringray report runs/extend-2-long``: ``passkey.png`` shows exact match per depth, before
   and after, beside the training curves.

Prints each stage's wall time, the machine's load at the start and the end, and the
per-depth table, and writes ``runs/extend-2-long/demo.json`` with all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHORT_JOB = ROOT / "jobs/extend-1-short.yaml"
LONG_JOB = ROOT / "jobs/extend-2-long.yaml"


def _ringray(*args: str) -> float:
    """Run ``ringray ARGS`` (the CLI next to this interpreter); returns its wall seconds."""
    binary = Path(sys.executable).with_name("ringray")
    command = [str(binary) if binary.exists() else "ringray", *args]
    print(f"\n$ {' '.join(['ringray', *args])}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    return time.perf_counter() - start


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def evaluate_before(long_job: Path, hf_dir: Path, out_dir: Path) -> dict[str, dict]:
    """Score the exported model at the long job's passkey lengths, without any fine-tune:
    once with the RoPE it was trained with, once with the long job's ``model.rope`` change.
    Writes ``passkey-before-*.json`` (with a ``label``) into ``out_dir``; one process."""
    from ringray.data import HFTokenizer, evaluate_passkey
    from ringray.model import Transformer, load_hf_weights, load_pretrained
    from ringray.spec import load_job_spec

    options = load_job_spec(long_job, check_paths=False).train_options()
    tokenizer = HFTokenizer.from_pretrained(str(hf_dir))
    trained = load_pretrained(hf_dir)
    extended = Transformer(options.model)  # the checkpoint's shape with the job's RoPE
    load_hf_weights(extended, str(hf_dir))
    rope = options.model.rope_scaling
    change = f"RoPE theta {options.model.rope_theta:g}" + (
        f", {rope.kind} x{rope.factor:g}" if rope.kind != "none" else "")
    variants = {
        "before-1-trained-rope": (trained, "before: as exported, RoPE theta "
                                  f"{trained.config.rope_theta:g} (no fine-tune)"),
        "before-2-extended-rope": (extended, f"before: {change} (no fine-tune)"),
    }
    evaluation = options.eval
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, (model, label) in variants.items():
        model.eval()
        start = time.perf_counter()
        report = evaluate_passkey(
            lambda tokens, model=model: model(tokens).argmax(dim=-1), tokenizer,
            lengths=evaluation.passkey_lengths, depths=evaluation.passkey_depths,
            samples_per_cell=evaluation.passkey_samples, seed=evaluation.passkey_seed,
        )
        print(f"\n{label} ({time.perf_counter() - start:.0f} s)\n{report.format_table()}",
              flush=True)
        results[name] = {"label": label, **report.to_dict()}
        (out_dir / f"passkey-{name}.json").write_text(json.dumps(results[name], indent=2))
    return results


def _per_depth(report: dict) -> dict[str, float]:
    return {f"{c['length']}@{c['depth']:g}": c["accuracy"] for c in report["cells"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--fresh", action="store_true",
                        help="delete runs/extend-1-short and runs/extend-2-long first")
    args = parser.parse_args(argv)
    short_run, long_run = ROOT / "runs/extend-1-short", ROOT / "runs/extend-2-long"
    existing = [str(p) for p in (short_run, long_run) if p.exists()]
    if existing and not args.fresh:
        print(f"error: {', '.join(existing)} exist (a resumed run would only re-evaluate); "
              f"pass --fresh to delete them, or rm -rf them", file=sys.stderr)
        return 2
    for path in (short_run, long_run):
        shutil.rmtree(path, ignore_errors=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    load_start, start = _loadavg(), time.perf_counter()
    print(f"load average at start: {load_start}", flush=True)
    seconds = {"train_short": _ringray("train", str(SHORT_JOB))}
    hf_dir = short_run / "hf"
    seconds["export"] = _ringray("export", str(short_run), "--hf", str(hf_dir))
    before_start = time.perf_counter()
    before = evaluate_before(LONG_JOB, hf_dir, long_run)
    seconds["evaluate_before"] = time.perf_counter() - before_start
    seconds["train_long"] = _ringray("train", str(LONG_JOB))
    seconds["total"] = time.perf_counter() - start
    load_end = _loadavg()
    _ringray("report", str(long_run))

    after = json.loads((long_run / "passkey.json").read_text())
    short = json.loads((short_run / "passkey.json").read_text())
    summary = {
        "seconds": seconds, "loadavg_start": load_start, "loadavg_end": load_end,
        "short": _per_depth(short),
        **{name: _per_depth(report) for name, report in before.items()},
        "after": _per_depth(after),
    }
    (long_run / "demo.json").write_text(json.dumps(summary, indent=2))
    print("\nexact match per length@depth:")
    rows = ["short", *before, "after"]
    keys = list(summary["after"])
    print(f"{'':26}" + "".join(f"{k:>12}" for k in keys))
    for row in rows[1:]:
        print(f"{row:26}" + "".join(f"{summary[row].get(k, float('nan')):>12.2f}" for k in keys))
    print(f"short-context model at its own length: {short['accuracy']:.2f} exact match")
    print("wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    print(f"load average: start {load_start}, end {load_end}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
