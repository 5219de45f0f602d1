"""A Llama-style decoder whose attention is ring attention.

    model = Transformer(model_preset("debug"))
    ring = RingContext(group=cp_group, layout=layout, rank=cp_rank)
    logits = model(tokens_local, ring)          # (batch, local_seq, vocab)
    logits = model(tokens)                      # one process, the whole sequence
    loss_sum = model(tokens_local, ring, labels=labels_local)   # no full logits

Each rank holds its share of every sequence in the layout's local order. Everything but
attention is per token, so it runs locally; rotary embeddings use each token's *global*
position (``layout.positions(rank)``), and attention goes round the ring with
:func:`ringray.attention.ring_attention`. With one rank this is an ordinary decoder, and a
CP=N run computes the same function as a CP=1 run (the exactness contract tested in
``tests/test_train_exact.py``). With Ulysses × ring (``RingContext.ulysses_group``, a grid
layout) the head all-to-alls happen inside ``ring_attention``; the rest of the model still
sees this rank's tokens with all heads (``tests/test_train_ulysses.py``).

Packed documents: a context built with :meth:`RingContext.for_documents` passes the
sequence's document lengths to the ring (attention stays inside each document) and, with
``restart_positions``, rotates each token by its position *within its document*; the ring's
mask still works on global positions (``tests/test_train_documents.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringray.attention import (
    Documents,
    Layout,
    RingAgreement,
    RingStats,
    check_documents,
    make_layout,
    ring_attention,
)
from ringray.attention.backends import BlockAttentionBackend
from ringray.attention.backends.common import upload
from ringray.model.config import ModelConfig
from ringray.model.loss import LOSS_CHUNK_TOKENS, chunked_cross_entropy_sum
from ringray.model.rope import apply_rotary, compute_dtype, rotary_tables

ActivationCheckpointing = Literal["none", "full", "selective"]
"""What a block keeps for its backward: everything (``none``); only its input, recomputing
the whole block, ring pass included (``full``); or its input and what ring attention saves
(q, output, LSE, last K/V block), recomputing the rest but never the ring (``selective``)."""


@dataclass(frozen=True, kw_only=True)
class RingContext:
    """Where this rank's tokens sit in the sequence and which ring to attend over."""

    layout: Layout
    rank: int = 0
    group: dist.ProcessGroup | None = None
    """The ring (with Ulysses: the ranks that share this rank's ulysses index)."""
    ulysses_group: dist.ProcessGroup | None = None
    """The Ulysses group this rank swaps sequence for heads with around the ring (``layout``
    is then a ring × Ulysses grid layout and ``rank`` this rank's index in the grid);
    ``None``: ring only."""
    backend: str | BlockAttentionBackend = "auto"
    """A backend's name, or one resolved backend for every call (``auto``'s measured
    choices then stay with it: :mod:`ringray.attention.backends.routed`)."""
    stats: RingStats | None = None
    documents: Documents | None = None
    """Document lengths of the global sequence, shared by the batch's rows (passed to
    :func:`ring_attention`); ``None``: one document."""
    rope_positions: torch.Tensor | None = None
    """This rank's RoPE positions, in local order (see :meth:`for_documents`); ``None``: the
    global positions."""
    agreement: RingAgreement | None = field(default=None, compare=False)
    """The ring's agreement on this context's call signatures (a
    :class:`~ringray.attention.RingAgreement` of this rank's own, passed to every layer's
    :func:`ring_attention`): each signature is agreed across ranks once, not per layer and
    step. ``None``: every call agrees."""

    @classmethod
    def for_documents(
        cls, documents: Documents | Sequence[int], *, layout: Layout, rank: int = 0,
        restart_positions: bool, device: torch.device | None = None, **fields: Any,
    ) -> RingContext:
        """A context for sequences packed from ``documents`` (lengths summing to the
        layout's sequence length). With ``restart_positions`` RoPE positions restart at 0 in
        each document, computed here once (on ``device``) for every layer and step that
        reuses the context. ``fields``: the other fields (group, backend, stats, ...)."""
        docs = check_documents(documents, layout.seq_len)
        rope_positions = None
        if restart_positions:
            positions = layout.positions(rank)
            starts = torch.tensor(docs.bounds[:-1])[docs.ids]  # each position's document start
            rope_positions = positions - starts[positions]
            if device is not None:
                rope_positions = upload(rope_positions, device)
        return cls(layout=layout, rank=rank, documents=docs, rope_positions=rope_positions,
                   **fields)

    def positions(self, device: torch.device) -> torch.Tensor:
        """The RoPE positions of this rank's tokens, in local order."""
        if self.rope_positions is not None:
            return self.rope_positions.to(device)
        return _device_positions(self.layout, self.rank, torch.device(device))


