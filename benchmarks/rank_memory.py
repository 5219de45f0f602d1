"""Peak resident memory of every rank of a pretrained FSDP job, phase by phase, against the
plan.

    python benchmarks/rank_memory.py make 0.25b /tmp/llama-0.25b     # random weights, local
    python benchmarks/rank_memory.py run /tmp/llama-0.25b --dp 1 --cp 4
    python benchmarks/rank_memory.py run /tmp/llama-0.25b --repo /tmp/before   # older code

``make`` writes a Llama-shaped Hugging Face checkpoint with random weights (transformers'
``LlamaConfig`` / ``LlamaForCausalLM``, ``save_pretrained``, float32) and a byte-level
tokenizer, nothing downloaded. ``run`` trains it as a user would: ``python -m ringray.train
--config jobs/quickstart.yaml --set model.from_pretrained=... --set parallel.fsdp=true``
under torchrun (as ``tests/test_train_entrypoint.py`` runs it), twice: ``--steps`` steps
and a checkpoint, then a resume from that checkpoint for one more step and its checkpoint.
Every rank's ``VmRSS`` and ``VmHWM`` are read from ``/proc`` every 50 ms. Phases are cut at
the lines rank 0 prints: the model line once the trainer is built (build and load: imports,
tokenizer, data, model), each step line, ``checkpoint ...``, ``resumed from ...``.

Printed per run: each phase's highest sampled RSS over the ranks (its rank's figure), each
rank's ``VmHWM`` at the end (the kernel's exact peak), the seconds to the model line, and
the plan's per-rank peak (:func:`ringray.train.footprint.rank_footprint`, what ``ringray
plan`` and ``ringray bench memory`` use) above the RSS of a process that has imported torch
and ringray and nothing more. Then ``ringray export`` of the resumed run's checkpoint, one
process, its ``VmHWM`` and seconds: with the command's default shard size and with each of
``--export-shard-sizes`` (code that streams the export shard by shard only). Rank 0's model
line gives the seconds the model took to build and load. ``--repo`` runs another checkout's
code (a git worktree of an older commit) with the same job and the same plan figure, for a
before/after table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    # name: LlamaConfig fields; parameters from ModelConfig.num_params
    "0.25b": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4),
    "0.5b": dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4),
}
SAMPLE_SECONDS = 0.05
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")
"""glibc's allocator settings, passed on to the ranks from this process's environment and
recorded with the figures."""
MIB = 1 << 20


def make_checkpoint(size: str, path: Path) -> None:
    """A Llama-shaped checkpoint of ``size`` with random weights, and a byte-level tokenizer
    (the 256 byte symbols, BOS and EOS)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = transformers.LlamaConfig(**SIZES[size], max_position_embeddings=8192,
                                      tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    vocab = {s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>",
         "eos_token": {"content": "<|end_of_text|>", "special": True}}))


# ------------------------------------------------------------------------------ /proc


def _status_kib(pid: int) -> dict[str, int]:
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, value, _ = line.split()
                    fields[name.rstrip(":")] = int(value)
    except (FileNotFoundError, ProcessLookupError):
        pass
    return fields


def _available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(env[b"RANK"]) if b"RANK" in env and b"LOCAL_RANK" in env else None


@dataclass
class Sampler:
    """Samples the ranks under one torchrun process until told to stop."""

    launcher: int
    min_available_kib: int
    """When the machine's available memory (``MemAvailable``) falls below this, the job is
    stopped (a shared machine's safety). The sum of the ranks' RSS would overstate what
    they take: each counts the shared libraries they all map."""
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rank, rss KiB)
    hwm_kib: dict[int, int] = field(default_factory=dict)
    stopped: str | None = None
    """Why the sampler stopped the job (the memory floor), or ``None``."""
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        ranks: dict[int, int] = {}
        while not self._stop.is_set():
            for pid in _children(self.launcher):
                if pid not in ranks and (rank := _rank_of(pid)) is not None:
                    ranks[pid] = rank
            now, total = time.monotonic(), 0
            for pid, rank in ranks.items():
                status = _status_kib(pid)
                if "VmRSS" in status:
                    self.samples.append((now, rank, status["VmRSS"]))
                    self.hwm_kib[rank] = status["VmHWM"]
                    total += status["VmRSS"]
            available = _available_kib()
            if available < self.min_available_kib:
                print(f"   | stopping the job: the machine has {available / MIB:.2f} GiB "
                      f"available, under the {self.min_available_kib / MIB:.2f} GiB floor "
                      f"(its ranks' RSS adds up to {total / MIB:.1f} GiB)", flush=True)
                self.stopped = (f"stopped: {available / MIB:.2f} GiB available, ranks' RSS "
                                f"{total / MIB:.1f} GiB")
                # torchrun starts each rank in a session of its own: kill them by pid, then
                # the launcher's session (started for this job)
                for pid in ranks:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.killpg(self.launcher, signal.SIGKILL)
                return
            time.sleep(SAMPLE_SECONDS)

    def stop(self) -> None:
        self._stop.set()


