"""A KV cache for greedy generation over the ring: the prompt once, then one token a step.

    hidden, cache = prefill(model, local_tokens, ring, lengths)   # the ring's forward
    hidden = decode(model, cache, new_tokens)                      # (rows, dim), every rank

**Prefill** is :meth:`Transformer.forward <ringray.model.Transformer.forward>` over this
rank's share of the right-padded prompts (the same embedding, rotary tables, blocks with
their ring pass, and final norm), keeping each layer's rotated K and V of the positions this
rank holds (the layout's local order; global positions ``layout.positions(rank)``) and each
row's prompt length. Nothing moves: each rank keeps its own share.

**Decode** gives the B new tokens (one per row, the same on every rank) to every rank. Row
``b``'s token sits at global position ``len_b + t`` (``t``: tokens generated before it);
every rank runs the per-token work (embedding, q/k/v rotated at those positions: the B
tokens as one sequence of length B, batch 1, so the rotary tables line up), then each row's
query attends to

- this rank's cached prompt K/V of that row, at global positions ``< len_b`` (the padding is
  never read) and within the layer's sliding window, if any;
- the generated tokens' K/V (the *tail*), which every rank computes and holds alike, but
  only rank 0 counts, so that each key is counted once.

Each rank's partial is float32 ``(m, l, o)``: the maximum score, the sum of ``exp(s - m)``
and the unnormalised output. The ring merges them by the log-sum-exp rule (an all-reduce
MAX of ``m``, then one all-reduce SUM of ``w·o`` and ``w·l`` packed together, with
``w = exp(m - M)``: 0 on a rank with no key in range), which is exact attention over the
whole prefix up to float32 rounding. Two small all-reduces per layer and step, and no K or
V ever crosses the ring after the prefill. Then the block's output projection and MLP, and
the final norm; the caller applies the output head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ringray.model import RingContext, Transformer


@dataclass
class KVCache:
    """One rank's cache for a batch of rows (see the module docstring). Keys and values are
    ``(rows, kv_heads, positions, head_dim)``: the prompt's are this rank's layout share,
    the tail's every generated token so far (the same on every rank)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    held: torch.Tensor
    """Global positions of the cached prompt K/V, ``(local_len,)``, on the cache's device."""
    lengths: torch.Tensor
    """Each row's prompt length, ``(rows,)``, on the cache's device."""
    windows: list[int | None]
    """Each layer's sliding window (None: full causal attention)."""
    ranks: int
    """Ranks in the ring (1: no collectives)."""
    group: dist.ProcessGroup | None
    """The ring's group (None: the default group)."""
    counts_tail: bool
    """Whether this rank's partials include the tail (rank 0 only)."""
    tail_keys: list[torch.Tensor | None] = field(default_factory=list)
    tail_values: list[torch.Tensor | None] = field(default_factory=list)
    generated: int = 0
    """Tokens decoded so far (the tail's length)."""

    def __post_init__(self) -> None:
        if not self.tail_keys:
            self.tail_keys = [None] * len(self.keys)
            self.tail_values = [None] * len(self.keys)

    @property
    def rows(self) -> int:
        return int(self.lengths.numel())

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K and V ``(rows, kv_heads, head_dim)`` onto layer ``layer``'s tail."""
        k, v = k[:, :, None], v[:, :, None]
        if self.tail_keys[layer] is None:
            self.tail_keys[layer], self.tail_values[layer] = k, v
        else:
            self.tail_keys[layer] = torch.cat((self.tail_keys[layer], k), dim=2)
            self.tail_values[layer] = torch.cat((self.tail_values[layer], v), dim=2)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``(batch, seq, heads, head_dim)`` as ``(batch, heads, seq, head_dim)``, contiguous."""
    return x.transpose(1, 2).contiguous()


def prefill(model: Transformer, tokens: torch.Tensor, ring: RingContext,
            lengths: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
    """The final norm's output for this rank's share ``tokens`` ``(rows, local_len)`` of the
    right-padded prompts (what ``Transformer.forward`` computes before its output layer),
    and the cache of its K/V. ``lengths`` ``(rows,)``: each row's prompt length."""
    cos, sin = model.rotary(ring.positions(tokens.device))
    x = model.tok_embeddings(tokens)
    keys, values = [], []
    for block in model.layers:
        q, k, v = block._before_ring(x, cos, sin)
        keys.append(_heads_first(k))
        values.append(_heads_first(v))
        x = block._after_ring(x, block.attention.ring_pass(q, k, v, ring))
    cache = KVCache(
        keys=keys, values=values,
        held=ring.layout.positions(ring.rank).to(tokens.device),
        lengths=lengths.to(tokens.device),
        windows=[block.attention.window for block in model.layers],
        ranks=ring.layout.world_size, group=ring.group, counts_tail=ring.rank == 0)
    return model.norm(x), cache


