"""`ringray bench ring` across real hosts with links of finite speed.

    python benchmarks/ring_hosts.py                          # 4 hosts, 1 and 10 Gbit/s
    python benchmarks/ring_hosts.py --gbits 0.1,1,10 --seq 8192 --json out.json

Each rank of the ring benchmark (:mod:`ringray.bench.ring`, the same ``_rank_main`` as
``ringray bench ring``) runs on a host of its own (``tests/hosts.py``: network namespaces on
a bridge, 198.18.0.0/15), its gloo traffic over the host's link, which ``tc tbf`` limits to
each speed in turn (both directions). Reported per speed, layout and transfer mode: the
overlap (the worst rank's share of its transfer hidden), the longest peer wait, the slowest
rank's wall time for forward + backward, and the bytes a rank sent; then the overlap rule
of ``ringray plan`` (:func:`ringray.capacity.fit.overlap_threshold_tokens`) for this shape,
at this link speed and at the attention FLOP/s a rank reached here (one SDPA process on the
whole sequence, measured in the same run), beside the measured overlap.

Needs root (namespaces); the machine and its load are printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the host harness

PORT = 29500


def _rank(args: argparse.Namespace) -> None:
    """One rank, inside its host: join the ring's gloo group, run the benchmark's rank."""
    import torch
    import torch.distributed as dist

    from ringray.bench.ring import RingBenchConfig, _rank_main

    torch.set_num_threads(1)
    cfg = RingBenchConfig(**json.loads(args.config))
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{PORT}", rank=args.rank,
                            world_size=cfg.world, timeout=timedelta(seconds=600))
    try:
        result = _rank_main(args.rank, cfg.world, cfg)
    finally:
        dist.destroy_process_group()
    Path(args.out).write_bytes(pickle.dumps(result))


def _config(args: argparse.Namespace):
    from ringray.bench.ring import RingBenchConfig

    return RingBenchConfig(world=args.world, seq=args.seq, heads=args.heads,
                           kv_heads=args.kv_heads, head_dim=args.head_dim,
                           layouts=tuple(args.layouts.split(",")),
                           transfers=tuple(args.transfers.split(",")),
                           documents=args.documents or None, iters=args.iters,
                           warmup=args.warmup)


def _run_speed(hosts, cfg, gbit: float, work: Path) -> list[dict]:
    """The benchmark's ranks on the hosts, every link at ``gbit``; each rank's result."""
    for host in hosts:
        host.limit_rate(gbit=gbit)
    env = hosts.environment(GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    processes, outs = [], []
    for rank, host in enumerate(hosts):
        out = work / f"rank{rank}-{gbit}.pkl"
        outs.append(out)
        processes.append(host.run(
            [sys.executable, str(Path(__file__).resolve()), "--rank", str(rank), "--master",
             hosts[0].address, "--out", str(out), "--config", json.dumps(asdict(cfg))],
            env=env, cwd=str(ROOT), stdout=(work / f"rank{rank}.log").open("w"),
            stderr=subprocess.STDOUT))
    for rank, process in enumerate(processes):
        if process.wait(timeout=3600):
            raise RuntimeError(f"rank {rank} exited {process.returncode}: "
                               f"{(work / f'rank{rank}.log').read_text()[-2000:]}")
    return [pickle.loads(out.read_bytes()) for out in outs]


def _plan_rule(cfg, single_seconds: float, gbit: float) -> dict:
    """``ringray plan``'s overlap rule for this shape at ``gbit`` and the FLOP/s one process
    reached here on the same attention (forward + backward: 3.5 x the forward's 4 s^2 d h
    FLOPs, halved for causal attention; per document with packed documents)."""
    from ringray.capacity.fit import overlap_threshold_tokens
    from ringray.data.mixes import document_lengths
    from ringray.model.config import ModelConfig

    lengths = document_lengths(cfg.documents, cfg.seq) if cfg.documents else [cfg.seq]
    pairs = sum(n * n for n in lengths) / 2  # causal: half of each document's square
    flops = 3.5 * 4 * pairs * cfg.head_dim * cfg.heads
    achieved = flops / single_seconds
    model = ModelConfig(dim=cfg.heads * cfg.head_dim, n_heads=cfg.heads,
                        n_kv_heads=cfg.kv_heads)
    forward, backward = overlap_threshold_tokens(model, peak_flops=achieved,
                                                 link_bytes_per_second=gbit * 1e9 / 8,
                                                 bf16=False)
    threshold = max(forward, backward)
    block = cfg.seq // cfg.world
    return {"achieved_gflops": achieved / 1e9, "threshold_tokens": threshold,
            "block_tokens": block, "hidden": block >= threshold}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=4, help="hosts, one rank each")
    parser.add_argument("--gbits", default="1,10", help="link speeds, Gbit/s, comma-separated")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--documents", default="stdlib")
    parser.add_argument("--layouts", default="balanced,zigzag")
    parser.add_argument("--transfers", default="all,mask")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args)
        return

    from hosts import Hosts, hosts_unavailable

    from ringray.bench.ring import summarize

    why = hosts_unavailable()
    if why:
        sys.exit(f"error: {why}")
    cfg = _config(args)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"ring-hosts-{os.getpid()}"
    work.mkdir(parents=True)
    rows = []
    print(f"{cfg.world} hosts, seq {cfg.seq}, heads {cfg.heads}/{cfg.kv_heads} x "
          f"{cfg.head_dim}, documents {cfg.documents}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with Hosts(cfg.world) as hosts:
        for gbit in (float(g) for g in args.gbits.split(",")):
            started = time.monotonic()
            per_rank = _run_speed(hosts, cfg, gbit, work)
            results = summarize(replace(cfg), per_rank)
            rule = _plan_rule(cfg, per_rank[0]["single"], gbit)
            for r in results:
                row = {"gbit": gbit, "layout": r.layout, "transfers": r.transfers,
                       "overlap": r.overlap_ratio, "peer_wait_s": r.peer_wait_seconds_max,
                       "wall_s": r.wall_seconds_max,
                       "exposed_s": r.exposed_comm_seconds_max,
                       "transfer_alone_s": max(r.transfer_seconds),
                       "sent_mib": r.bytes_sent_per_rank / 2**20,
                       "work_efficiency": r.work_efficiency, "plan": rule,
                       "load": os.getloadavg()[0]}
                rows.append(row)
                print(f"{gbit:>5g} Gbit/s  {r.layout:>9} {r.transfers:>4}  overlap "
                      f"{r.overlap_ratio:.3f}  peer wait {r.peer_wait_seconds_max:.3f} s  "
                      f"wall {r.wall_seconds_max:.2f} s  exposed "
                      f"{r.exposed_comm_seconds_max:.3f} s  alone "
                      f"{max(r.transfer_seconds):.3f} s  sent "
                      f"{r.bytes_sent_per_rank / 2**20:.1f} MiB", flush=True)
            print(f"{gbit:>5g} Gbit/s  plan's rule at {rule['achieved_gflops']:.1f} GFLOP/s "
                  f"(measured here): threshold {rule['threshold_tokens']:.0f} tokens, block "
                  f"{rule['block_tokens']} -> "
                  f"{'hidden' if rule['hidden'] else 'not hidden'}  "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
