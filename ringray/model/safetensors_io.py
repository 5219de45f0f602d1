"""Safetensors checkpoints, single-file or sharded, on a local disk or any fsspec filesystem.

    checkpoint = SafetensorsCheckpoint("ckpt/")            # or "s3://bucket/ckpt"
    checkpoint.shape("model.norm.weight")                   # from the headers, no data read
    rows = checkpoint.read("model.embed_tokens.weight", rows=slice(0, 1024))
    for name, tensor in checkpoint.tensors(["model.norm.weight", ...]): ...

    write_safetensors(tensors, "out/", max_shard_bytes=5 * 10**9)

Reading is lazy: nothing but the headers is read until a tensor is asked for, and then only
that tensor's bytes (or the rows asked for, which are one contiguous range), so a sharded
(FSDP) loader can read just its shard. Local files go through ``safetensors.safe_open``
(memory-mapped); other filesystems through ranged reads of the same format.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import fsspec
import safetensors.torch
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lives: its file and, from that file's header, dtype and extent."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset of the tensor's data in ``file``."""
    end: int


def _header_entries(raw: bytes, file: str, path: str, *, data_start: int,
                    size: int) -> dict[str, _Entry]:
    """The tensors a safetensors header (``raw``, the JSON after the length) describes, with
    the checks ``safe_open`` makes: each tensor's byte range fits its dtype and shape, and the
    ranges cover the data after the header exactly (else the file is truncated or padded)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is {_preview(header)}, expected a JSON object "
                         f"of tensors")
    header.pop("__metadata__", None)
    entries = {}
    for name, info in header.items():
        try:
            dtype, shape = info["dtype"], tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name} has no valid dtype, shape and "
                             f"data_offsets in the header") from None
        nbytes = math.prod(shape) * _DTYPES[dtype].itemsize if dtype in _DTYPES else None
        if not 0 <= begin <= end or (nbytes is not None and end - begin != nbytes):
            raise ValueError(f"{path}: tensor {name} has data_offsets [{begin}, {end}], which "
                             f"do not hold its {dtype} shape {list(shape)}")
        entries[name] = _Entry(file, dtype, shape, data_start + begin, data_start + end)
    for entry_name, entry in sorted(entries.items(), key=lambda item: item[1].end):
        if entry.end > size:
            raise ValueError(f"{path}: truncated: tensor {entry_name} ends at byte {entry.end} "
                             f"but the file has {size} bytes")
    data_end = max((e.end for e in entries.values()), default=data_start)
    if data_end != size:
        raise ValueError(f"{path}: {size - data_end} bytes after the last tensor's data "
                         f"(the file is not as safetensors wrote it)")
    return entries


def join(root: str, name: str) -> str:
    """``root/name`` for a local path or a URL."""
    return posixpath.join(root.rstrip("/"), name) if "://" in root else f"{root}/{name}"


def read_json(path: str) -> dict:
    """The JSON object in a file at a local path or fsspec URL; ``ValueError`` (one line
    naming the file) when it is absent, unreadable, not JSON or not an object."""
    try:
        with fsspec.open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except NotADirectoryError:
        raise ValueError(f"{path}: a parent of it is a file, not a directory") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, expected a JSON file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                         f"offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to parse as JSON") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {_preview(data)}")
    return data


def _preview(value: object, limit: int = 40) -> str:
    """``value`` as JSON, cut to ``limit`` characters, for a message."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SafetensorsCheckpoint:
    """The tensors of a directory holding ``model.safetensors`` or an index of shards."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"
        self._fs, self._path = fsspec.core.url_to_fs(self.root)
        files = self._shard_files()
        self._entries: dict[str, _Entry] = {}
        for file in files:
            for name, entry in self._read_header(file).items():
                self._entries[name] = entry

    def _shard_files(self) -> list[str]:
        if self._fs.exists(self._file_path(INDEX_FILE)):
            weight_map = read_json(join(self.root, INDEX_FILE)).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{join(self.root, INDEX_FILE)}: no weight_map")
            return sorted(set(weight_map.values()))
        if self._fs.exists(self._file_path(SINGLE_FILE)):
            return [SINGLE_FILE]
        raise ValueError(f"{self.root}: no {SINGLE_FILE} or {INDEX_FILE} (ringray reads "
                         f"safetensors checkpoints only)")

    def _read_header(self, file: str) -> dict[str, _Entry]:
        """``file``'s tensors from its header, checked against the file's size (no tensor
        data read): what ``safe_open`` would refuse later, on a worker, is refused here in
        one line naming the file."""
        path = join(self.root, file)
        try:
            size = self._fs.size(self._file_path(file))
            with self._fs.open(self._file_path(file), "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise ValueError(f"{path}: {size} bytes, too short for a safetensors file "
                                     f"(it starts with an 8-byte header length)")
                (length,) = struct.unpack("<Q", prefix)
                if length > size - 8:
                    raise ValueError(f"{path}: header length {length} bytes is more than the "
                                     f"{size - 8} bytes after it (a truncated file, or not "
                                     f"safetensors)")
                raw = f.read(length)
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file (named by {INDEX_FILE})") from None
        return _header_entries(raw, file, path, data_start=8 + length, size=size)

    @property
    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise ValueError(f"{name}: missing from the checkpoint at {self.root}")
        return self._entries[name]

    def read(self, name: str, *, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name`` (only ``rows`` of its first dimension, if given), on the CPU."""
        entry = self._entry(name)
        if isinstance(self._fs, LocalFileSystem):
            with safe_open(self._file_path(entry.file), framework="pt") as f:
                return f.get_slice(name)[rows] if rows is not None else f.get_tensor(name)
        return self._read_range(entry, rows)

    def tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for ``names`` (default: all), reading one file at a time."""
        wanted = list(self.names if names is None else names)
        by_file: dict[str, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self._entry(name).file, []).append(name)
        for file, file_names in sorted(by_file.items()):
            if isinstance(self._fs, LocalFileSystem):
                with safe_open(self._file_path(file), framework="pt") as f:
                    for name in file_names:
                        yield name, f.get_tensor(name)
            else:
                for name in file_names:
                    yield name, self._read_range(self._entries[name], None)

    def _file_path(self, file: str) -> str:
        """``file``'s path as this filesystem names it (a plain path for local files)."""
        return posixpath.join(self._path, file)

    def _read_range(self, entry: _Entry, rows: slice | None) -> torch.Tensor:
        if entry.dtype not in _DTYPES:
            raise ValueError(f"{entry.file}: dtype {entry.dtype} is not supported; supported: "
                             f"{', '.join(_DTYPES)}")
        dtype, shape, begin, end = _DTYPES[entry.dtype], list(entry.shape), entry.begin, entry.end
        if rows is not None and shape:
            start, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError(f"rows: {rows} must be a contiguous slice")
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + start * row_bytes, begin + max(stop, start) * row_bytes
            shape[0] = max(stop - start, 0)
        try:
            with self._fs.open(self._file_path(entry.file), "rb") as f:
                f.seek(begin)
                data = f.read(end - begin)
        except ValueError as exc:  # the stream's own (a file closed under the read): the
            # store failed, not the file's content; an OSError, so the service retries it
            raise OSError(f"{entry.file}: reading bytes {begin}-{end} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], root: str, *, max_shard_bytes: int,
    load: Callable[[list[str]], Mapping[str, torch.Tensor]] | None = None,
) -> list[str]:
    """Write ``tensors`` under ``root``: one ``model.safetensors`` when they fit in
    ``max_shard_bytes``, else ``model-0000i-of-0000n.safetensors`` shards (in the order given,
    none over the limit unless one tensor is) and ``model.safetensors.index.json``.

    ``load``: the tensors are read shard by shard. ``tensors`` then only gives each one's
    shape and dtype (meta tensors will do), and ``load(names)`` returns one shard's tensors,
    which are written and dropped before the next shard is read: the bytes held at once are
    one shard's, not the checkpoint's.

    Earlier ``model*.safetensors`` files and index under ``root`` are removed first, so a
    reader never mixes two saves. Returns the file names written.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: {max_shard_bytes} must be >= 1")
    fs, path = fsspec.core.url_to_fs(root)
    fs.makedirs(path, exist_ok=True)
    for stale in fs.glob(f"{path.rstrip('/')}/model*.safetensors*"):
        fs.rm(stale)
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}
    shards = shard_names(sizes, max_shard_bytes)
    count = len(shards)
    names = ([SINGLE_FILE] if count == 1 else
             [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
    for file, shard in zip(names, shards, strict=True):
        part = load(shard) if load is not None else {n: tensors[n] for n in shard}
        part = {n: part[n].detach().contiguous() for n in shard}
        target = f"{path.rstrip('/')}/{file}"
        if isinstance(fs, LocalFileSystem):  # written from the tensors' memory, no copy
            safetensors.torch.save_file(part, target, metadata={"format": "pt"})
            # save_file creates its file 0600; give it what any new file gets (0644 under
            # the usual umask), so a service running as another user can read the export
            os.chmod(target, 0o666 & ~_umask())
        else:  # the file's bytes are built in memory, then uploaded
            data = safetensors.torch.save(part, metadata={"format": "pt"})
            with fs.open(target, "wb") as f:
                f.write(data)
            del data
        del part
    if count > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: file for file, shard in zip(names, shards, strict=True)
                                for n in shard}}
        with fs.open(f"{path.rstrip('/')}/{INDEX_FILE}", "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        names.append(INDEX_FILE)
    return names


def _umask() -> int:
    """This process's umask (Linux tells it in /proc; elsewhere it is set and put back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shard_names(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names (in the order given) cut into shards of at most ``max_shard_bytes``
    (one tensor larger than that is a shard of its own)."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, size in sizes.items():
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    return shards