# ------------------------------------------------------------------------------ runs


def _launch(repo: Path, nproc: int, sets: list[str], *,
            min_available_kib: int) -> tuple[list[tuple[float, str]], Sampler, float, int]:
    """One torchrun job; returns rank 0's lines with their arrival times, the samples, the
    start time and the exit code."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(repo)}
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "-m", "ringray.train", "--config", str(repo / "jobs/quickstart.yaml")]
    args += [a for item in sets for a in ("--set", item)]
    start = time.monotonic()
    proc = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    sampler = Sampler(proc.pid, min_available_kib)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    lines = []
    for line in proc.stdout:
        lines.append((time.monotonic(), line.rstrip()))
        print("   |", line.rstrip(), flush=True)
    code = proc.wait()
    sampler.stop()
    thread.join()
    return lines, sampler, start, code


def _phases(lines: list[tuple[float, str]], start: float,
            end: float) -> list[tuple[str, float, float]]:
    """(what ran, begin, end): windows cut at rank 0's lines, each named by the line that
    ends it."""
    windows, begin = [], start
    for at, text in lines:
        if text.startswith("ringray:"):
            name = "build and load"
        elif text.startswith("resumed from"):
            name = "restore"
        elif text.startswith("step "):
            name = f"step {int(text.split()[1].split('/')[0])}"
        elif text.startswith("checkpoint "):
            name = "checkpoint save"
        else:
            continue
        windows.append((name, begin, at))
        begin = at
    return [*windows, ("exit", begin, end)]


def _phase_peaks(sampler: Sampler, phases) -> list[tuple[str, int, int]]:
    """(phase, rank with the highest RSS, that RSS in KiB)."""
    out = []
    for name, begin, stop in phases:
        best = (0, -1)
        for at, rank, rss in sampler.samples:
            if begin <= at <= stop and rss > best[0]:
                best = (rss, rank)
        out.append((name, best[1], best[0]))
    return out


def _baseline_kib(repo: Path) -> int:
    """RSS of a process that has imported torch and ringray's trainer, and nothing more."""
    code = ("import torch, torch.distributed, ringray.train, re; "
            "print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(repo)}, check=True)
    return int(out.stdout.strip())


def planned_peak_bytes(checkpoint: str, *, dp: int, cp: int, seq_len: int,
                       global_batch: int, checkpointing: str) -> int:
    """The plan's per-rank peak for this job (this checkout's footprint model)."""
    from ringray.model import read_model_config
    from ringray.train.footprint import rank_footprint

    cfg = read_model_config(checkpoint)
    return rank_footprint(cfg, local_tokens=global_batch // dp * (seq_len // cp), cp=cp,
                          shards=dp * cp, bf16=False, checkpointing=checkpointing).peak_bytes


def run(args: argparse.Namespace) -> dict:
    repo = Path(args.repo).resolve()
    run_dir = Path(args.work) / f"run-{repo.name}-{args.dp}x{args.cp}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    sets = [f"model.from_pretrained={args.checkpoint}", "parallel.fsdp=true",
            f"parallel.dp={args.dp}", f"parallel.cp={args.cp}", f"train.seq_len={args.seq_len}",
            f"train.global_batch={args.global_batch}", "train.peak_tflops_per_device=1.0",
            f"train.activation_checkpointing={args.checkpointing}",
            "eval.passkey_lengths=[]", "checkpoint.interval=1000", f"run_dir={run_dir}"]
    baseline = _baseline_kib(repo)
    plan = planned_peak_bytes(args.checkpoint, dp=args.dp, cp=args.cp, seq_len=args.seq_len,
                              global_batch=args.global_batch, checkpointing=args.checkpointing)
    nproc = args.dp * args.cp
    result = {"repo": str(repo), "dp": args.dp, "cp": args.cp, "baseline_kib": baseline,
              "planned_peak_bytes": plan, "runs": [],
              "malloc": {name: os.environ[name] for name in MALLOC_VARIABLES
                         if name in os.environ}}
    for label, steps in (("train", args.steps), ("resume", args.steps + 1)):
        print(f"== {label}: {repo} dp {args.dp} x cp {args.cp}", flush=True)
        lines, sampler, start, code = _launch(repo, nproc, sets + [f"train.steps={steps}"],
                                              min_available_kib=int(args.min_available_gib
                                                                    * MIB))
        end = time.monotonic()
        phases = _phases(lines, start, end)
        built, model_line = next(((at, text) for at, text in lines
                                  if text.startswith("ringray:")), (None, ""))
        model_seconds = re.search(r"(?:loaded|initialised) in ([0-9.]+) s", model_line)
        result["runs"].append({
            "label": label, "seconds_to_model": built - start if built else None,
            "model_seconds": float(model_seconds.group(1)) if model_seconds else None,
            "phases": _phase_peaks(sampler, phases),
            "hwm_kib": dict(sorted(sampler.hwm_kib.items())),
            "failed": sampler.stopped or (f"torchrun exited {code}" if code else None),
        })
        if code != 0:  # what ran so far is kept and printed; nothing later can run
            print(f"{label}: {result['runs'][-1]['failed']}", flush=True)
            return result
    streams = "--max-shard-size" in (repo / "ringray/cli/export.py").read_text()
    sizes = [None, *args.export_shard_sizes.split(",")] if streams else [None]
    result["exports"] = [_export(repo, run_dir, Path(args.work) / "export", size)
                         for size in sizes if size != ""]
    return result


