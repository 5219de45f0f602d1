"""Start N local processes joined by a gloo process group over loopback, and collect results.

    results = run_gloo_ranks(4, module.fn, arg, timeout_seconds=600)

``fn(rank, world_size, *args)`` runs on each rank after ``init_process_group("gloo")``;
return values come back in rank order. A rank that raises is reported with its traceback;
a run that does not finish in time is killed (only the processes started here) and reported
as a hang naming the ranks that never answered. ``fn`` must be importable by name. Used by
the benchmarks and by the multi-process tests.

The ranks are forked from a fork server that has imported torch and ringray's training
stack once (multiprocessing's ``forkserver`` with :data:`PRELOADED`), not started afresh:
a fresh interpreter spends about 4 CPU seconds importing them, which every rank of every
run paid before (a 2-rank run cost 4.6 s of wall time on 2 cores before ``fn`` began; from
the fork server, 0.8 s). The fork server is single-threaded when it forks, and each rank
takes the caller's environment as it is at the call (the server's is that of its start).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

PRELOADED = ("torch", "torch.distributed", "ringray.train")
"""What the fork server imports once, for every rank it forks (nothing that reads the
environment at import for later use, nor starts a thread: transformers, Ray, Triton and
torchft are left to the ranks that use them)."""

_context: mp.context.BaseContext | None = None


def rank_context() -> mp.context.BaseContext:
    """The multiprocessing context ranks start from: the fork server with :data:`PRELOADED`
    (started at the first rank, kept for this process's life)."""
    global _context
    if _context is None:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOADED))
        _context = context
    return _context


class RanksFailed(RuntimeError):
    """One or more ranks raised, hung or died."""


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world_size, port, fn, args, results, threads, collective_timeout,
           environ) -> None:
    os.environ.clear()  # the caller's, not the fork server's (from the server's start)
    os.environ.update(environ)
    # Keep gloo's connections on loopback: these are single-machine runs.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=world_size, timeout=timedelta(seconds=collective_timeout),
        )
        # Plain pickle, not the queue's: torch's reducers would pass tensors as shared-memory
        # handles that die with this process, which exits right after reporting.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - report anything, assertion errors included
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(results, procs, got: dict, timeout_seconds: float) -> None:
    world_size = len(procs)
    deadline = time.monotonic() + timeout_seconds
    while len(got) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(got))
            raise RanksFailed(
                f"ranks {missing} did not finish within {timeout_seconds:.0f}s (a hang)"
            )
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
            got[rank] = (ok, value)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
            if dead and results.empty():
                raise RanksFailed(f"ranks {dead} exited without reporting") from None


def run_gloo_ranks(
    world_size: int, fn, *args: Any, timeout_seconds: float = 600, threads: int = 1,
    collective_timeout_seconds: float = 300,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` fresh processes; raise :class:`RanksFailed` on error.
    ``collective_timeout_seconds`` is the default group's timeout (the job's)."""
    ctx = rank_context()
    results = ctx.Queue()
    port = free_loopback_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, threads,
                                         collective_timeout_seconds, environ),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    try:
        _collect(results, procs, got, timeout_seconds)
    except RanksFailed:
        for p in procs:  # a hung or dead rank: stop the others now, they would wait forever
            p.kill()
            p.join()
        raise
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f"rank {r}:\n{value}" for r, (ok, value) in sorted(got.items()) if not ok]
    if errors:
        raise RanksFailed("\n".join(errors))
    return [pickle.loads(got[r][1]) for r in range(world_size)]
