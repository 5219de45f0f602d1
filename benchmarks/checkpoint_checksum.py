"""What the checkpoints' content checksums (CRC-32C) cost, in seconds per GB, on save and load.

    python benchmarks/checkpoint_checksum.py                   # 1 GB, 5 rounds, in /tmp
    python benchmarks/checkpoint_checksum.py --gb 0.25 --rounds 5 --dir /mnt/disk

One process writes a state of float32 tensors (64 MiB each) with DCP and reads it back, each
way side by side in every round (alternating which goes first):

- save, plain: ``dcp.save`` with DCP's ``FileSystemWriter`` (fsync on, as ringray saves);
- save, checksummed: the same writer with ringray's hashing storage layer
  (:class:`~ringray.train.checksums.ChecksummingFileSystem`): the cost of hashing while writing;
- load, plain: ``dcp.load`` of those files;
- load, verified: every file hashed and compared with its checksum first (what
  :meth:`CheckpointStore.load` adds), then ``dcp.load``.

The files were just written, so reads come from the page cache: the load figures are the
checksum's CPU cost plus one extra pass over memory, not a disk's read speed (from a cold disk
or an object store, verifying reads each file once more before DCP reads it). A first round
is a warm-up, not counted. Prints the median seconds per GB of each, the overhead, and
CRC-32C alone over the same bytes in memory (the floor of the cost, free of disk noise).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import crc32c
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ringray.train.checksums import ChecksummingFileSystem, FileChecksum, file_checksum

_TENSOR_BYTES = 64 << 20


def _state(total_bytes: int) -> dict[str, torch.Tensor]:
    count = max(1, total_bytes // _TENSOR_BYTES)
    generator = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(_TENSOR_BYTES // 4, generator=generator) for i in range(count)}


class _Clock:
    """Wall seconds and this process's CPU seconds (steadier on a shared machine)."""

    def __enter__(self) -> _Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def _save(state: dict, directory: Path, *, checksummed: bool) -> tuple[_Clock, dict]:
    writer = FileSystemWriter(directory)
    if checksummed:
        writer.fs = ChecksummingFileSystem(writer.fs)
    with _Clock() as clock:
        dcp.save(state, storage_writer=writer)
    return clock, (writer.fs.written if checksummed else {})


def _load(state: dict, directory: Path, checksums: dict[str, FileChecksum] | None) -> _Clock:
    with _Clock() as clock:
        if checksums is not None:
            for name, want in sorted(checksums.items()):
                with open(directory / name, "rb") as f:
                    if file_checksum(f) != want:
                        raise SystemExit(f"{directory / name}: checksum mismatch")
        dcp.load(state, storage_reader=FileSystemReader(directory))
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the state, in GB (1e9 B)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a new temp dir)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)

    state = _state(int(args.gb * 1e9))
    gigabytes = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    target = {name: torch.empty_like(t) for name, t in state.items()}
    root = Path(tempfile.mkdtemp(prefix="ckpt-crc-", dir=args.dir))
    kinds = ("save", "save+crc", "load", "load+crc")
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for round_index in range(args.rounds + 1):  # round 0: the warm-up
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for checksummed in order:
                directory = root / f"r{round_index}-{int(checksummed)}"
                saved, written = _save(state, directory, checksummed=checksummed)
                loaded = _load(target, directory, written if checksummed else None)
                suffix = "+crc" if checksummed else ""
                for what, clock in (("save", saved), ("load", loaded)):
                    if round_index:
                        wall[what + suffix].append(clock.wall / gigabytes)
                        cpu[what + suffix].append(clock.cpu / gigabytes)
                for name, tensor in state.items():  # the load read what was written
                    torch.testing.assert_close(target[name], tensor, rtol=0, atol=0)
                shutil.rmtree(directory)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    start = time.perf_counter()
    for tensor in state.values():
        crc32c.crc32c(tensor.numpy().data)
    hash_only = (time.perf_counter() - start) / gigabytes

    load_average = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{gigabytes:.2f} GB in {len(state)} tensors, {args.rounds} rounds, medians; "
          f"{os.cpu_count()} cores, load average {load_average}")
    print("| | seconds | plain s/GB | with crc32c s/GB | overhead s/GB | overhead |")
    print("|---|---|---|---|---|---|")
    for what in ("save", "load"):
        for clock, times in (("wall", wall), ("CPU", cpu)):
            plain = statistics.median(times[what])
            checked = statistics.median(times[f"{what}+crc"])
            print(f"| {what} | {clock} | {plain:.3f} | {checked:.3f} | {checked - plain:+.3f} | "
                  f"{(checked / plain - 1):+.0%} |")
    print(f"crc32c alone, in memory: {hash_only:.3f} s/GB ({1 / hash_only:.1f} GB/s)")
    for clock, times in (("wall", wall), ("CPU", cpu)):
        print(f"every round, {clock} s/GB: " + "; ".join(
            f"{k} " + " ".join(f"{x:.3f}" for x in v) for k, v in times.items()))


if __name__ == "__main__":
    main()
