"""A heal's transfer over torchft's HTTP checkpoint server against the replica process group
(issue 39: ``cluster.replica_heal_transport``).

    python benchmarks/replica_heal.py [--json OUT] [--repeat 3] [--layers 16]

Two replica groups of one rank each (``parallel.dp_replicate: 2``, each its own gloo world)
on a 0.25B-parameter model, through a real torchft Lighthouse and managers: group 0 trains;
once it has committed two steps, group 1 starts from fresh weights, joins, and heals from
group 0 at its first step (weights, AdamW state, loader, RNG: about 3 GiB in float32); group
0 waits for group 1's build, so that both ask for that quorum together. The heal's seconds
are group 1's ``heal_seconds``: its quorum call, the transfer and the load.
Each transport is run ``--repeat`` times, alternating; medians are printed side by side.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import traceback
from datetime import timedelta

from ringray.bench.gloo_ranks import free_loopback_port

TRANSPORTS = ("http", "process_group")


def _options(layers: int):
    from ringray.model import model_preset
    from ringray.train import OptimizerOptions, ParallelOptions, TrainingOptions, TrainOptions

    model = model_preset("small", dim=1024, n_layers=layers, n_heads=16, n_kv_heads=8,
                         ffn_hidden=2816, vocab_size=32000)
    return TrainOptions(
        model=model, parallel=ParallelOptions(dp=1, cp=1, dp_replicate=2,
                                              attention_backend="sdpa"),
        train=TrainingOptions(seq_len=64, global_batch=2, steps=1000, precision="fp32",
                              optimizer=OptimizerOptions(lr=1e-4, warmup_steps=1),
                              peak_tflops_per_device=1.0, memory_check=False),
        run_dir="/tmp/ringray-replica-heal")


def _group(index: int, lighthouse: str, transport: str, layers: int, ready, built, done,
           results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist
    from torch.utils._pytree import tree_leaves

    from ringray.train import Trainer
    from ringray.train.replicas import ReplicaMembership, ReplicaSync

    torch.set_num_threads(1)
    port = free_loopback_port()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=timedelta(seconds=600))
        sync = ReplicaSync(ReplicaMembership(
            index=index, count=2, lighthouse=lighthouse, store=("127.0.0.1", port),
            timeout_seconds=600, quorum_timeout_seconds=600, heal_transport=transport))
        trainer = Trainer(_options(layers), replicas=sync)
        if index == 0:  # the live peer: trains until the other has healed from it
            while not done.is_set():
                trainer.step()
                if trainer.step_count == 2:  # both then ask for the same quorum at once
                    ready.set()
                    built.wait(1800)
            results.put((index, {}))
        else:
            built.set()
            stats = trainer.step()
            results.put((index, {"healed": stats.healed, "heal_seconds": stats.heal_seconds,
                                 "step": stats.step, "committed": stats.committed,
                                 "state_bytes": sum(
                                     t.numel() * t.element_size()
                                     for t in tree_leaves(trainer.state_dict())
                                     if isinstance(t, torch.Tensor))}))
            done.set()
        sync.shutdown()
    except BaseException:  # noqa: BLE001 - report it to the parent
        results.put((index, {"error": traceback.format_exc()}))
        done.set()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def heal_once(transport: str, layers: int) -> dict:
    """One heal of group 1 from group 0 over ``transport``: group 1's figures."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100,
                                  heartbeat_timeout_ms=5000)
    ctx = mp.get_context("spawn")
    results, ready, built, done = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    args = (lighthouse.address(), transport, layers, ready, built, done, results)
    procs = [ctx.Process(target=_group, args=(0, *args))]
    procs[0].start()
    try:
        if not ready.wait(1800):
            raise RuntimeError("group 0 did not commit two steps")
        procs.append(ctx.Process(target=_group, args=(1, *args)))
        procs[1].start()
        got = dict(results.get(timeout=1800) for _ in procs)
    finally:
        done.set()
        for proc in procs:
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    for index, row in sorted(got.items()):
        if "error" in row:
            raise RuntimeError(f"{transport}, group {index}:\n{row['error']}")
    if not got[1]["healed"]:
        raise RuntimeError(f"{transport}: group 1 did not heal ({got[1]})")
    return got[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    runs: dict[str, list[dict]] = {t: [] for t in TRANSPORTS}
    load = [os.getloadavg()[0]]
    for attempt in range(args.repeat):
        for transport in TRANSPORTS:
            row = heal_once(transport, args.layers)
            runs[transport].append(row)
            load.append(os.getloadavg()[0])
            print(f"run {attempt + 1}/{args.repeat} {transport}: heal {row['heal_seconds']:.2f} s",
                  flush=True)
    state = runs[TRANSPORTS[0]][0]["state_bytes"]
    print(f"a heal of {state / 2**30:.2f} GiB (0.25B-class model, float32 weights and AdamW "
          f"state), 2 groups x 1 rank; medians of {args.repeat}")
    medians = {t: statistics.median(r["heal_seconds"] for r in rows) for t, rows in runs.items()}
    for transport, seconds in medians.items():
        print(f"{transport:<14} {seconds:6.2f} s  {state / seconds / 2**30:6.2f} GiB/s")
    print(f"process_group / http: {medians['process_group'] / medians['http']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "medians": medians, "state_bytes": state,
                       "layers": args.layers, "machine": platform.node(),
                       "cpus": os.cpu_count(), "load": load, "argv": sys.argv}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
