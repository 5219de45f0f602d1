"""The whole GPU check in one command (``make gpu-check``), for the day a GPU is lent.

    python benchmarks/gpu_check.py                    # writes benchmarks/gpu-check-<gpu>.json
    python benchmarks/gpu_check.py --quick            # the smaller sizes: a first look
    python benchmarks/gpu_check.py --phases correctness,overflow

It runs with the Python it is started with and the torch installed there: on a GPU machine,
the machine's own CUDA build (``make gpu-check`` never installs torch; the few pure-Python
wheels the image may lack travel in ``.whl/``). It refuses to pass without the GPU:

- **a GPU it cannot use is a failure.** When ``nvidia-smi`` lists a GPU, or torch counts one,
  but torch cannot run a kernel on it (a CPU build of torch, a driver too old for its CUDA),
  it says so in one line and exits 2. It never falls back to a dry run there.
- **no GPU at all is a dry run**, said as such: every phase runs at CPU scale (Triton's
  interpreter, small shapes), so the script and its checks are exercised on every machine
  (``tests/test_gpu_check.py``); its figures mean nothing and are written to
  ``runs/gpu-check-dry-run.json``, never under ``benchmarks/``.

Phases, each in a process of its own with its own time limit, all within one 10-minute call
(``--budget``); every figure goes into one JSON file, rewritten after each phase:

1. ``versions``: Python, torch, CUDA, Triton, flash-attn/FA3, the GPU and its compute
   capability.
2. ``correctness``: the compiled kernels on a virtual ring of 4 blocks with the ring's own
   strides, bf16, head shapes (32,8,128), (32,8,64), (16,4,80), masks zigzag causal,
   striped, sliding window, ``balanced`` and ``whole`` with documents, full, and a fully
   masked pair; out, LSE, dQ, dK, dV against float32 (:mod:`ringray.bench.ring_kernel_check`).
3. ``overflow``: a block of more than 262,144 local rows (32 heads, 8 kv heads × 128, in
   one allocation whose every row stride passes 2^31 elements), against float64 on the far
   rows (:mod:`ringray.attention.backends.triton_overflow`).
4. ``kernel-speed``: forward and backward of each kernel on ring strides at 8k and 32k tokens
   per rank, causal and full: Triton, cuDNN, flash (torch), flash-attn/FA3 when importable,
   and ``auto``'s piece routing, which must be at least as fast as the best single kernel;
   and whole ring calls on a virtual ring of 4 blocks of 8k (zigzag causal, contiguous full),
   where ``auto`` pays a launch and a merge per piece, against fused Triton and SDPA.
5. ``plan``: one rank of the 8B/1M and 70B/256k jobs (2 blocks, over the fake backend):
   step time and ``max_memory_allocated`` against ``ringray plan``, within 15 %.
6. ``gpu-tests``: every ``gpu``-marked test (on CPU: that they collect), in the time left.

Exit status: 0 when every phase passed, 1 when one failed, 2 when a GPU is present and unusable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # a bare GPU image: run from the source tree, not installed
    sys.path.insert(0, str(ROOT))

# name: seconds it may take on a GPU (the dry run's are CPU_SLOWDOWN times these); the
# gpu-marked tests, last, take whatever the budget has left (at least 120 s when the phases
# before them end in time). A phase cut short is run again alone with --phases NAME.
PHASE_SECONDS = {"versions": 30, "correctness": 150, "overflow": 60, "kernel-speed": 120,
                 "plan": 90, "gpu-tests": None}
BUDGET_SECONDS = 570  # one 10-minute call, with time to start and to copy the JSON back
CPU_SLOWDOWN = 4
"""The dry run's limits are the GPU's times this: Triton's interpreter on two cores is slow,
and the dry run is no device call."""
ROUTING_SLACK = 1.05
"""``auto`` is at least as fast as the best single kernel when within 5 % of it (the noise of
one timing run)."""
PLAN_JOBS = ("jobs/llama-8b-1m-64xh100.yaml", "jobs/llama-70b-256k-64xh100.yaml")


# ---------------------------------------------------------------- finding the GPU

def gpus_listed() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (none when it is missing or fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.startswith("GPU ")]


def gpu_state() -> tuple[str, str]:
    """``("usable", name)``, ``("absent", "")`` or ``("unusable", why)``."""
    import torch

    listed = gpus_listed()
    counted = torch.cuda.device_count() if torch.backends.cuda.is_built() else 0
    if not listed and not counted:
        return "absent", ""
    seen = listed[0] if listed else f"{counted} CUDA device(s) counted by torch"
    if not torch.backends.cuda.is_built():
        return "unusable", (f"{seen}, but torch {torch.__version__} is a CPU build; run with "
                            f"the machine's CUDA build (make gpu-check PYTHON=...)")
    try:
        ones = torch.ones(256, device="cuda")
        if float((ones @ ones).item()) != 256.0:
            return "unusable", f"{seen}, but a matrix product on it gave a wrong result"
    except (RuntimeError, AssertionError) as exc:
        return "unusable", f"{seen}, but torch {torch.__version__} cannot use it: {exc}"
    return "usable", torch.cuda.get_device_name()


# ---------------------------------------------------------------- the phases

def phase_versions(on_gpu: bool, quick: bool) -> tuple[bool, dict]:
    import torch

    record = {"python": platform.python_version(), "torch": torch.__version__,
              "cuda": str(torch.version.cuda), "cudnn": str(torch.backends.cudnn.version())}
    for module in ("triton", "flash_attn", "flash_attn_interface"):
        try:
            record[module] = getattr(__import__(module), "__version__", "importable")
        except ImportError:
            record[module] = "not installed"
    if on_gpu:
        record["gpu"] = torch.cuda.get_device_name()
        record["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        record["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30)
    record["nvidia_smi"] = gpus_listed()
    return True, record


def _kernel_backends(on_gpu: bool) -> tuple[str, ...]:
    """The backends the correctness phase checks: every one that runs here, once each
    (``auto`` counts as the backend it resolves to)."""
    import torch

    from ringray.attention.backends import BACKENDS, resolve_backend

    device = torch.device("cuda" if on_gpu else "cpu")
    names, resolved = [], set()
    for name in ("triton", "auto", *sorted(BACKENDS)):
        if name == "reference":
            continue
        try:
            backend = resolve_backend(name, device, torch.bfloat16)
        except (ValueError, ImportError):
            continue
        if backend.name not in resolved:
            names.append(name)
            resolved.add(backend.name)
    return tuple(names)


def phase_correctness(on_gpu: bool, quick: bool) -> tuple[bool, dict]:
    import torch

    from ringray.bench.ring_kernel_check import CASES, CPU_HEAD_SHAPES, check_ring_kernels

    device = torch.device("cuda" if on_gpu else "cpu")
    backends = _kernel_backends(on_gpu)
    cases = ("zigzag causal", "whole documents", "fully masked pair") if quick else tuple(CASES)
    head_shapes = CPU_HEAD_SHAPES[:1] if quick and not on_gpu else None
    rows = check_ring_kernels(device, backends=backends, cases=cases, head_shapes=head_shapes)
    failed = [row for row in rows if not row.passed]
    return not failed, {
        "backends": list(backends), "checked": len(rows), "failed": len(failed),
        "rows": [{"backend": r.backend, "heads": list(r.heads), "case": r.case,
                  "passed": r.passed, "errors": r.errors, "tolerances": r.tolerances}
                 for r in rows]}


def phase_overflow(on_gpu: bool, quick: bool) -> tuple[bool, dict]:
    import torch

    from ringray.attention.backends.triton_overflow import (
        CPU_PROBE,
        GPU_PROBE,
        TOLERANCES,
        overflow_probe,
        probe_failures,
    )

    probe = GPU_PROBE if on_gpu else CPU_PROBE
    errors = overflow_probe(torch.device("cuda" if on_gpu else "cpu"), **probe)
    failed = probe_failures(errors)
    return not failed, {"probe": probe, "relative_errors": errors, "tolerances": TOLERANCES,
                        "failed": failed}


def _gpu_test_files() -> list[str]:
    """The test files that hold ``gpu``-marked tests. Only these are collected: a GPU machine's
    Python may lack what the rest import (Ray, torchft, transformers), and one collection error
    would fail the whole phase."""
    marked = re.compile(r"pytest\.mark\.gpu\b")
    return sorted(f"tests/{path.name}" for path in (ROOT / "tests").glob("test_*.py")
                  if marked.search(path.read_text()))


def phase_gpu_tests(on_gpu: bool, quick: bool) -> tuple[bool, dict]:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               *([] if on_gpu else ["--collect-only"]), *_gpu_test_files()]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    summary = re.findall(r"\d+ (?:passed|failed|skipped|errors?|tests? collected|selected)",
                         done.stdout)
    return done.returncode == 0, {
        "command": " ".join(command[1:]), "returncode": done.returncode,
        "summary": ", ".join(summary), "output_tail": (done.stdout + done.stderr)[-4000:]}


def phase_kernel_speed(on_gpu: bool, quick: bool) -> tuple[bool, dict]:
    from ringray.bench.piece_speed import run_piece_speed, run_ring_speed

    seqs = ((8192,) if quick else (8192, 32768)) if on_gpu else (128,)
    # On CPU one untimed warm-up and one timed call each: the code path, not a figure.
    repeats = {} if on_gpu else {"warmup": 0, "iters": 1}
    rows = run_piece_speed(seqs=seqs, on_gpu=on_gpu, **repeats)
    ring_rows = run_ring_speed(seqs=(8192,) if on_gpu else (64,), on_gpu=on_gpu, **repeats)
    slow = [row for row in rows + ring_rows if row["impl"] == "auto"
            and (row["forward_ms"] > ROUTING_SLACK * row["best_forward_ms"]
                 or row["backward_ms"] > ROUTING_SLACK * row["best_backward_ms"])]
    # On CPU the timings mean nothing: the phase checks that it runs.
    return (not slow) if on_gpu else bool(rows and ring_rows), {
        "pieces": rows, "rings": ring_rows, "routing_slack": ROUTING_SLACK,
        "auto_slower_than_best": [
            f"{r.get('level', 'piece')} {r['head_shape']} {r['seq']} {r['mask']}"
            for r in slow]}


def phase_plan(on_gpu: bool, quick: bool) -> tuple[bool, dict]:
    from ringray.bench.plan_check import PLAN_TOLERANCE, check_rank_against_plan
    from ringray.spec import load_job_spec

    rows = []
    for job in PLAN_JOBS:
        options = load_job_spec(ROOT / job, ["train.steps=2"], check_paths=False
                                ).train_options()
        # On CPU, one block over a 128-token share of each sequence (the job's per-rank
        # share is 8k-32k tokens): the code path, not the figure.
        scale = 1 if on_gpu else options.train.seq_len // options.parallel.cp // 128
        row = check_rank_against_plan(options, job=Path(job).stem, layers=2 if on_gpu else 1,
                                      seq_scale=scale)
        rows.append({"job": row.job, "device": row.device, "layers": row.layers,
                     "world_size": row.world_size, "local_tokens": row.local_tokens,
                     "step_seconds": round(row.step_seconds, 3),
                     "measured_peak_gib": round(row.measured_peak_bytes / 2**30, 3),
                     "planned_peak_gib": round(row.planned_peak_bytes / 2**30, 3),
                     "error_ratio": round(row.error_ratio, 4), "agrees": row.agrees})
    passed = all(r["agrees"] for r in rows) if on_gpu else bool(rows)
    return passed, {"tolerance": PLAN_TOLERANCE, "rows": rows}


PHASES = {"versions": phase_versions, "correctness": phase_correctness,
          "overflow": phase_overflow, "kernel-speed": phase_kernel_speed, "plan": phase_plan,
          "gpu-tests": phase_gpu_tests}


# ---------------------------------------------------------------- running them

def run_phase_here(name: str, on_gpu: bool, quick: bool, result: Path) -> int:
    """The ``--phase`` entry: run one phase in this process, write its record."""
    passed, record = PHASES[name](on_gpu, quick)
    result.write_text(json.dumps({"passed": passed, **record}, default=str))
    return 0 if passed else 1


def run_phase(name: str, on_gpu: bool, quick: bool, seconds: float) -> dict:
    """One phase in a process of its own, killed after ``seconds``."""
    env = dict(os.environ)
    if not on_gpu:
        env["TRITON_INTERPRET"] = "1"  # the kernels run in Triton's interpreter
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "phase.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--phase", name,
                   "--result", str(result), *(["--quick"] if quick else []),
                   *([] if on_gpu else ["--cpu"])]
        started = time.monotonic()
        # A session of its own, so that a phase past its limit is killed with its children
        # (pytest, a compiler) rather than leaving them running.
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"name": name, "passed": False, "error": f"over its {seconds:.0f} s"}
        record = {"name": name, "seconds": round(time.monotonic() - started, 1)}
        if result.exists():
            record.update(json.loads(result.read_text()))
        else:
            record.update(passed=False, error=f"exited {proc.returncode} without a result")
        record["output_tail"] = output[-3000:]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the smaller sizes: 8k tokens only, three masks")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated phases to run (default: all: "
                             f"{', '.join(PHASES)})")
    parser.add_argument("--out", default=None,
                        help="JSON file to write (default: benchmarks/gpu-check-<gpu>.json; "
                             "runs/gpu-check-dry-run.json without a GPU)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for all phases together (default {BUDGET_SECONDS}; "
                             f"{CPU_SLOWDOWN}x that for a dry run)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        return run_phase_here(args.phase, not args.cpu, args.quick, Path(args.result))

    phases = [name.strip() for name in args.phases.split(",") if name.strip()]
    unknown = [name for name in phases if name not in PHASES]
    if unknown:
        parser.error(f"--phases: unknown {', '.join(unknown)}; valid: {', '.join(PHASES)}")
    state, detail = gpu_state()
    if state == "unusable":
        print(f"gpu-check: a GPU is here and cannot be used: {detail}", file=sys.stderr)
        return 2
    on_gpu = state == "usable"
    if on_gpu:
        slug = re.sub(r"[^a-z0-9]+", "-", detail.lower()).strip("-")
        out = Path(args.out) if args.out else ROOT / "benchmarks" / f"gpu-check-{slug}.json"
    else:
        print("gpu-check: no GPU here (nvidia-smi lists none, torch counts none): dry run at "
              "CPU scale; its figures mean nothing")
        out = Path(args.out) if args.out else ROOT / "runs" / "gpu-check-dry-run.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": detail if on_gpu else "none (dry run)", "dry_run": not on_gpu,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick, "phases": []}
    slowdown = 1 if on_gpu else CPU_SLOWDOWN
    deadline = time.monotonic() + (args.budget or BUDGET_SECONDS * slowdown)
    for name in phases:
        left = deadline - time.monotonic()
        limit = PHASE_SECONDS[name]
        seconds = left if limit is None else min(limit * slowdown, left)
        if seconds < 5:
            record = {"name": name, "passed": False, "error": "no time left in --budget"}
        else:
            print(f"{name} ...", flush=True)
            record = run_phase(name, on_gpu, args.quick, seconds)
        report["phases"].append(record)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")  # survives a crash
        verdict = "ok" if record.get("passed") else "FAILED"
        print(f"  {verdict} ({record.get('seconds', '-')} s) {record.get('error', '')}".rstrip(),
              flush=True)
    failed = [r["name"] for r in report["phases"] if not r.get("passed")]
    print(f"wrote {out}" + (f"; failed: {', '.join(failed)}" if failed else "; all passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