def _export(repo: Path, run_dir: Path, out: Path, shard_size: str | None) -> dict:
    """``ringray export`` of the run's newest checkpoint in one process (this checkout's
    code), its ``VmHWM`` sampled to the end; ``shard_size=None``: the command's default."""
    subprocess.run(["rm", "-rf", str(out)], check=True)
    args = [sys.executable, "-m", "ringray", "export", str(run_dir), "--hf", str(out)]
    if shard_size is not None:
        args += ["--max-shard-size", shard_size]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    start = time.monotonic()
    proc = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    hwm = 0
    while proc.poll() is None:
        hwm = max(hwm, _status_kib(proc.pid).get("VmHWM", 0))
        time.sleep(SAMPLE_SECONDS)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"export exited {proc.returncode}: {output[-2000:]}")
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    return {"shard_size": shard_size or "default", "hwm_kib": hwm,
            "seconds": time.monotonic() - start, "files": len(files)}


def print_table(result: dict) -> None:
    base, plan = result["baseline_kib"] * 1024, result["planned_peak_bytes"]
    print(f"\n{result['repo']}: dp {result['dp']} x cp {result['cp']}, baseline RSS "
          f"{base / MIB:.0f} MiB (torch + ringray imported), plan {plan / MIB:.0f} MiB above "
          f"it = {(base + plan) / MIB:.0f} MiB"
          + "".join(f", {name}={value}" for name, value in result.get("malloc", {}).items()))
    print("| run | phase | peak RSS MiB (rank) |")
    print("|---|---|---|")
    for r in result["runs"]:
        for name, rank, kib in r["phases"]:
            print(f"| {r['label']} | {name} | {kib / 1024:.0f} ({rank}) |")
        hwm = ", ".join(f"{kib / 1024:.0f}" for kib in r["hwm_kib"].values())
        print(f"| {r['label']} | VmHWM per rank | {hwm} |")
        if r.get("failed"):
            print(f"| {r['label']} | did not finish | {r['failed']} |")
        if r["seconds_to_model"] is not None:
            print(f"| {r['label']} | seconds to the model line | "
                  f"{r['seconds_to_model']:.1f} |")
        if r.get("model_seconds") is not None:
            print(f"| {r['label']} | seconds building and loading the model (rank 0) "
                  f"| {r['model_seconds']:.1f} |")
    for e in result.get("exports", []):
        print(f"| export, --max-shard-size {e['shard_size']} ({e['files']} files) | VmHWM "
              f"| {e['hwm_kib'] / 1024:.0f} ({e['seconds']:.0f} s) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write a random-weight Llama-shaped checkpoint")
    make.add_argument("size", choices=sorted(SIZES))
    make.add_argument("path", type=Path)
    measure = sub.add_parser("run", help="train it under torchrun and sample every rank")
    measure.add_argument("checkpoint")
    measure.add_argument("--dp", type=int, default=1)
    measure.add_argument("--cp", type=int, default=4)
    measure.add_argument("--steps", type=int, default=2)
    measure.add_argument("--seq-len", type=int, default=2048)
    measure.add_argument("--global-batch", type=int, default=2)
    measure.add_argument("--checkpointing", default="none")
    measure.add_argument("--repo", default=str(ROOT), help="the checkout whose code runs")
    measure.add_argument("--work", default="/tmp/ringray-rank-memory")
    measure.add_argument("--json", help="also write the figures here")
    measure.add_argument("--export-shard-sizes", default="200MB",
                         help="besides the default, export with these --max-shard-size values")
    measure.add_argument("--min-available-gib", type=float, default=0.5,
                         help="stop the job when the machine's available memory falls below")
    args = parser.parse_args()
    if args.command == "make":
        make_checkpoint(args.size, args.path)
        return
    result = run(args)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
