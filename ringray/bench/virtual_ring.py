"""A ring of N blocks run one step after another in one process: the GPU check's correctness
test of the compiled kernels, and the kernel benchmark's "virtual ring".

    ring = VirtualRing(make_layout("zigzag", 4, 4000), causal=True, backend=TritonBackend())
    out, lse = ring.forward(q, k, v)        # (B, S, Hq, D) in global token order
    dq, dk, dv = ring.backward(dout)        # the same order, float32

A GPU holds one NCCL rank, so one process stands for the whole ring: each "rank" takes its
layout share of the sequence and attends, block by block, to every rank's K/V, exactly as
:func:`~ringray.attention.ring_attention` would after the transfers. The tensors reach the
backend as the ring hands them over: the queries (and dO, and the output) as transposed
views of ``(batch, local_seq, heads, head_dim)`` rows, so their row stride is
``heads × head_dim``; K and V as the contiguous ``(batch, kv_heads, local_seq, head_dim)``
halves of the ring's stacked K/V buffer. A backend with the fused ring-step capability
(:class:`~ringray.attention.backends.FusedStepBackend`) gets one call per block pair that
its plan does not leave empty; any other backend a call per planned piece, merged by the
log-sum-exp rule. ``every_pair=True`` also visits the block pairs in which no query sees any
key (the plan skips them), to check that a fully masked pair adds nothing.

The backward takes the ring's final output and LSE, as the ring's does: each block pair's
gradients are exact partial sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ringray.attention.backends import BlockAttentionBackend, FusedStepBackend
from ringray.attention.backends.common import BlockPairKey, backend_delta, upload
from ringray.attention.documents import Documents
from ringray.attention.layouts import Layout
from ringray.attention.merge import merge_into
from ringray.attention.pieces import Piece, PieceKind, RankPlan, plan_rank


@dataclass
class VirtualRing:
    """One ring call's blocks on one device. ``window`` (causal only) and ``documents`` as
    in :func:`~ringray.attention.ring_attention`; ``scale`` defaults to ``head_dim**-0.5``."""

    layout: Layout
    causal: bool
    backend: BlockAttentionBackend
    documents: Documents | None = None
    window: int | None = None
    scale: float | None = None
    every_pair: bool = False
    _saved: dict = field(default_factory=dict, repr=False)

    @property
    def ranks(self) -> range:
        return range(self.layout.world_size)

    def _plan(self, rank: int) -> RankPlan:
        return plan_rank(self.layout, rank, self.causal, self.documents, self.window)

    def _sources(self, rank: int) -> list[int]:
        """The K/V blocks rank ``rank`` attends to, in ring order."""
        world, plan = self.layout.world_size, self._plan(rank)
        order = [(rank - step) % world for step in range(world)]
        return order if self.every_pair else [src for src in order if plan.pieces[src]]

    def _tokens(self, rank: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = self.layout.positions(rank)
        doc = None if self.documents is None else self.documents.ids[positions]
        return (upload(positions, device, torch.int32),
                None if doc is None else upload(doc, device, torch.int32))

    def _shards(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.layout.shard(x, rank, dim=1).contiguous() for rank in self.ranks]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: out ``(B, S, Hq, D)`` in q's dtype, lse ``(B, Hq, S)`` float32,
        both in global token order."""
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        self._saved = {"q": [rows.transpose(1, 2) for rows in self._shards(q)],
                       "kv": [torch.stack((k_rows.transpose(1, 2), v_rows.transpose(1, 2)))
                              for k_rows, v_rows in zip(self._shards(k), self._shards(v),
                                                        strict=True)],
                       "tokens": [self._tokens(rank, q.device) for rank in self.ranks],
                       "scale": scale, "dtype": q.dtype}
        self.forward_steps()
        return (self.layout.unshard(self._saved["out"], dim=1),
                self.layout.unshard(self._saved["lse"], dim=2))

    def forward_steps(self) -> None:
        """Every rank's forward over the blocks :meth:`forward` laid out (what a benchmark
        times: the kernels and merges, not the sharding)."""
        saved = self._saved
        outs, lses = [], []
        for rank in self.ranks:
            q_t = saved["q"][rank]
            batch, heads, rows, dim = q_t.shape
            out = torch.zeros(batch, heads, rows, dim, dtype=torch.float32, device=q_t.device)
            lse = torch.full((batch, heads, rows), float("-inf"), device=q_t.device)
            for src in self._sources(rank):
                self._forward_pair(rank, src, q_t, saved["kv"][src], out, lse,
                                   saved["tokens"], saved["scale"])
            outs.append(out.to(saved["dtype"]).transpose(1, 2).contiguous())
            lses.append(lse)
        saved["out"], saved["lse"] = outs, lses

    def _forward_pair(self, rank: int, src: int, q_t: torch.Tensor, kv: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, tokens: list, scale: float
                      ) -> None:
        if isinstance(self.backend, FusedStepBackend):
            (q_pos, q_doc), (k_pos, k_doc) = tokens[rank], tokens[src]
            self.backend.forward_into(
                q_t, kv[0], kv[1], out, lse, causal=self.causal, scale=scale, q_pos=q_pos,
                k_pos=k_pos, q_doc=q_doc, k_doc=k_doc, window=self.window,
                key=BlockPairKey(self.layout, rank, src, self.documents))
            return
        for piece in self._pieces(rank, src):
            rows, keys = slice(piece.q_start, piece.q_end), slice(piece.k_start, piece.k_end)
            part_out, part_lse = self.backend.forward(
                q_t[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], scale=scale,
                **self._mask(piece, rank, src))
            merge_into(out[:, :, rows], lse[:, :, rows], part_out, part_lse)

    def _pieces(self, rank: int, src: int) -> tuple[Piece, ...]:
        pieces = self._plan(rank).pieces[src]
        if pieces or not self.every_pair:
            return pieces
        # The plan leaves a fully masked pair out; visited anyway, it is one masked piece.
        return (Piece(kind=PieceKind.MASKED, q_start=0, q_end=self.layout.local_len,
                      k_start=0, k_end=self.layout.local_len),)

    def _mask(self, piece: Piece, rank: int, src: int) -> dict:
        if piece.kind is not PieceKind.MASKED:
            return {"kind": piece.kind}
        q_pos = self.layout.positions(rank)[piece.q_start:piece.q_end]
        k_pos = self.layout.positions(src)[piece.k_start:piece.k_end]
        mask = {"kind": piece.kind, "q_pos": q_pos, "k_pos": k_pos, "causal": self.causal,
                "window": self.window}
        if self.documents is not None:
            mask.update(q_doc=self.documents.ids[q_pos], k_doc=self.documents.ids[k_pos])
        return mask

    def backward(self, dout: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` float32 in global token order, ``(B, S, H, D)``, for the upstream
        gradient ``dout`` ``(B, S, Hq, D)`` of the last :meth:`forward`."""
        if not self._saved:
            raise RuntimeError("VirtualRing.backward: call forward first")
        self._saved["dout"] = [rows.transpose(1, 2) for rows in self._shards(dout)]
        dqs, dkv = self.backward_steps()
        return (self.layout.unshard([dq.transpose(1, 2) for dq in dqs], dim=1),
                self.layout.unshard([d[0].transpose(1, 2) for d in dkv], dim=1),
                self.layout.unshard([d[1].transpose(1, 2) for d in dkv], dim=1))

    def backward_steps(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every rank's backward for the upstream gradient :meth:`backward` laid out: per rank
        its float32 dQ ``(B, Hq, S, D)`` and per block its dK/dV ``(2, B, Hkv, S, D)``."""
        saved = self._saved
        dkv = [torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
               for kv in saved["kv"]]
        dqs = []
        for rank in self.ranks:
            dout_t, out_t = saved["dout"][rank], saved["out"][rank].transpose(1, 2)
            dq = torch.zeros(saved["q"][rank].shape, dtype=torch.float32, device=dout_t.device)
            delta = (backend_delta(self.backend, dout_t, out_t)
                     if isinstance(self.backend, FusedStepBackend) else None)
            for src in self._sources(rank):
                self._backward_pair(rank, src, dout_t, out_t, delta, dq, dkv[src])
            dqs.append(dq)
        return dqs, dkv

    def _backward_pair(self, rank: int, src: int, dout_t: torch.Tensor, out_t: torch.Tensor,
                       delta: torch.Tensor | None, dq: torch.Tensor, dkv: torch.Tensor
                       ) -> None:
        saved = self._saved
        q_t, kv, lse, scale = saved["q"][rank], saved["kv"][src], saved["lse"][rank], \
            saved["scale"]
        if isinstance(self.backend, FusedStepBackend):
            (q_pos, q_doc), (k_pos, k_doc) = saved["tokens"][rank], saved["tokens"][src]
            self.backend.backward_into(
                dout_t, q_t, kv[0], kv[1], lse, delta, dq, dkv[0], dkv[1],
                causal=self.causal, scale=scale, q_pos=q_pos, k_pos=k_pos, q_doc=q_doc,
                k_doc=k_doc, window=self.window,
                key=BlockPairKey(self.layout, rank, src, self.documents))
            return
        for piece in self._pieces(rank, src):
            rows, keys = slice(piece.q_start, piece.q_end), slice(piece.k_start, piece.k_end)
            grads = self.backend.backward(
                dout_t[:, :, rows], q_t[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                out_t[:, :, rows], lse[:, :, rows], scale=scale,
                **self._mask(piece, rank, src))
            dq[:, :, rows] += grads[0]
            dkv[0][:, :, keys] += grads[1]
            dkv[1][:, :, keys] += grads[2]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, causal: bool,
    documents: Documents | None = None, window: int | None = None,
    scale: float | None = None, dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Attention over the whole sequence by its definition (materialised scores in
    ``dtype``, autograd for the gradients): ``out``, ``lse`` ``(B, Hq, S)``, ``dq``, ``dk``,
    ``dv`` in ``(B, S, H, D)`` order. A query that sees no key has output 0, gradients 0 and
    LSE -inf. Memory: ``B · Hq · S²`` scores in ``dtype``, a few times over."""
    from ringray.attention.backends.common import expand_kv_heads, position_mask

    seq, q_heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    scale = scale if scale is not None else head_dim**-0.5
    leaves = [t.detach().to(dtype).transpose(1, 2).requires_grad_() for t in (q, k, v)]
    q_t, k_t, v_t = leaves
    pos = torch.arange(seq)
    doc = None if documents is None else documents.ids
    allowed = position_mask(pos, pos, q.device, causal=causal, q_doc=doc, k_doc=doc,
                            window=window)
    scores = (q_t @ expand_kv_heads(k_t, q_heads).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    out = probs @ expand_kv_heads(v_t, q_heads)
    out.backward(dout.to(dtype).transpose(1, 2))
    return {"out": out.detach().transpose(1, 2), "lse": lse.detach(),
            **{name: leaf.grad.transpose(1, 2)
               for name, leaf in zip(("dq", "dk", "dv"), leaves, strict=True)}}
