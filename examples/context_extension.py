"""Extend a pretrained model's context on CPU, end to end, and show what it bought.

    python examples/context_extension.py          # the whole demonstration (make extend-demo)
    python examples/context_extension.py --fresh  # delete the three run directories first

The stages (docs/pretrained.md: "Extending a pretrained model's context: a CPU demonstration"):

1. ``ringray train jobs/extend-1-short.yaml``: the debug model learns passkey retrieval at a
   short context (256 tokens), with the loss on the tokens only retrieval predicts; then
   ``ringray export runs/extend-1-short --hf runs/extend-1-short/hf`` writes a Hugging Face
   checkpoint (config.json, safetensors, tokenizer.json).
2. ``ringray train jobs/extend-2-mid.yaml``: from that export, RoPE base x16, fine-tuned at
   1024 tokens over a ring of 2; exported in turn.
3. ``ringray train jobs/extend-3-long.yaml``: from stage 2's export, RoPE base x16 again,
   fine-tuned at 8192 tokens over a ring of 2.

Before stages 2 and 3, the export they start from is scored at the stage's length with no
fine-tune, loaded as ``model.from_pretrained`` loads it: once with the RoPE it was trained
with and once with the stage's RoPE change (``runs/<stage>/passkey-before-*.json``; the
stage job's evaluation settings, so before and after score the same prompts). Each stage's
own evaluation is its "after" (``passkey.json``), and ``ringray report runs/<stage>`` draws
``passkey.png``: exact match per depth, before and after, beside the training curves.

Prints each stage's wall time, the machine's load at the start and the end, and the
per-depth table, and writes ``runs/extend-3-long/demo.json`` with all of it.
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
STAGES = ("extend-1-short", "extend-2-mid", "extend-3-long")
"""The demonstration's jobs (``jobs/<name>.yaml``, run directory ``runs/<name>``), in order:
each later one starts from the export of the one before."""


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


def evaluate_before(job: Path, hf_dir: Path, out_dir: Path) -> dict[str, dict]:
    """Score the export ``hf_dir`` at ``job``'s passkey lengths, without any fine-tune: once
    with the RoPE it was trained with, once with the job's ``model.rope`` change. Writes
    ``passkey-before-*.json`` (with a ``label``) into ``out_dir``; one process."""
    from ringray.data import HFTokenizer, evaluate_passkey
    from ringray.model import Transformer, load_hf_weights, load_pretrained
    from ringray.spec import load_job_spec

    options = load_job_spec(job, check_paths=False).train_options()
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
                        help="delete the stages' run directories (runs/extend-*) first")
    args = parser.parse_args(argv)
    runs = [ROOT / "runs" / name for name in STAGES]
    existing = [str(p) for p in runs if p.exists()]
    if existing and not args.fresh:
        print(f"error: {', '.join(existing)} exist (a resumed run would only re-evaluate); "
              f"pass --fresh to delete them, or rm -rf them", file=sys.stderr)
        return 2
    for path in runs:
        shutil.rmtree(path, ignore_errors=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    load_start, start = _loadavg(), time.perf_counter()
    print(f"load average at start: {load_start}", flush=True)
    seconds: dict[str, float] = {}
    summary: dict[str, dict] = {}
    for number, (name, run) in enumerate(zip(STAGES, runs, strict=True)):
        job = ROOT / "jobs" / f"{name}.yaml"
        if number:  # score the export this stage starts from, before any fine-tune
            before_start = time.perf_counter()
            before = evaluate_before(job, runs[number - 1] / "hf", run)
            seconds[f"{name}: evaluate before"] = time.perf_counter() - before_start
            summary.update({f"{name} {variant}": _per_depth(report)
                            for variant, report in before.items()})
        seconds[f"{name}: train"] = _ringray("train", str(job))
        summary[f"{name} after"] = _per_depth(json.loads((run / "passkey.json").read_text()))
        if number < len(STAGES) - 1:
            seconds[f"{name}: export"] = _ringray("export", str(run), "--hf", str(run / "hf"))
    seconds["total"] = time.perf_counter() - start
    load_end = _loadavg()
    for run in runs[1:]:
        _ringray("report", str(run))

    result = {"seconds": seconds, "loadavg_start": load_start, "loadavg_end": load_end,
              "exact_match": summary}
    (runs[-1] / "demo.json").write_text(json.dumps(result, indent=2))
    print("\nexact match per length@depth:")
    for row, cells in summary.items():
        print(f"{row:44}" + "".join(f"{k:>10} {v:.2f}" for k, v in cells.items()))
    print("wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    print(f"load average: start {load_start}, end {load_end}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
