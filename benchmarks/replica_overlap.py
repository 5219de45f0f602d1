"""The cross-replica sum inside the backward against after it (issue 39).

    python benchmarks/replica_overlap.py [--json OUT] [--steps 4] [--seq-len 256] [--layers 8]

Two replica groups (``parallel.dp_replicate: 2``), each a ring of 2 ranks (cp 2) under FSDP,
each its own gloo world, train through a real torchft Lighthouse and managers on one model,
twice:

- **in backward** (as it is now): each FSDP unit's summed gradient shards are handed to the
  cross-replica sum from FSDP2's all-reduce hook, as soon as the unit's reduce-scatter is
  done, while the backward goes on (``ReplicaSync._sum_in_backward``);
- **after backward** (as it was): no hook; every gradient is summed once the backward is
  over (``sum_in_place``, in 25 MiB buckets).

Each rank times every step after a warm-up, and the part of it spent in
``ReplicaSync.sync_gradients``: what of the cross-replica sum the backward did not hide
(with the tally and torchft's ``should_commit``, which both variants share). Medians over
the measured steps and the four ranks are printed, the variants side by side. The four
processes share this machine's cores: on 2 cores the sum's gloo threads and the backward
compete for them, so this is a lower bound on what a GPU's separate streams would hide.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from datetime import timedelta

from ringray.bench.gloo_ranks import free_loopback_port

VARIANTS = ("in backward", "after backward")


def _options(seq_len: int, layers: int, dim: int, steps: int):
    from ringray.model import model_preset
    from ringray.train import OptimizerOptions, ParallelOptions, TrainingOptions, TrainOptions

    model = model_preset("small", dim=dim, n_layers=layers, n_heads=dim // 64,
                         n_kv_heads=dim // 128, ffn_hidden=dim * 11 // 4 // 64 * 64,
                         vocab_size=32000)
    return TrainOptions(
        model=model, parallel=ParallelOptions(dp=1, cp=2, dp_replicate=2, fsdp=True,
                                              attention_backend="sdpa"),
        train=TrainingOptions(seq_len=seq_len, global_batch=2, steps=steps + 1,
                              precision="fp32",
                              optimizer=OptimizerOptions(lr=1e-4, warmup_steps=1),
                              peak_tflops_per_device=1.0, memory_check=False),
        run_dir="/tmp/ringray-replica-overlap")


def _rank(index: int, rank: int, port: int, lighthouse: str, variant: str, options,
          results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import ringray.train.replicas as replicas
    from ringray.train import Trainer
    from ringray.train.replicas import ReplicaMembership, ReplicaSync

    torch.set_num_threads(1)
    try:
        if variant == "after backward":  # as before: no FSDP hook, the sum after the backward
            replicas.set_reduce_hook = lambda model, hook: 0
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=600))
        sync = ReplicaSync(ReplicaMembership(
            index=index, count=2, lighthouse=lighthouse, store=("127.0.0.1", port),
            timeout_seconds=600, quorum_timeout_seconds=600))
        spent: list[float] = []
        sync_gradients = sync.sync_gradients

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return sync_gradients(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - started)

        sync.sync_gradients = timed
        trainer = Trainer(options, replicas=sync)
        steps, sums = [], []
        while trainer.step_count < options.train.steps:
            started = time.perf_counter()
            stats = trainer.step()
            if not stats.committed or stats.replicas_participating != [0, 1]:
                raise RuntimeError(f"step {stats.step}: committed {stats.committed}, "
                                   f"participating {stats.replicas_participating}")
            steps.append(time.perf_counter() - started)
            sums.append(spent[-1])
        results.put((index, rank, {"step_seconds": steps[1:], "sum_seconds": sums[1:],
                                   "params": options.model.num_params()}))
        sync.shutdown()
    except BaseException:  # noqa: BLE001 - report it to the parent
        results.put((index, rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(variant: str, options) -> list[dict]:
    """One run of ``variant``: each rank's step and sum seconds after the warm-up step."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    for index in range(2):
        port = free_loopback_port()
        procs += [ctx.Process(target=_rank, args=(index, rank, port, lighthouse.address(),
                                                  variant, options, results))
                  for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        got = {(i, r): row for i, r, row in (results.get(timeout=3600) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    for key, row in sorted(got.items()):
        if "error" in row:
            raise RuntimeError(f"{variant}, group {key[0]} rank {key[1]}:\n{row['error']}")
    return [got[key] for key in sorted(got)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after 1 warm-up)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    options = _options(args.seq_len, args.layers, args.dim, args.steps)
    load = [os.getloadavg()[0]]
    rows = {}
    for variant in VARIANTS:
        print(f"{variant}: {args.steps + 1} steps of 2 groups x 2 ranks ...", flush=True)
        ranks = measure(variant, options)
        rows[variant] = {
            "ranks": ranks,
            "step_seconds": statistics.median(s for r in ranks for s in r["step_seconds"]),
            "sum_seconds": statistics.median(s for r in ranks for s in r["sum_seconds"]),
        }
        load.append(os.getloadavg()[0])
    grads_mib = 4 * options.model.num_params() / 2 / 2**20
    print(f"model {options.model.num_params() / 1e6:.1f}M parameters, seq {args.seq_len}, "
          f"2 replica groups x cp 2 (FSDP), float32: {grads_mib:,.0f} MiB of gradient shards "
          f"summed per rank per step; medians of {args.steps} steps x 4 ranks")
    print(f"{'cross-replica sum':<18} {'step s':>8} {'after the backward s':>21}")
    for variant, row in rows.items():
        print(f"{variant:<18} {row['step_seconds']:>8.2f} {row['sum_seconds']:>21.2f}")
    before, now = rows["after backward"], rows["in backward"]
    print(f"exposed after the backward: {now['sum_seconds']:.2f} s against "
          f"{before['sum_seconds']:.2f} s; step {now['step_seconds']:.2f} s against "
          f"{before['step_seconds']:.2f} s ({before['step_seconds'] / now['step_seconds']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variants": rows, "seq_len": args.seq_len, "layers": args.layers,
                       "dim": args.dim, "params": options.model.num_params(),
                       "machine": platform.node(), "cpus": os.cpu_count(), "load": load,
                       "argv": sys.argv}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
