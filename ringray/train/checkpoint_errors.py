"""What went wrong with a checkpoint, in one line, and whether a retry can help.

    except (Exception, CheckpointException) as exc:       # what dcp.save / dcp.load raised
        describe_error(exc)        # "ENOSPC (No space left on device): /ck/step_.../__0_0.distcp"
        deterministic_errno(exc)   # errno.ENOSPC: no retry can fix it
        load_error(ref, exc, mismatch=..., verified=...)  # by evidence: CheckpointError /
                                                          # CheckpointIOError / CheckpointCorrupt

The service retries what is not a ``ValueError``: :class:`CheckpointError` and its kinds are
ValueErrors (a full disk, a corrupt checkpoint, another model's), :class:`CheckpointIOError`
is a ``RuntimeError`` (a dropped connection, a peer that died). DCP reports each rank's
failure inside one ``CheckpointException``, pickled from rank to rank (which drops the
``__context__`` of each): :func:`root_cause` looks at every rank's.
"""

from __future__ import annotations

import errno
import re

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ringray.train.checkpoint_ref import CheckpointRef

# Errors no retry can fix: the store is full, read-only, or not ours to write.
# What each says about checkpoint.path, and what to do.
DETERMINISTIC_ERRNOS = {
    errno.ENOSPC: ("is full (no space left on device)", "free space there"),
    errno.EDQUOT: ("is over its disk quota", "free space there"),
    errno.EACCES: ("is not writable (permission denied)", "make it writable"),
    errno.EPERM: ("is not writable (operation not permitted)", "make it writable"),
    errno.EROFS: ("is on a read-only file system", "make it writable"),
    errno.ENAMETOOLONG: ("makes a file name too long", "use a shorter path"),
    errno.ENOTDIR: ("has a file where a directory should be", "remove that file"),
}
# A collective that failed because a peer died, hung or dropped its connection.
_COMMUNICATION = re.compile(r"\bgloo\b|nccl|connection (?:closed|reset|refused)|broken pipe|"
                            r"processgroup|timed out|socket timeout", re.IGNORECASE)


class CheckpointError(ValueError):
    """A checkpoint problem that a retry cannot fix (a ``ValueError``, so the service does not
    retry it); the message is one line naming the checkpoint and the cause."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint whose files do not match its marker (missing, truncated), or
    whose marker cannot be read. ``ref`` is the checkpoint, so a caller can fall back."""

    def __init__(self, message: str, ref: CheckpointRef) -> None:
        super().__init__(message)
        self.ref = ref

    def __reduce__(self):  # survives pickling (Ray sends it from a worker to the controller)
        return (type(self), (str(self), self.ref))


class CheckpointWriteError(CheckpointError):
    """Saving failed for a reason a retry cannot fix (no space, no permission, read-only)."""


class CheckpointIOError(RuntimeError):
    """Saving or loading failed for a reason that may pass (a dropped connection, a peer that
    died mid-save): recovering from the previous checkpoint is the remedy."""


def rank_failures(exc: BaseException) -> list[BaseException]:
    """Every rank's exception inside DCP's ``CheckpointException`` (which lists each failed
    rank's exception with its traceback), in rank order; ``[exc]`` for any other exception."""
    if isinstance(exc, CheckpointException) and exc.failures:
        found = []
        for failure in exc.failures.values():
            first = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(first, BaseException):
                found.extend(rank_failures(first))
        return found or [exc]
    return [exc]


def root_cause(exc: BaseException) -> BaseException:
    """What really went wrong: of every rank's failure (:func:`rank_failures`), the one no
    retry can fix if there is one, else one that is an ``OSError``, else the first; and
    below each the ``OSError`` a library error was raised from (torch's serializer turns a
    failed write into a ``RuntimeError`` whose context is the ``OSError``)."""
    causes = [_unwrapped(failure) for failure in rank_failures(exc)]
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno in DETERMINISTIC_ERRNOS:
            return cause
    return next((c for c in causes if isinstance(c, OSError)), causes[0])


def _unwrapped(exc: BaseException) -> BaseException:
    """The first ``OSError`` in ``exc``'s chain of causes and contexts, else ``exc``."""
    seen, current = set(), exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return exc


def describe_error(exc: BaseException) -> str:
    """One line: ``ENOSPC (No space left on device): /path/file`` for an ``OSError``, else the
    exception's type and first line."""
    cause = root_cause(exc)
    if isinstance(cause, OSError) and cause.errno is not None:
        name = errno.errorcode.get(cause.errno, str(cause.errno))
        where = cause.filename or ""
        return f"{name} ({cause.strerror}){': ' + str(where) if where else ''}"
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def is_deterministic(exc: BaseException) -> bool:
    """Whether a save or load failure would happen again on a retry."""
    return deterministic_errno(exc) is not None


def deterministic_errno(exc: BaseException) -> int | None:
    """The errno of a failure no retry can fix (a full disk, no permission ...), else None."""
    cause = root_cause(exc)
    if isinstance(cause, OSError) and cause.errno in DETERMINISTIC_ERRNOS:
        return cause.errno
    return None


def is_communication_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer died, hung or disconnected (a
    ``DistError``, or gloo's and NCCL's ``RuntimeError``)."""
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and bool(_COMMUNICATION.search(str(exc))))


def load_error(ref: CheckpointRef, exc: BaseException, *, mismatch: str | None,
               verified: bool) -> Exception:
    """What a failure inside ``dcp.load`` means, judged by evidence, not by its wording:

    - ``mismatch`` (a tensor this run needs that the checkpoint lacks, or holds with another
      shape or dtype, found in the checkpoint's own metadata): another model's
      (:class:`CheckpointError`);
    - a full disk or a missing permission (:func:`deterministic_errno`):
      :class:`CheckpointError`, no retry can fix it;
    - ``verified`` (every file passed its size and checksum): anything else, an exception
      of the store, of a peer, of torch or of the device, is not the checkpoint's; it is
      retried (:class:`CheckpointIOError`);
    - else (a marker without checksums): the files cannot be read (:class:`CheckpointCorrupt`;
      the caller falls back to the previous checkpoint).
    """
    where = f"checkpoint {ref.location}"
    if mismatch is not None:
        return CheckpointError(f"{where} belongs to another model: {mismatch}")
    if deterministic_errno(exc) is not None:
        return CheckpointError(f"{where} cannot be read: {describe_error(exc)}")
    if verified:
        peer = next((f for f in rank_failures(exc) if is_communication_failure(f)), None)
        what = "with a peer " if peer is not None else ""
        return CheckpointIOError(f"{where}: the restore failed {what}"
                                 f"({describe_error(peer or exc)}); its files passed their "
                                 f"checksums, so a retry can pass")
    return CheckpointCorrupt(f"{where} cannot be read: {describe_error(exc)}", ref)
