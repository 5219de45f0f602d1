"""Content checksums of a checkpoint's files (CRC-32C), computed while DCP writes them.

    writer = FileSystemWriter(directory)
    writer.fs = ChecksummingFileSystem(writer.fs)   # DCP's storage layer, wrapped
    dcp.save(state, storage_writer=writer)
    writer.fs.written                               # {"__0_0.distcp": FileChecksum(...), ...}
    file_checksum(open_file)                        # the same, read back from storage

**Why while writing.** The bytes are hashed as they pass to the store, so a save costs no
extra read (on an object store, a download of the whole checkpoint), and what is recorded is
what the trainer meant to write: a store that keeps something else is caught at the next load.
DCP writes each file front to back (``torch.save`` into one stream per file); a stream that is
seeked instead is left unhashed and :meth:`CheckpointStore <ringray.train.checkpoint>` reads
that file back to hash it before the commit.

**Why CRC-32C** (the ``crc32c`` package): hardware-accelerated (SSE 4.2, ARMv8; about 14 GB/s
on one core here), it takes any buffer (torch's serializer hands over memoryviews, so nothing
is copied), and it is the checksum GCS and S3 record for objects.

**Write errors.** torch's serializer turns a failed write (a full disk) into ``RuntimeError:
unexpected pos``, with the ``OSError`` only in ``__context__``, which DCP drops when it sends
one rank's failure to the others. The stream remembers the ``OSError`` (naming the file) and
raises it in place of the serializer's error.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import crc32c
from torch.distributed.checkpoint.filesystem import FileSystemBase

ALGORITHM = "crc32c"
_READ_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class FileChecksum:
    """A file's length and CRC-32C (as 8 hex digits, the marker's form)."""

    size_bytes: int
    crc32c: str


def _hex(value: int) -> str:
    return f"{value:08x}"


def file_checksum(stream: IO[bytes]) -> FileChecksum:
    """The checksum of everything left in ``stream`` (read in 8 MiB chunks into one buffer)."""
    buffer = bytearray(_READ_CHUNK_BYTES)
    view = memoryview(buffer)
    value, size = 0, 0
    while True:
        count = stream.readinto(view) if hasattr(stream, "readinto") else None
        if count is None:  # a stream without readinto (some fsspec files)
            chunk = stream.read(_READ_CHUNK_BYTES)
            count = len(chunk)
            view[:count] = chunk
        if not count:
            return FileChecksum(size_bytes=size, crc32c=_hex(value))
        value = crc32c.crc32c(view[:count], value)
        size += count


def _name(path: str | os.PathLike) -> str:
    """A file's name inside its checkpoint directory (DCP's are flat)."""
    return os.fspath(path).replace("\\", "/").rsplit("/", 1)[-1]


class _ChecksummingStream:
    """A write stream that hashes what passes through it and remembers the first ``OSError``
    a write raised (with the file's path, which a local file's error lacks)."""

    def __init__(self, raw: IO[bytes], path: str) -> None:
        self.raw, self.path = raw, path
        self.value, self.size_bytes = 0, 0
        self.hashed = True  # False once the stream is seeked: the hash no longer matches
        self.write_error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written = self.raw.write(data)
        except OSError as exc:
            if self.write_error is None:
                self.write_error = exc if exc.filename else OSError(
                    exc.errno, exc.strerror, self.path)
            raise
        view = memoryview(data).cast("B")
        written = view.nbytes if written is None else written
        self.value = crc32c.crc32c(view[:written], self.value)
        self.size_bytes += written
        return written

    def seek(self, *args: Any) -> int:
        self.hashed = False
        return self.raw.seek(*args)

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close ...
        return getattr(self.raw, name)


class ChecksummingFileSystem(FileSystemBase):
    """DCP's storage layer (``FileSystemWriter.fs``), with every file written through it
    hashed: :attr:`written` maps each file's name to its :class:`FileChecksum` once it is
    closed (a file DCP renames, its ``.metadata``, under its final name)."""

    def __init__(self, inner: FileSystemBase) -> None:
        self.inner = inner
        self.written: dict[str, FileChecksum] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if mode != "wb":
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        with self.inner.create_stream(path, mode) as raw:
            stream = _ChecksummingStream(raw, os.fspath(path))
            try:
                yield stream
            except OSError:
                raise
            except BaseException as exc:
                if stream.write_error is not None:  # the cause the serializer hid
                    raise stream.write_error from exc
                raise
        with self._lock:
            if stream.hashed:
                self.written[_name(path)] = FileChecksum(stream.size_bytes, _hex(stream.value))
            else:
                self.written.pop(_name(path), None)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)
        with self._lock:
            checksum = self.written.pop(_name(path), None)
            if checksum is not None:
                self.written[_name(new_path)] = checksum

    def rm_file(self, path: str | os.PathLike) -> None:
        self.inner.rm_file(path)
        with self._lock:
            self.written.pop(_name(path), None)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return self.inner.concat_path(path, suffix)

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return self.inner.init_path(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.inner.mkdir(path)

    def exists(self, path: str | os.PathLike) -> bool:
        return self.inner.exists(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True  # the writer that holds this one has validated it
