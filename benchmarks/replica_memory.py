"""Peak memory per rank with replica groups, before and after the in-place average (issue 39).

    python benchmarks/replica_memory.py [--json OUT] [--seq-len 128] [--layers 16]

Two replica groups (``parallel.dp_replicate: 2``, one rank each, each its own gloo world) on a
0.25B-parameter model train through a real torchft Lighthouse and managers; each rank
measures one step after a warm-up (the allocator's peak over the step, from torch's memory
profiler, plus the weights, gradients and AdamW state alive before it:
``ringray.bench.memory.step_peak_bytes``), twice:

- **flat**: the cross-replica sum as it was, every gradient copied into one flat float32
  buffer first (``sum_in_place`` with no bucket limit: one bucket of everything);
- **buckets**: as it is now (``AVERAGE_BUCKET_BYTES``, 25 MiB, at most two in flight).

and sets both beside the plan's peak for the same rank (``ringray plan``'s memory model,
``ringray.bench.memory.predicted_memory``), which counts no average buffer: the buckets are
below its step transient. The two groups run at once, one core each.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from dataclasses import replace
from datetime import timedelta

from ringray.bench.gloo_ranks import free_loopback_port

VARIANTS = {"flat": 2**62, "buckets": None}  # the bucket limit; None: the default


def _options(seq_len: int, layers: int):
    from ringray.model import model_preset
    from ringray.train import (
        OptimizerOptions,
        ParallelOptions,
        TrainingOptions,
        TrainOptions,
    )

    model = model_preset("small", dim=1024, n_layers=layers, n_heads=16, n_kv_heads=8,
                         ffn_hidden=2816, vocab_size=32000)
    return TrainOptions(
        model=model, parallel=ParallelOptions(dp=1, cp=1, dp_replicate=2,
                                              attention_backend="sdpa"),
        train=TrainingOptions(seq_len=seq_len, global_batch=2, steps=10, precision="fp32",
                              optimizer=OptimizerOptions(lr=1e-4, warmup_steps=1),
                              peak_tflops_per_device=1.0, memory_check=False),
        run_dir="/tmp/ringray-replica-memory")


def _group(index: int, port: int, lighthouse: str, limit: int | None, seq_len: int,
           layers: int, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import ringray.train.replicas as replicas
    from ringray.bench.memory import step_peak_bytes
    from ringray.train import Trainer
    from ringray.train.replicas import ReplicaMembership, ReplicaSync

    torch.set_num_threads(1)
    try:
        if limit is not None:
            replicas.sum_in_place = functools.partial(replicas.sum_in_place, limit=limit)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=timedelta(seconds=600))
        sync = ReplicaSync(ReplicaMembership(
            index=index, count=2, lighthouse=lighthouse, store=("127.0.0.1", port),
            timeout_seconds=600, quorum_timeout_seconds=600))
        trainer = Trainer(_options(seq_len, layers), replicas=sync)
        started = time.perf_counter()
        warm = trainer.step()  # AdamW's moments are created here
        warm_seconds = time.perf_counter() - started
        peak, _ = step_peak_bytes(trainer)
        results.put((index, {"peak_bytes": peak, "warmup_step_seconds": warm_seconds,
                             "participating": warm.replicas_participating,
                             "params": trainer.options.model.num_params()}))
        sync.shutdown()
    except BaseException:  # noqa: BLE001 - report it to the parent
        results.put((index, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(variant: str, *, seq_len: int, layers: int) -> list[dict]:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_group, args=(index, free_loopback_port(), lighthouse.address(),
                                              VARIANTS[variant], seq_len, layers, results))
             for index in range(2)]
    for proc in procs:
        proc.start()
    try:
        got = dict(results.get(timeout=3600) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    for index in sorted(got):
        if "error" in got[index]:
            raise RuntimeError(f"{variant}, group {index}:\n{got[index]['error']}")
    return [got[index] for index in sorted(got)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    from ringray.bench.memory import predicted_memory

    options = _options(args.seq_len, args.layers)
    planned = predicted_memory(replace(options, parallel=replace(options.parallel, dp=1)),
                               bf16=False).peak_bytes
    rows = {}
    for variant in VARIANTS:
        started = time.monotonic()
        rows[variant] = {"groups": measure(variant, seq_len=args.seq_len, layers=args.layers),
                         "seconds": time.monotonic() - started}
    mib = 2**20
    print(f"model {options.model.num_params() / 1e6:.1f}M parameters, seq {args.seq_len}, "
          f"2 replica groups × 1 rank, float32; plan's peak per rank {planned / mib:,.0f} MiB")
    print(f"{'average':<8} {'group 0 MiB':>12} {'group 1 MiB':>12} {'vs plan':>9}")
    for variant, row in rows.items():
        peaks = [g["peak_bytes"] for g in row["groups"]]
        print(f"{variant:<8} {peaks[0] / mib:>12,.0f} {peaks[1] / mib:>12,.0f} "
              f"{max(peaks) / planned - 1:>+9.1%}")
    saved = max(g["peak_bytes"] for g in rows["flat"]["groups"]) - max(
        g["peak_bytes"] for g in rows["buckets"]["groups"])
    print(f"the in-place average saves {saved / mib:,.0f} MiB per rank "
          f"(the gradients: {4 * options.model.num_params() / mib:,.0f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"planned_peak_bytes": planned, "variants": rows, "seq_len": args.seq_len,
                       "params": options.model.num_params(), "machine": platform.node(),
                       "cpus": os.cpu_count(), "load": os.getloadavg(),
                       "argv": sys.argv}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