def decode(model: Transformer, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
    """The final norm's output ``(rows, dim)`` at the new tokens ``tokens`` ``(rows,)``, one
    per row at position ``length + generated``; their K/V join the cache's tail. A
    collective over the cache's group: every rank calls it with the same tokens."""
    device = cache.lengths.device
    positions = cache.lengths + cache.generated
    cos, sin = model.rotary(positions)
    x = model.tok_embeddings(tokens.to(device))[None]  # one sequence of the rows' tokens
    for layer, block in enumerate(model.layers):
        q, k, v = block._before_ring(x, cos, sin)  # (1, rows, heads, head_dim)
        cache.append(layer, k[0], v[0])
        with torch.autocast(device.type, enabled=False):  # the partials stay float32
            out = _attend(q[0], cache, layer, positions)
        x = block._after_ring(x, out[None].to(q.dtype))
    cache.generated += 1
    return model.norm(x)[0]


def _attend(q: torch.Tensor, cache: KVCache, layer: int,
            positions: torch.Tensor) -> torch.Tensor:
    """Each row's query ``(rows, heads, head_dim)`` against the whole ring's keys of that
    row (this rank's prompt share, the tail on rank 0, merged over the ring), float32."""
    rows, heads, head_dim = q.shape
    keys, values = cache.keys[layer], cache.values[layer]
    kv_heads = keys.shape[1]
    # Query head h reads kv head h // (heads / kv_heads): group the query heads by it.
    query = q.float().view(rows, kv_heads, heads // kv_heads, head_dim) * head_dim ** -0.5
    window = cache.windows[layer]

    held = cache.held[None, :]
    visible = held < cache.lengths[:, None]  # (rows, local_len): no padding
    if window is not None:
        visible &= positions[:, None] - held <= window - 1
    scores = [_masked(query @ keys.float().transpose(-1, -2), visible)]
    parts = [values]
    if cache.counts_tail:
        # Tail token j sits at length + j: all are causal, the window may cut the first.
        back = cache.generated - torch.arange(cache.generated + 1, device=q.device)
        seen = back >= 0 if window is None else back <= window - 1
        seen = seen[None, :].expand(rows, -1)
        scores.append(_masked(query @ cache.tail_keys[layer].float().transpose(-1, -2), seen))
        parts.append(cache.tail_values[layer])
    score = torch.cat(scores, dim=-1)  # (rows, kv_heads, group, keys)
    m = score.amax(dim=-1)
    p = torch.exp(score - torch.where(torch.isfinite(m), m, 0.0)[..., None])
    total = p.sum(dim=-1)
    out = torch.zeros_like(query)
    start = 0
    for value in parts:
        width = value.shape[2]
        out += p[..., start:start + width] @ value.float()
        start += width

    if cache.ranks > 1:
        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=cache.group)
        weight = torch.exp(m - top)  # 0 where this rank has no key in range (m = -inf)
        packed = torch.cat((out * weight[..., None], (total * weight)[..., None]), dim=-1)
        dist.all_reduce(packed, group=cache.group)
        out, total = packed[..., :-1], packed[..., -1]
    return (out / total[..., None]).reshape(rows, heads, head_dim)


def _masked(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``scores`` ``(rows, kv_heads, group, keys)`` with -inf where ``visible`` ``(rows,
    keys)`` is false."""
    return scores.masked_fill(~visible[:, None, None, :], float("-inf"))
