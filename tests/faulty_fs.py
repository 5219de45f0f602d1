"""fsspec in-memory stores that fail on purpose, for the checkpoint tests.

- ``crashmem://``: :class:`CrashingMemoryFS` dies at the N-th change it makes (a write call, a
  file opened for writing, a copy, a delete, a directory made) and at every change after it,
  as a process killed at that moment would. Its ``mv`` is fsspec's default, a copy and then a
  delete, as on an object store.
- ``fullmem://``: :class:`FullMemoryFS` holds at most ``QUOTA_BYTES`` and then raises
  ``OSError(ENOSPC)`` naming the file, as a full disk does.
- ``denymem://``: :class:`DenyingMemoryFS` refuses to create any file inside a checkpoint
  directory (``step_*``) with ``OSError(code)``: a read-only store (EROFS) or one that is
  not ours to write (EACCES).
- ``quotafile://``: :class:`QuotaLocalFS` is the local disk with a small quota on one
  directory, shared by every process writing there (usage is measured on disk): a write past
  it raises ``OSError(ENOSPC)``, as a small tmpfs does, without mounting one.

- ``nodemem://``: :class:`NodeLocalMemoryFS` is memory private to each process: ranks in
  separate processes each see only their own files, as nodes do with a node-local disk.

The memory ones keep their files in a store of their own (not the shared ``memory://`` one).
"""

from __future__ import annotations

import errno
import os

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem


class Crash(BaseException):
    """The process died here (a BaseException, so no ``except Exception`` cleans up after it)."""


class CrashingMemoryFS(MemoryFileSystem):
    protocol = "crashmem"
    store: dict = {}  # noqa: RUF012 - fsspec's MemoryFileSystem keeps its files on the class
    pseudo_dirs = [""]  # noqa: RUF012
    budget: int | None = None  # changes left before the crash; None: never crash
    changes = 0  # changes made so far (counted even without a budget)

    @classmethod
    def reset(cls, *, budget: int | None = None) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.arm(budget)

    @classmethod
    def arm(cls, budget: int | None) -> None:
        cls.budget, cls.changes = budget, 0

    @classmethod
    def tick(cls) -> None:
        cls.changes += 1
        if cls.budget is not None:
            if cls.budget <= 0:
                raise Crash(f"crashed at change {cls.changes}")
            cls.budget -= 1

    def _open(self, path, mode="rb", **kwargs):
        if any(c in mode for c in "wax"):
            self.tick()
            file = super()._open(path, mode, **kwargs)
            write = file.write

            def counted_write(data, _write=write):
                self.tick()
                return _write(data)

            file.write = counted_write
            return file
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        self.tick()
        return super().pipe_file(path, value, **kwargs)

    def cp_file(self, path1, path2, **kwargs):
        self.tick()
        return super().cp_file(path1, path2, **kwargs)

    def _rm(self, path):
        self.tick()
        return super()._rm(path)

    def rmdir(self, path):
        self.tick()
        return super().rmdir(path)

    def mkdir(self, path, create_parents=True, **kwargs):
        self.tick()
        return super().mkdir(path, create_parents=create_parents, **kwargs)

    def makedirs(self, path, exist_ok=False):
        self.tick()
        return super().makedirs(path, exist_ok=exist_ok)


class FullMemoryFS(MemoryFileSystem):
    protocol = "fullmem"
    store: dict = {}  # noqa: RUF012
    pseudo_dirs = [""]  # noqa: RUF012
    QUOTA_BYTES = 1 << 20

    @classmethod
    def reset(cls, quota_bytes: int) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.QUOTA_BYTES = quota_bytes

    def _used(self) -> int:
        return sum(f.getbuffer().nbytes for f in self.store.values()
                   if isinstance(f, MemoryFile))

    def _open(self, path, mode="rb", **kwargs):
        file = super()._open(path, mode, **kwargs)
        if any(c in mode for c in "wax"):
            write = file.write
            full = self

            def limited_write(data, _write=write, _path=path):
                if full._used() + file.tell() + len(data) > full.QUOTA_BYTES:
                    raise OSError(errno.ENOSPC, "No space left on device", _path)
                return _write(data)

            file.write = limited_write
        return file

    def pipe_file(self, path, value, **kwargs):
        if self._used() + len(value) > self.QUOTA_BYTES:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super().pipe_file(path, value, **kwargs)


class DenyingMemoryFS(MemoryFileSystem):
    protocol = "denymem"
    store: dict = {}  # noqa: RUF012
    pseudo_dirs = [""]  # noqa: RUF012
    code = errno.EROFS

    @classmethod
    def reset(cls, code: int) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.code = code

    def _open(self, path, mode="rb", **kwargs):
        if any(c in mode for c in "wax") and "/step_" in path:
            raise OSError(self.code, os.strerror(self.code), path)
        return super()._open(path, mode, **kwargs)


class QuotaLocalFS(LocalFileSystem):
    protocol = "quotafile"
    root: str | None = None  # the directory the quota covers (set in every process)
    QUOTA_BYTES = 3 << 20

    @classmethod
    def limit(cls, root: str, quota_bytes: int) -> None:
        cls.root, cls.QUOTA_BYTES = root, quota_bytes

    @classmethod
    def _used_bytes(cls, excluding: str) -> int:
        """Bytes on disk under the root, not counting ``excluding`` (the file being written,
        whose size is its position)."""
        used = 0
        for folder, _, names in os.walk(cls.root or "/nonexistent"):
            for name in names:
                path = os.path.join(folder, name)
                if os.path.abspath(path) != os.path.abspath(excluding):
                    try:
                        used += os.path.getsize(path)
                    except FileNotFoundError:  # removed meanwhile
                        pass
        return used

    def _open(self, path, mode="rb", **kwargs):
        file = super()._open(path, mode, **kwargs)
        if any(c in mode for c in "wax"):
            write, local = file.write, self._strip_protocol(path)

            def limited_write(data, _write=write):
                size = memoryview(data).nbytes
                if self._used_bytes(local) + file.tell() + size > self.QUOTA_BYTES:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return _write(data)

            file.write = limited_write
        return file


class NodeLocalMemoryFS(MemoryFileSystem):
    protocol = "nodemem"
    store: dict = {}  # noqa: RUF012 - one per process: what a node-local disk is to a node
    pseudo_dirs = [""]  # noqa: RUF012


fsspec.register_implementation("crashmem", CrashingMemoryFS, clobber=True)
fsspec.register_implementation("fullmem", FullMemoryFS, clobber=True)
fsspec.register_implementation("denymem", DenyingMemoryFS, clobber=True)
fsspec.register_implementation("quotafile", QuotaLocalFS, clobber=True)
fsspec.register_implementation("nodemem", NodeLocalMemoryFS, clobber=True)
