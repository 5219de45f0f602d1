"""Sequence layouts: which global tokens each rank of a ring holds, and in what order.

A layout is data. It maps every global token index to a (rank, local index) pair, and that
is all the ring needs: the causal rule is applied to global positions (``q_pos >= k_pos``),
so any layout is exact by construction and layouts differ only in how evenly they spread the
causal work.

    >>> lay = make_layout("zigzag", world_size=4, seq_len=16)
    >>> lay.positions(0).tolist()
    [0, 1, 14, 15]
    >>> x_local = lay.shard(x_global, rank=0)          # (batch, 4, ...) from (batch, 16, ...)
    >>> x_global = lay.unshard([lay.shard(x_global, r) for r in range(4)])

Built in: ``contiguous`` (rank r holds one slice), ``zigzag`` (2N chunks, rank r holds
chunks r and 2N-1-r, as in ring-flash-attn, Megatron and TransformerEngine), ``striped``
(token t on rank t mod N, as in the Striped Attention paper), and any explicit permutation
given as one position list per rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

BUILTIN_LAYOUTS = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class Run:
    """An arithmetic run of global positions stored at consecutive local indices.

    Local indices ``local_start .. local_start + length - 1`` hold global positions
    ``global_start + i * stride``. Runs let the step planner reason about whole blocks
    instead of single tokens.
    """

    local_start: int
    global_start: int
    stride: int
    length: int

    @property
    def global_last(self) -> int:
        return self.global_start + (self.length - 1) * self.stride


# A custom layout whose ranks break into more runs than this is planned as one irregular
# block per rank (one position-masked kernel call per ring step) instead of run by run.
MAX_RUNS_PER_RANK = 8


class Layout:
    """How a sequence of ``seq_len`` tokens is spread over ``world_size`` ranks.

    Immutable once built; construct with :func:`make_layout`. ``positions(rank)[i]`` is the
    global index of the token at local index ``i`` on ``rank``.
    """

    def __init__(
        self,
        kind: str,
        world_size: int,
        seq_len: int,
        rank_positions: torch.Tensor,
        rank_runs: tuple[tuple[Run, ...], ...] | None = None,
    ):
        self.kind = kind
        self.world_size = world_size
        self.seq_len = seq_len
        self._positions = rank_positions  # (world_size, local_len) int64, read-only by contract
        # Built-in layouts state their runs; a custom permutation's are found greedily.
        self._given_runs = rank_runs

    def __repr__(self) -> str:
        return f"Layout({self.kind!r}, world_size={self.world_size}, seq_len={self.seq_len})"

    @property
    def local_len(self) -> int:
        """Tokens per rank."""
        return self.seq_len // self.world_size

    @property
    def divisor(self) -> int:
        """What a sequence length must be a multiple of for this kind of layout over this
        many ranks (a custom permutation fits exactly its own length)."""
        if self.kind in BUILTIN_LAYOUTS:
            return seq_len_divisor(self.kind, self.world_size)
        return self.seq_len

    def positions(self, rank: int) -> torch.Tensor:
        """Global token indices held by ``rank``, in local order (int64, CPU)."""
        return self._positions[rank]

    def runs(self, rank: int) -> tuple[Run, ...]:
        """``rank``'s positions as maximal arithmetic runs of positive stride."""
        return self._runs[rank]

    def is_regular(self, rank: int) -> bool:
        """True when the planner can split this rank's blocks into fused-kernel pieces."""
        return len(self._runs[rank]) <= MAX_RUNS_PER_RANK

    @cached_property
    def _runs(self) -> tuple[tuple[Run, ...], ...]:
        if self._given_runs is not None:
            return self._given_runs
        return tuple(_split_runs(self._positions[r].tolist()) for r in range(self.world_size))

    @cached_property
    def fingerprint(self) -> int:
        """A 31-bit checksum of the layout, used to check that all ranks agree on it."""
        digest = zlib.crc32(f"{self.kind}:{self.world_size}:{self.seq_len}".encode())
        digest = zlib.crc32(self._positions.numpy().tobytes(), digest)
        return digest & 0x7FFFFFFF

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """The part of global tensor ``x`` that ``rank`` holds, in local order."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"shard: x.shape[{dim}] is {x.shape[dim]} but the layout covers "
                f"seq_len={self.seq_len}"
            )
        return x.index_select(dim, self._positions[rank].to(x.device))

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Reassemble the global tensor from every rank's shard (inverse of :meth:`shard`)."""
        if len(shards) != self.world_size:
            raise ValueError(
                f"unshard: got {len(shards)} shards for a layout of world_size={self.world_size}"
            )
        first = shards[0]
        shape = list(first.shape)
        shape[dim] = self.seq_len
        out = first.new_empty(shape)
        for rank, part in enumerate(shards):
            if part.shape[dim] != self.local_len:
                raise ValueError(
                    f"unshard: shard {rank} has {part.shape[dim]} tokens along dim {dim}, "
                    f"expected local_len={self.local_len}"
                )
            out.index_copy_(dim, self._positions[rank].to(part.device), part)
        return out