@lru_cache(maxsize=16)
def _device_positions(layout: Layout, rank: int, device: torch.device) -> torch.Tensor:
    """A rank's global positions on ``device``, moved once per (layout, rank, device): every
    layer, step and recomputation reuses them (layouts are immutable and memoised)."""
    return upload(layout.positions(rank), device)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x.dtype)
        wide = x.to(dtype)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(dtype)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.layer_window(layer)  # sliding-window attention on this layer
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        # Qwen3: one RMSNorm over head_dim, shared by the heads, before the rotation.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ring: RingContext
    ) -> torch.Tensor:
        return self.project_out(self.ring_pass(*self.project(x, cos, sin), ring))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token work before the ring: q, k, v ``(batch, seq, heads, head_dim)``, rotated."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def ring_pass(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext
    ) -> torch.Tensor:
        """Attention over the whole ring (the only step that communicates); with this
        layer's sliding window, nothing beyond it is computed or sent."""
        return ring_attention(
            q, k, v, ring.group, ulysses_group=ring.ulysses_group, layout=ring.layout,
            causal=True, backend=ring.backend, stats=ring.stats, documents=ring.documents,
            window=self.window, agreement=ring.agreement,
        )

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the heads' results ``(batch, seq, heads, head_dim)``."""
        return self.wo(out.flatten(2))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=cfg.mlp_bias)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A pre-norm decoder block. With ``recompute_around_ring`` (selective activation
    checkpointing) the work before the ring pass and the work after it are two checkpointed
    regions, and the ring pass between them is not: its autograd function keeps q, the
    output, the LSE and its last K/V block, so the backward recomputes norms, projections,
    RoPE and the MLP but never goes round the ring again."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.recompute_around_ring = False

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ring: RingContext
    ) -> torch.Tensor:
        if self.recompute_around_ring and torch.is_grad_enabled():
            q, k, v = checkpoint(self._before_ring, x, cos, sin, use_reentrant=False)
            out = self.attention.ring_pass(q, k, v, ring)
            return checkpoint(self._after_ring, x, out, use_reentrant=False)
        q, k, v = self._before_ring(x, cos, sin)
        return self._after_ring(x, self.attention.ring_pass(q, k, v, ring))

    def _before_ring(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attention.project(self.attention_norm(x), cos, sin)

    def _after_ring(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        x = x + self.attention.project_out(out)
        return x + self.feed_forward(self.ffn_norm(x))


def parameter_init(name: str, cfg: ModelConfig) -> tuple[Literal["fill", "normal"], float]:
    """How parameter ``name`` starts: ``("fill", value)`` or ``("normal", std)``. Norm gains
    are 1, biases 0, weights Normal(0, init_std), except that the projections writing into
    the residual stream are scaled by ``1/sqrt(2 n_layers)`` so the stream's variance does
    not grow with depth (GPT-2's rule)."""
    if name.endswith("norm.weight"):
        return "fill", 1.0
    if name.endswith(".bias"):
        return "fill", 0.0
    if name.endswith(("wo.weight", "w2.weight")):
        return "normal", cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return "normal", cfg.init_std


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` pre-norm blocks, final RMSNorm, output projection.

    ``activation_checkpointing`` (:data:`ActivationCheckpointing`): ``"full"`` recomputes
    each block in the backward pass instead of keeping its activations (the recompute
    repeats the block's ring pass, on every rank in the same order, so the ring stays in
    step); ``"selective"`` recomputes everything but the ring pass (see :class:`Block`).
    ``True`` and ``False`` are still read as ``"full"`` and ``"none"``. With
    ``tie_embeddings`` the output projection's weight *is* the embedding table (one
    parameter, registered under both).
    """

    def __init__(self, cfg: ModelConfig, *,
                 activation_checkpointing: ActivationCheckpointing | bool = "none",
                 loss_chunk_tokens: int = LOSS_CHUNK_TOKENS) -> None:
        super().__init__()
        if isinstance(activation_checkpointing, bool):
            activation_checkpointing = "full" if activation_checkpointing else "none"
        if activation_checkpointing not in get_args(ActivationCheckpointing):
            raise ValueError(f"activation_checkpointing: {activation_checkpointing!r} is not "
                             f"one of {', '.join(map(repr, get_args(ActivationCheckpointing)))}")
        self.config = cfg
        self.activation_checkpointing: ActivationCheckpointing = activation_checkpointing
        self.loss_chunk_tokens = loss_chunk_tokens  # tokens per chunk of forward(labels=...)
        # The Hugging Face checkpoint the weights came from, set by load_pretrained;
        # save_pretrained copies its tokenizer and keeps the rest of its config.json.
        self.pretrained_source: str | None = None
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        for block in self.layers:
            block.recompute_around_ring = activation_checkpointing == "selective"
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Make the output projection share the embedding table when the config ties them
        (again after anything that replaces parameters, such as ``to_empty``)."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter as :func:`parameter_init` says, drawn from torch's global RNG
        (a trainer fills its shards with a sharding-independent stream instead:
        :mod:`ringray.train.materialize`)."""
        for name, param in self.named_parameters():
            kind, value = parameter_init(name, self.config)
            if kind == "fill":
                param.fill_(value)
            else:
                param.normal_(0.0, value)

    def forward(self, tokens: torch.Tensor, ring: RingContext | None = None, *,
                labels: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
        """Logits ``(batch, local_seq, vocab)`` for this rank's tokens ``(batch, local_seq)``.

        Without ``ring`` the whole sequence is in this one process (a one-rank contiguous
        layout): ``model(tokens)`` is an ordinary decoder call.

        With ``labels`` (the next tokens, shaped like ``tokens``; ``ignore_index`` for those
        that do not count) it returns their cross-entropy *sum* instead, from
        :func:`~ringray.model.loss.chunked_cross_entropy_sum` over ``loss_chunk_tokens``
        tokens at a time, so the full logits never exist. It is computed here, in the
        forward, so that FSDP has the output weight gathered.
        """
        if ring is None:
            ring = self._single_process_ring(tokens)
        if tokens.shape[1] != ring.layout.local_len:
            raise ValueError(
                f"tokens: this rank holds {ring.layout.local_len} tokens per sequence under "
                f"{ring.layout!r}, got a tensor of shape {tuple(tokens.shape)}"
            )
        cos, sin = self.rotary(ring.positions(tokens.device))
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            if self.activation_checkpointing == "full" and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, ring, use_reentrant=False)
            else:
                x = block(x, cos, sin, ring)
        hidden = self.norm(x)
        if labels is None:
            return self.output(hidden)
        return chunked_cross_entropy_sum(hidden, self.output.weight, labels,
                                         chunk_tokens=self.loss_chunk_tokens,
                                         ignore_index=ignore_index)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables (cos, sin) ``(seq, head_dim)`` of these global positions, as
        every forward makes them (the config's theta and scaling, in the embedding's
        compute dtype)."""
        cfg = self.config
        return rotary_tables(positions, cfg.head_dim, cfg.rope_theta,
                             compute_dtype(self.tok_embeddings.weight.dtype),
                             scaling=cfg.rope_scaling)

    @staticmethod
    def _single_process_ring(tokens: torch.Tensor) -> RingContext:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # ring_attention's default group is the world; it cannot stand for "no ring".
            raise ValueError(
                f"ring: torch.distributed is initialised with {dist.get_world_size()} ranks, "
                f"so model(tokens) cannot tell which ring to use; pass a RingContext (for one "
                f"process: a group of one rank)"
            )
        return RingContext(layout=make_layout("contiguous", 1, tokens.shape[1]))
