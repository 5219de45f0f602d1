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
import posixpath
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

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


def join(root: str, name: str) -> str:
    """``root/name`` for a local path or a URL."""
    return posixpath.join(root.rstrip("/"), name) if "://" in root else f"{root}/{name}"


def read_json(path: str) -> dict:
    """A JSON file at a local path or fsspec URL (``ValueError`` naming it if absent)."""
    try:
        with fsspec.open(path, "r") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None


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
        with self._fs.open(self._file_path(file), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        start = 8 + length
        return {
            name: _Entry(file, info["dtype"], tuple(info["shape"]),
                         start + info["data_offsets"][0], start + info["data_offsets"][1])
            for name, info in header.items()
        }

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
        with self._fs.open(self._file_path(entry.file), "rb") as f:
            f.seek(begin)
            data = f.read(end - begin)
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], root: str, *, max_shard_bytes: int
) -> list[str]:
    """Write ``tensors`` under ``root``: one ``model.safetensors`` when they fit in
    ``max_shard_bytes``, else ``model-0000i-of-0000n.safetensors`` shards (in the order given,
    none over the limit unless one tensor is) and ``model.safetensors.index.json``.

    Earlier ``model*.safetensors`` files and index under ``root`` are removed first, so a
    reader never mixes two saves. Returns the file names written.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: {max_shard_bytes} must be >= 1")
    fs, path = fsspec.core.url_to_fs(root)
    fs.makedirs(path, exist_ok=True)
    for stale in fs.glob(f"{path.rstrip('/')}/model*.safetensors*"):
        fs.rm(stale)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    count = len(shards)
    names = ([SINGLE_FILE] if count == 1 else
             [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
    for file, shard in zip(names, shards, strict=True):
        data = safetensors.torch.save(
            {n: t.detach().contiguous() for n, t in shard.items()}, metadata={"format": "pt"}
        )
        with fs.open(f"{path.rstrip('/')}/{file}", "wb") as f:
            f.write(data)
    if count > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: file for file, shard in zip(names, shards, strict=True)
                                for n in shard}}
        with fs.open(f"{path.rstrip('/')}/{INDEX_FILE}", "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        names.append(INDEX_FILE)
    return names