def seq_len_divisor(kind: str, world_size: int) -> int:
    """What the global sequence length of a built-in layout must be a multiple of."""
    if kind == "zigzag":
        return 2 * world_size
    if kind in ("contiguous", "striped"):
        return world_size
    raise ValueError(f"layout: unknown kind {kind!r}; valid: {', '.join(BUILTIN_LAYOUTS)}")


def make_layout(
    kind_or_positions: str | Layout | Sequence[Sequence[int]],
    world_size: int,
    seq_len: int,
) -> Layout:
    """Build (or check) the layout of ``seq_len`` tokens over ``world_size`` ranks.

    ``kind_or_positions`` is a built-in name, an existing :class:`Layout` (checked against
    ``world_size`` and ``seq_len``), or one list of global positions per rank, which must
    together be a permutation of ``range(seq_len)`` with equal lengths.
    """
    if world_size < 1:
        raise ValueError(f"layout: world_size must be >= 1, got {world_size}")
    if isinstance(kind_or_positions, Layout):
        lay = kind_or_positions
        if lay.world_size != world_size or lay.seq_len != seq_len:
            raise ValueError(
                f"layout: got a layout for world_size={lay.world_size}, seq_len={lay.seq_len} "
                f"but the call needs world_size={world_size}, seq_len={seq_len}"
            )
        return lay
    if isinstance(kind_or_positions, str):
        return _builtin(kind_or_positions, world_size, seq_len)
    return _custom(kind_or_positions, world_size, seq_len)


# Memoised so that repeated calls with a layout name share one Layout, and with it the
# ring's cached step plans; layouts are immutable, so sharing is safe.
@lru_cache(maxsize=16)
def _builtin(kind: str, world_size: int, seq_len: int) -> Layout:
    divisor = seq_len_divisor(kind, world_size)
    if seq_len <= 0 or seq_len % divisor:
        raise ValueError(
            f"layout: seq_len={seq_len} cannot be split by layout {kind!r} over "
            f"{world_size} ranks; it must be a positive multiple of {divisor}"
        )
    n, local = world_size, seq_len // world_size
    if kind == "contiguous":
        pos = torch.arange(seq_len).view(n, local)
        runs = tuple((Run(0, r * local, 1, local),) for r in range(n))
    elif kind == "striped":
        pos = torch.arange(seq_len).view(local, n).t().contiguous()
        runs = tuple((Run(0, r, n, local),) for r in range(n))
    else:  # zigzag: chunk r and chunk 2N-1-r
        half = local // 2
        chunks = torch.arange(seq_len).view(2 * n, half)
        pos = torch.cat([chunks[:n], chunks[n:].flip(0)], dim=1)
        runs = tuple(
            (Run(0, r * half, 1, half), Run(half, (2 * n - 1 - r) * half, 1, half))
            for r in range(n)
        )
    return Layout(kind, world_size, seq_len, pos, runs)


def _custom(rank_positions: Sequence[Sequence[int]], world_size: int, seq_len: int) -> Layout:
    if len(rank_positions) != world_size:
        raise ValueError(
            f"layout: got position lists for {len(rank_positions)} ranks, "
            f"expected world_size={world_size}"
        )
    lengths = {len(p) for p in rank_positions}
    if len(lengths) != 1:
        raise ValueError(f"layout: every rank must hold the same number of tokens, got {lengths}")
    pos = torch.tensor([list(p) for p in rank_positions], dtype=torch.int64)
    if pos.numel() != seq_len or not torch.equal(pos.flatten().sort().values,
                                                   torch.arange(seq_len)):
        raise ValueError(
            f"layout: the per-rank position lists must together be a permutation of "
            f"range({seq_len}) (each token on exactly one rank)"
        )
    return Layout("custom", world_size, seq_len, pos)


def _split_runs(positions: list[int]) -> tuple[Run, ...]:
    """Greedy split into maximal arithmetic runs of positive stride."""
    runs: list[Run] = []
    i = 0
    while i < len(positions):
        start = positions[i]
        if i + 1 < len(positions) and positions[i + 1] > start:
            stride = positions[i + 1] - start
            j = i + 1
            while j + 1 < len(positions) and positions[j + 1] - positions[j] == stride:
                j += 1
        else:
            stride, j = 1, i
        runs.append(Run(local_start=i, global_start=start, stride=stride, length=j - i + 1))
        i = j + 1
    return tuple(runs)


def causal_work(layout: Layout) -> list[int]:
    """Query-key pairs each rank computes under the causal mask (its queries' visible keys).

    The token at global position p attends to p + 1 keys, so a rank's work is the sum of
    (p + 1) over its positions. ``max / mean`` of this list is the layout's theoretical
    load imbalance.
    """
    return [int((layout.positions(r) + 1).sum()) for r in range(layout.world_size)]
