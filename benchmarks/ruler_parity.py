"""Does ``ringray eval`` score RULER as lm_eval's own ``hf`` model does? SmolLM2-135M-Instruct
(made locally: ``ringray models make smollm2-135m``), float32, CPU, the same samples through
both: ringray's ``ringray`` model over a 2-rank gloo ring (one thread per rank) and lm_eval's
``hf`` model (transformers, ``pretrained=DIR,dtype=float32,device=cpu``) in this process.

    .venv/bin/python benchmarks/ruler_parity.py --lengths 2048 --limit 2 --max-gen-toks 10

For each task and length: both scores, whether every sample had the same prompt (lm_eval's
prompt hash) and the same generated text. Then per-request log-likelihood differences
``|ringray - hf|`` (max and median) on two kinds of request: ``ringray_passkey`` (a
loglikelihood task: the key given the prompt) and every RULER sample's expected answer
(``" " + " ".join(outputs)``) given the prompt lm_eval made for it. Both sides build every
cell's data with :func:`ringray.harness.ruler.build_task` in their own process (rank 0 of the
ring; this process for hf), so equal prompt hashes also show the data is deterministic.

Cost: a sample is one forward of its prompt over the ring, then one decoding step a token
from the KV cache (``ringray.harness.kv_cache``); hf does the same in one process. Before the
cache each generated token re-ran the whole prompt: a 2048-token forward of SmolLM2 over a
ring of 2 took 20 to 30 s per rank on 2 cores loaded 5 to 15. Time ``--limit 1`` first and
size ``--limit`` from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

TASKS = ("niah_single_1", "niah_multikey_2", "ruler_fwe", "ringray_passkey")


def _uptime() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def gold_requests(plan) -> list[dict]:
    """Each generation sample's expected answer given its prompt, as lm_eval built the prompt:
    ``{"task", "length", "doc_id", "context", "continuation"}``."""
    from ringray.harness.ruler import build_task

    requests = []
    for task_name, length in plan.cells():
        if task_name == "ringray_passkey":
            continue
        task = build_task(task_name, length, pretrained=plan.pretrained)
        task.build_all_requests(limit=plan.limit, rank=0, world_size=1)
        for instance in task.instances:
            requests.append({"task": task_name, "length": length, "doc_id": instance.doc_id,
                             "context": instance.args[0],
                             "continuation": " " + " ".join(instance.doc["outputs"])})
    return requests


def score_gold(lm, requests: list[dict]) -> list[float]:
    from lm_eval.api.instance import Instance

    instances = [Instance(request_type="loglikelihood", doc={},
                          arguments=(r["context"], r["continuation"]), idx=i)
                 for i, r in enumerate(requests)]
    return [ll for ll, _ in lm.loglikelihood(instances, disable_tqdm=True)]


def run_side(lm, plan) -> None:
    """Evaluate ``plan`` with ``lm``, then score the gold answers; writes gold.json beside
    the plan's results."""
    from ringray.harness.evaluate import evaluate_plan

    started = time.monotonic()
    evaluate_plan(plan, lm=lm)
    evaluated = time.monotonic() - started
    requests = gold_requests(plan)
    started = time.monotonic()
    scores = score_gold(lm, requests)
    for request, score in zip(requests, scores, strict=True):
        request["loglikelihood"] = score
        del request["context"]
    Path(plan.out, "gold.json").write_text(json.dumps(
        {"requests": requests, "evaluate_seconds": evaluated,
         "gold_seconds": time.monotonic() - started}), encoding="utf-8")


def ring_entry(arguments: Sequence[str]) -> None:
    """Rank 0 of the ring (the launcher spawns this script's module)."""
    from ringray.harness.evaluate import EvalPlan
    from ringray.harness.lm import RingLM

    plan = EvalPlan.from_json(arguments[0])
    lm = RingLM(pretrained=plan.pretrained, cp=plan.cp, max_length=plan.model_max_length)
    run_side(lm, plan)


def _read(out: Path) -> tuple[dict, list[dict], dict]:
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").open()]
    gold = json.loads((out / "gold.json").read_text())
    return results, samples, gold


def _spread(values: list[float]) -> dict[str, float]:
    return {"max": max(values), "median": statistics.median(values), "count": len(values)} \
        if values else {"max": float("nan"), "median": float("nan"), "count": 0}


