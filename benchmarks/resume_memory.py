"""Is a resumed FSDP run's higher resident memory live tensors, or memory the allocator keeps?

    python benchmarks/resume_memory.py                  # 2 gloo ranks, FSDP over the ring of 2
    python benchmarks/resume_memory.py --trim           # malloc_trim(0) after the restore

A Llama-shaped model of about 81M parameters (dim 768, 8 layers, vocabulary 16000, float32),
FSDP over a ring of 2 (dp 1 x cp 2), full activation checkpointing, 64-token sequences:
5 steps and a checkpoint, then a fresh trainer restores it and takes 5 more steps. After
each step, rank 0's RSS and VmHWM from ``/proc`` and the bytes of every live tensor's
storage (each storage once, a DTensor by its local shard; found through the garbage
collector), and after the restore how many optimizer state tensors there are. Equal live
bytes with a higher RSS mean the allocator holds freed memory (the restore's temporaries),
not a second copy of any state. ``--trim`` returns the C heap's free memory to the system
after the restore (glibc's ``malloc_trim``), to see how much of the difference that is.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the gloo launcher and the tiny options

RUN_DIR = "/tmp/ringray-resume-memory"


def _rss() -> tuple[int, int]:
    status = open("/proc/self/status").read()
    return tuple(int(re.search(rf"{field}:\s+(\d+)", status).group(1)) // 1024
                 for field in ("VmRSS", "VmHWM"))


def _live_mib() -> int:
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        if local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total >> 20


def _options():
    from train_cases import tiny_options

    options = tiny_options(RUN_DIR, parallel={"dp": 1, "cp": 2, "fsdp": True},
                           train={"steps": 10, "seq_len": 64, "global_batch": 2,
                                  "activation_checkpointing": "full"})
    return replace(options, model=replace(options.model, dim=768, n_layers=8, n_heads=12,
                                          n_kv_heads=12, ffn_hidden=2048, vocab_size=16000))


def _rank(rank: int, world: int, mode: str, trim: bool) -> list[tuple]:
    from ringray.train import CheckpointStore, Trainer

    options = _options()
    trainer = Trainer(options)
    store = CheckpointStore(options.checkpoint_location)
    rows: list[tuple] = []
    first = 1
    if mode == "resume":
        trainer.load_checkpoint(store, store.latest())
        gc.collect()
        if trim:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        states = sum(len(s) for s in trainer.optimizer.state.values())
        rows.append(("restored", *_rss(), _live_mib(), states))
        first = 6
    for step in range(first, first + 5):
        trainer.step()
        rows.append((f"step {step}", *_rss(), _live_mib(), None))
    if mode == "train":
        store.save(5, trainer.state_dict(), keep=1)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trim", action="store_true")
    args = parser.parse_args()
    from distributed import run_gloo_ranks

    shutil.rmtree(RUN_DIR, ignore_errors=True)
    print("| run | after | RSS MiB | VmHWM MiB | live tensors MiB | optimizer state tensors |")
    print("|---|---|---|---|---|---|")
    for mode in ("train", "resume"):
        rows = run_gloo_ranks(2, _rank, mode, args.trim, timeout_seconds=900)[0]
        for name, rss, hwm, live, states in rows:
            print(f"| {mode} | {name} | {rss} | {hwm} | {live} | {states or ''} |")
    shutil.rmtree(RUN_DIR, ignore_errors=True)


if __name__ == "__main__":
    main()
