"""A hung step leaves evidence: every worker's flight recorder, in the run directory.

torch records each process's recent collectives (its *flight recorder*: which collective, on
which group, with which sequence number, and whether it finished) for gloo and NCCL alike
(torch 2.13: ``TORCH_FR_BUFFER_SIZE`` entries, 2000 unless set; gloo's point-to-point sends
and receives, the ring's exchanges on CPU, are not recorded, NCCL's are). When the
controller declares a step hung (``cluster.step_timeout_seconds``) it asks every worker for
its evidence before it kills them, on the actor's second thread (``max_concurrency=2``: the
first is stuck in the step, waiting with the GIL released), and waits at most
``cluster.hang_dump_seconds`` for the answers (:class:`WorkerDump`): the recorder, and the
Python stack of every other thread of the worker, so a rank stuck where the recorder does
not look (a gloo receive, a loop of its own) still says where. The controller writes what
arrives (:meth:`~ringray.cluster.record.JobRecord.flight_recorder`) under
``RUN/flight-recorder/<workers>/``: ``rank_<r>``, the recorder in torch's own pickle format
(what torch's ``fr_trace`` analyser reads), and ``stacks_<r>.txt``; and records one event
naming the directory, each rank's oldest unfinished collective, where its stuck call is in
ringray's code, and the ranks that did not answer (a rank stopped outright cannot; the
others' dumps show what they wait for)::

    flight recorder after a step hung: rank(s) 1 dumped to runs/q/flight-recorder/ringray-q-
    20261129T100610 (rank_<r>, stacks_<r>.txt); rank 1 has nothing pending (the last:
    gloo:all_gather (collective 17, finished)), stuck at ringray/attention/comm.py:160
    (wait); rank(s) 0 did not answer within 1.5 s

The controller kills the workers only after that (step timeout + dump grace), and the
job's collective timeout (``COLLECTIVE_TIMEOUT_FACTOR`` step timeouts) comes later still
(:class:`~ringray.cluster.job_options.ClusterOptions` refuses a grace that would reorder
them), so NCCL's watchdog never aborts a worker before it is asked. For NCCL the workers
also start with torch's own dump on a collective timeout or error switched on and pointed
at the same directory (:func:`recorder_environment`; ``nccl_rank_<r>`` files, written by
each worker's node): it covers what the controller does not time, such as a collective
error that kills a worker at once. Gloo has no dump on timeout of its own in torch 2.13;
its recorder is read the same way.
"""

from __future__ import annotations

import pickle
import sys
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ringray.train.flight_recorder import (
    FLIGHT_RECORDER_DIR,
    NCCL_DUMP_PREFIX,
    RECORDER_ENTRIES,
    recorder_environment,
)

__all__ = ["FLIGHT_RECORDER_DIR", "NCCL_DUMP_PREFIX", "RECORDER_ENTRIES", "WorkerDump",
           "dump_summary", "pending_collective", "rank_summary", "recorder_directory",
           "recorder_environment", "thread_stacks"]

DUMP_PREFIX = "rank_"
"""The controller's files: ``rank_<r>`` (the recorder) and ``stacks_<r>.txt``."""
STACKS_PREFIX = "stacks_"


@dataclass(frozen=True, kw_only=True)
class WorkerDump:
    """What a worker hands over when a call of its hangs."""

    recorder: bytes | None  # torch's flight recorder, pickled; None before a process group
    stacks: str  # the Python stack of every other thread of the worker
    stuck_at: str | None  # the innermost frame of ringray's code in its busy thread