def compare(ring_out: Path, hf_out: Path) -> dict:
    ring, hf = _read(ring_out), _read(hf_out)
    cells = []
    hf_cells = {(c["task"], c["length"]): c for c in hf[0]["cells"]}
    for cell in ring[0]["cells"]:
        key = (cell["task"], cell["length"])
        ours = [s for s in ring[1] if (s["task"], s["length"]) == key]
        theirs = [s for s in hf[1] if (s["task"], s["length"]) == key]
        pairs = list(zip(ours, theirs, strict=True))
        same_prompts = sum(a["prompt_hash"] == b["prompt_hash"] for a, b in pairs)
        answer = "greedy" if cell["task"] == "ringray_passkey" else "response"
        same_answers = sum(a[answer] == b[answer] for a, b in pairs)
        cells.append({"task": cell["task"], "length": cell["length"],
                      "ringray": cell["score"], "hf": hf_cells[key]["score"],
                      "samples": cell["samples"], "same_prompts": same_prompts,
                      "same_answers": same_answers,
                      "ringray_seconds": cell["seconds"], "hf_seconds": hf_cells[key]["seconds"]})
    passkey = [abs(a["loglikelihood"] - b["loglikelihood"])
               for a, b in zip(ring[1], hf[1], strict=True)
               if a["task"] == "ringray_passkey" and b["task"] == "ringray_passkey"]
    gold = [abs(a["loglikelihood"] - b["loglikelihood"])
            for a, b in zip(ring[2]["requests"], hf[2]["requests"], strict=True)]
    return {"cells": cells, "loglikelihood": {"passkey": _spread(passkey),
                                              "ruler_gold": _spread(gold)},
            "responses": [{"task": a["task"], "doc_id": a["doc_id"],
                           "ringray": a.get("response"), "hf": b.get("response"),
                           "target": a["target"]}
                          for a, b in zip(ring[1], hf[1], strict=True) if "response" in a]}


def table(report: dict) -> str:
    lines = [f"{'task':<18}{'length':>7}{'ringray':>9}{'hf':>7}{'prompts':>9}{'answers':>9}"
             f"{'ringray s':>11}{'hf s':>8}"]
    for c in report["cells"]:
        lines.append(f"{c['task']:<18}{c['length']:>7}{100 * c['ringray']:>9.1f}"
                     f"{100 * c['hf']:>7.1f}{c['same_prompts']:>5}/{c['samples']:<3}"
                     f"{c['same_answers']:>5}/{c['samples']:<3}{c['ringray_seconds']:>11.0f}"
                     f"{c['hf_seconds']:>8.0f}")
    for name, spread in report["loglikelihood"].items():
        lines.append(f"log-likelihood |ringray - hf|, {name} ({spread['count']} requests): "
                     f"max {spread['max']:.2e}, median {spread['median']:.2e}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-gen-toks", type=int, default=10)
    parser.add_argument("--json", default="ruler-parity.json",
                        help="where to write the figures")
    parser.add_argument("--out", default=None, help="working directory (default: a temp one)")
    args = parser.parse_args()

    import torch

    from ringray.harness.evaluate import EvalPlan, offline_environment
    from ringray.harness.launch import launch
    from ringray.model.gguf_import import cached_model

    offline_environment()
    model = str(cached_model("smollm2-135m"))
    print(f"model: {model}", flush=True)
    work = Path(args.out or tempfile.mkdtemp(prefix="ruler-parity-"))
    common = dict(pretrained=model, tasks=tuple(args.tasks.split(",")),
                  lengths=tuple(int(n) for n in args.lengths.split(",")), limit=args.limit,
                  gen_kwargs={"max_gen_toks": args.max_gen_toks})
    ring_plan = EvalPlan(**common, out=str(work / "ringray"), cp=2)
    hf_plan = EvalPlan(**common, out=str(work / "hf"), cp=1)
    load_before = _uptime()
    print(f"load before: {load_before}", flush=True)

    started = time.monotonic()
    status = launch(2, [ring_plan.to_json()], entry=ring_entry, threads=1)
    ring_seconds = time.monotonic() - started
    if status != 0:
        print(f"the ring failed (status {status})", file=sys.stderr)
        return 1
    print(f"ringray (ring of 2, 1 thread each): {ring_seconds:.0f} s; load {_uptime()}",
          flush=True)

    import lm_eval.api.registry

    torch.set_num_threads(2)
    started = time.monotonic()
    hf = lm_eval.api.registry.get_model("hf").create_from_arg_string(
        f"pretrained={model},dtype=float32,device=cpu,max_length={hf_plan.model_max_length}",
        {"batch_size": 1})
    run_side(hf, hf_plan)
    hf_seconds = time.monotonic() - started
    print(f"hf (transformers, 2 threads): {hf_seconds:.0f} s; load {_uptime()}", flush=True)

    report = compare(work / "ringray", work / "hf")
    report.update(model=model, settings=common, ringray_seconds=ring_seconds,
                  hf_seconds=hf_seconds, load_before=load_before, load_after=_uptime(),
                  cpus=os.cpu_count(), work=str(work))
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(table(report))
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
