"""Run lm_eval over a ring of local processes: rank 0 runs lm_eval, the others serve.

    python -m ringray.harness --cp 2 -- --model ringray \\
        --model_args pretrained=ckpt/ --tasks hellaswag --limit 10
    torchrun --nproc-per-node 2 -m ringray.harness -- --model ringray ...   # torchrun's ranks

Everything after ``--`` is lm_eval's command line, unchanged. ``--cp 1`` (the default) runs
lm_eval in this process. With ``--cp N`` this process starts N processes (spawned, so CUDA
and threads start clean) joined by one process group over loopback (gloo; nccl with
``--backend nccl`` on GPUs, one per rank); under ``torchrun`` it is one of torchrun's ranks
instead and starts nothing. The ``ringray`` model's ``cp`` defaults to the group's size.

Failure: every rank has two groups (:class:`~ringray.harness.ring.Groups`). The ring's
collectives time out after ``--timeout`` seconds, so a rank that hangs or dies inside a
forward fails the others; the other ranks wait up to ``--idle-timeout`` for rank 0's next
call (lm_eval may build a task's data for minutes between forwards). This launcher also
watches its ranks: when one exits with an error it ends the others (only the processes it
started, by their own handles) and exits with that rank's status, so nothing waits on a dead
peer for a timeout.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

DEFAULT_TIMEOUT_S = 1800.0
"""The ring's collective timeout: the longest one forward may wait on a peer."""

DEFAULT_IDLE_TIMEOUT_S = 6 * 3600.0
"""How long a serving rank waits for rank 0's next call."""

STOP_GRACE_S = 60.0
"""How long the other ranks have to leave after rank 0 has finished."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_lm_eval(arguments: Sequence[str]) -> None:
    """lm_eval's command line with ``arguments``, the ``ringray`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    import ringray.harness.lm  # noqa: F401 - registers the model

    saved = sys.argv
    sys.argv = ["lm_eval", *arguments]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


def run_rank(rank: int, world_size: int, arguments: Sequence[str], *, init_method: str,
             backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
             idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
             entry: Callable[[Sequence[str]], None] = run_lm_eval) -> None:
    """One rank: join the group, then rank 0 runs ``entry(arguments)`` (lm_eval's command
    line by default) and the others serve it."""
    import torch
    import torch.distributed as dist

    from ringray.attention.groups import init_kwargs
    from ringray.harness.ring import Groups, serve, stop_followers, use_groups

    device = None
    if backend == "nccl":
        index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=idle_timeout_s),
                            **init_kwargs(backend, device))
    try:
        work = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s))
        use_groups(Groups(work=work, control=None))
        if rank == 0:
            try:
                entry(arguments)  # an error leaves here: the launcher ends the others
            except SystemExit as exc:  # --help, or a command that ends early but well
                if exc.code not in (None, 0):
                    raise
            stop_followers()
        else:
            serve()
    finally:
        dist.destroy_process_group()


def _rank_entry(rank: int, world_size: int, arguments: list[str], port: int, backend: str,
                timeout_s: float, idle_timeout_s: float, threads: int,
                entry: Callable[[Sequence[str]], None]) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks: loopback only
    import torch

    torch.set_num_threads(threads)
    run_rank(rank, world_size, arguments, init_method=f"tcp://127.0.0.1:{port}",
             backend=backend, timeout_s=timeout_s, idle_timeout_s=idle_timeout_s, entry=entry)


def launch(cp: int, arguments: Sequence[str], *, backend: str = "gloo",
           timeout_s: float = DEFAULT_TIMEOUT_S, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
           threads: int | None = None,
           entry: Callable[[Sequence[str]], None] = run_lm_eval) -> int:
    """Start ``cp`` local ranks and wait for them; returns the exit status (0: all well,
    else the first failed rank's). Rank 0 runs ``entry(arguments)``: lm_eval's command line
    by default, or another module-level function (``ringray eval``'s). Only processes
    started here are ever stopped."""
    threads = threads or max(1, (os.cpu_count() or 1) // cp)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_entry, name=f"ringray-harness-rank{rank}",
                         args=(rank, cp, list(arguments), port, backend, timeout_s,
                               idle_timeout_s, threads, entry))
             for rank in range(cp)]
    for proc in procs:
        proc.start()
    status, deadline = 0, None
    try:
        while any(proc.is_alive() for proc in procs):
            failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs)
                      if proc.exitcode not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"ringray.harness: rank {rank} exited with status {code} (the first "
                      f"seen to fail); stopping the other ranks", file=sys.stderr)
                status = code if code > 0 else 1
                break
            if procs[0].exitcode == 0 and deadline is None:
                deadline = time.monotonic() + STOP_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                print("ringray.harness: ranks still running after rank 0 finished; stopping "
                      "them", file=sys.stderr)
                status = 1
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode]
    if failed and status == 0:
        status = failed[0][1] if failed[0][1] > 0 else 1
    if failed:
        print("ringray.harness: exit status by rank: " + ", ".join(
            f"{rank}: {proc.exitcode}" for rank, proc in enumerate(procs)), file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ringray.harness [--cp N] [...] -- <lm_eval arguments>``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        ours, theirs = argv[:split], argv[split + 1:]
    else:
        ours, theirs = [], argv
    parser = argparse.ArgumentParser(
        prog="python -m ringray.harness",
        description="Run lm_eval with the 'ringray' model over a ring of local processes. "
                    "Arguments after -- are lm_eval's.")
    parser.add_argument("--cp", type=int, default=None,
                        help="ranks in the ring (default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="process group backend (nccl: one GPU per rank)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds a forward may wait on another rank")
    parser.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                        help="seconds a serving rank waits for rank 0's next call")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: CPUs / cp)")
    args = parser.parse_args(ours)
    if not theirs:
        parser.error("give lm_eval's arguments after --, e.g. -- --model ringray "
                     "--model_args pretrained=DIR --tasks TASK")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if args.cp not in (None, world):
            parser.error(f"--cp {args.cp} under torchrun with WORLD_SIZE={world}; the ring "
                         f"is every rank (drop --cp)")
        if world > 1:
            run_rank(int(os.environ["RANK"]), world, theirs, init_method="env://",
                     backend=args.backend, timeout_s=args.timeout,
                     idle_timeout_s=args.idle_timeout)
            return 0
    cp = args.cp or 1
    if cp < 1:
        parser.error(f"--cp {cp} must be >= 1")
    if cp == 1:
        run_lm_eval(theirs)
        return 0
    return launch(cp, theirs, backend=args.backend, timeout_s=args.timeout,
                  idle_timeout_s=args.idle_timeout, threads=args.threads)