def thread_stacks() -> tuple[str, str | None]:
    """Every thread's Python stack but the caller's (innermost call last), and where the
    thread running ringray's own code (outside the service: the training, the ring) is,
    as ``ringray/attention/comm.py:160 (wait)``; ``None`` when no thread is there."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    blocks, stuck_at = [], None
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        stack = traceback.extract_stack(frame)
        lines = "".join(traceback.format_list(stack))
        blocks.append(f"thread {names.get(ident, ident)}:\n{lines}")
        ours = [f for f in stack if "/ringray/" in f.filename
                and "/ringray/cluster/" not in f.filename]
        if ours and stuck_at is None:
            stuck_at = f"{_in_ringray(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})"
    return "\n".join(blocks), stuck_at


def _in_ringray(filename: str) -> str:
    return "ringray/" + filename.rsplit("/ringray/", 1)[1]


def recorder_directory(run_dir: str | Path, workers: str) -> Path:
    """Where the flight recorders of one start of a group of workers (named ``workers``)
    go: ``RUN/flight-recorder/<workers>``."""
    return Path(run_dir) / FLIGHT_RECORDER_DIR / workers


def pending_collective(dump: bytes) -> str:
    """What a rank's dump (torch's pickle) says it waits for: its oldest collective that has
    not finished, with the first frame of this project's code that called it; or that
    nothing is pending (the rank is stuck outside any collective, or not stuck at all)."""
    try:
        trace = pickle.loads(dump)  # the job's own workers' bytes, as torch wrote them
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        return f"sent an unreadable dump ({type(exc).__name__})"
    entries = sorted(trace.get("entries", []), key=lambda e: e.get("record_id", 0))
    if not entries:
        return "has no collective recorded"
    pending = [e for e in entries
               if not e.get("retired") and e.get("state") != "completed"]
    if not pending:
        return f"has nothing pending (the last: {_describe(entries[-1])})"
    return f"waits in {_describe(pending[0])}{_caller(pending[0])}"


def _describe(entry: Mapping) -> str:
    kind = "p2p" if entry.get("is_p2p") else "collective"
    number = entry.get("p2p_seq_id" if entry.get("is_p2p") else "collective_seq_id")
    # gloo leaves a finished entry's state "scheduled" (no device events): retired says it
    state = "finished" if entry.get("retired") else entry.get("state", "?")
    return f"{entry.get('profiling_name', '?')} ({kind} {number}, {state})"


def _caller(entry: Mapping) -> str:
    """`` at ringray/x.py:12``: the innermost frame in this project's code, if any."""
    for frame in entry.get("frames", []):
        filename = str(frame.get("filename", ""))
        if "/ringray/" in filename:
            return f" at {_in_ringray(filename)}:{frame.get('line')}"
    return ""


def rank_summary(dump: WorkerDump) -> str:
    """One rank's answer in a few words: what its recorder says it waits for, and where its
    stuck call is."""
    said = (pending_collective(dump.recorder) if dump.recorder is not None
            else "has no process group yet")
    return f"{said}, stuck at {dump.stuck_at}" if dump.stuck_at else said


def dump_summary(directory: Path, dumps: Mapping[int, WorkerDump], *, ranks: int,
                 waited_seconds: float, what: str, saved: bool = True) -> str:
    """The event's line (see the module docstring): ``dumps`` are the answers, by rank, of
    the ``ranks`` workers asked after ``what`` hung, written to ``directory`` (unless not
    ``saved``); the NCCL dumps found there are named too."""
    answered = sorted(dumps)
    silent = [rank for rank in range(ranks) if rank not in dumps]
    nccl = sorted(p.name for p in directory.glob(f"{NCCL_DUMP_PREFIX}*")) \
        if directory.is_dir() else []
    parts = []
    if answered:
        where = (f"dumped to {directory} ({DUMP_PREFIX}<r>, {STACKS_PREFIX}<r>.txt)" if saved
                 else "answered (not saved)")
        parts.append(f"rank(s) {_ranks(answered)} {where}")
        parts += [f"rank {rank} {rank_summary(dumps[rank])}" for rank in answered]
    if nccl:
        parts.append(f"NCCL's own dumps there: {', '.join(nccl)}")
    if silent:
        parts.append(f"rank(s) {_ranks(silent)} did not answer within {waited_seconds:g} s")
    if not answered and not nccl:
        parts.append(f"no dump appeared in {directory}")
    return f"flight recorder after {what} hung: " + "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
