"""What one rank of this trainer holds in memory during a step, term by term (pure
arithmetic: no devices, no tensors). ``ringray plan`` (:mod:`ringray.capacity`) puts it
against a device's memory; ``ringray bench memory`` against what a step really allocates.

    footprint = rank_footprint(cfg, local_tokens=16384 * 8, cp=8, shards=8, bf16=True,
                               checkpointing="selective")
    footprint.peak_bytes, footprint.peak_moment

The accounting follows what :mod:`ringray.train.trainer` allocates:

- **Weights, gradients, optimizer.** The trainer keeps float32 weights and float32 gradients,
  and ``torch.optim.AdamW`` two float32 moments: 4 + 4 + 8 bytes per parameter.
  Replicated (``parallel.fsdp: false``), every device holds all of them; with bf16
  (``precision: bf16``, or ``auto`` on a GPU) it autocasts: every weight matrix that a
  matmul uses gets a bf16 copy, cached by autocast and saved for the backward, so +2 bytes
  per matmul parameter. With FSDP all 16 bytes are divided by dp × cp (the flattened mesh
  they are sharded over), and :func:`gathered_bytes` counts the full weights and gradients
  that exist for a moment: the root's (embedding, output) for the whole step, and about
  two blocks' (the one computing and the one prefetched) with one block's gradients and
  their float32 reduce-scatter buffer.
- **Activations**: :func:`layer_activation_bytes_per_token` and
  :func:`head_activation_bytes_per_token` (the formula, and where each term comes from);
  what each activation checkpointing mode keeps (:func:`kept_activation_bytes_per_token`)
  and recomputes (:func:`recompute_bytes_per_token`).
- **The loss** (:mod:`ringray.model.loss`): no logits are kept; the backward rebuilds one
  chunk of ``LOSS_CHUNK_TOKENS`` tokens' logits at a time, :func:`loss_chunk_bytes`.
- **Ring buffers**: :func:`ring_buffer_bytes_per_token` (counted from
  :mod:`ringray.attention.ring`).
- **Ulysses × ring** (``ulysses`` U > 1, :mod:`ringray.attention.ulysses`): the ring runs over
  cp / U ranks, each holding its member's chunk (U times its own tokens) for 1/U of the heads,
  so per local token its q, output, LSE and K/V block are the same bytes, except that K/V
  heads repeated onto U > kv_heads ranks count ``r = U / kv_heads`` times. The all-to-all
  hands attention's output back as a new tensor (the output projection's input), one more
  ``ahe`` per token; and the backward's all-to-all of dq/dk/dv holds four copies of them at
  once (its input, send and receive buffers, and its output).
- **Step transients** (:func:`step_transient_bytes`). After the backward (when the
  activations are freed) AdamW's foreach update (CUDA) allocates a float32 temporary the size
  of the (local) parameters, its per-tensor update (CPU) about two of the largest parameter,
  and a replicated group's gradient all-reduce a flat float32 buffer of every gradient first
  (4 bytes per local parameter, when the group has more than one rank). The replica groups'
  average runs in 25 MiB buckets and adds nothing.
- **The peak** (:class:`Footprint`): gradients fill in as the backward frees activations,
  so the peak is the weights and AdamW state plus the largest of the backward's start
  (every activation, the first gradients, and the loss chunk's or a block's working set),
  its end (every gradient, one block's activations) and the optimizer step (every
  gradient, the step transient).

``tests/test_capacity.py`` checks the activation terms against what autograd saves and the
allocator holds; ``tests/test_bench_memory.py`` the peak against measured steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringray.attention.ulysses import check_ulysses_heads
from ringray.model import ModelConfig
from ringray.model.llama import ActivationCheckpointing as Checkpointing
from ringray.model.loss import LOSS_CHUNK_TOKENS


def kv_repeat(cfg: ModelConfig, ulysses: int) -> int:
    """How many copies of each K/V head a Ulysses group of ``ulysses`` ranks makes: 1 when
    the kv heads split over it, ``ulysses / kv_heads`` when they do not (``ValueError``
    when neither works)."""
    return check_ulysses_heads(cfg.n_heads, cfg.n_kv_heads, ulysses) if ulysses > 1 else 1


def _block_terms(cfg: ModelConfig, *, bf16: bool, bf16_weights: bool = False,
                 ulysses: int = 1, ring: int = 1) -> tuple[int, int, int]:
    """(before the ring, the ring's, after the ring): the bytes per token that one block
    saves for its backward in each of its three parts (see
    :func:`layer_activation_bytes_per_token`), on a ring of ``ring`` ranks."""
    d, h, k, e, f = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
    a = 2 if bf16 else 4
    norm = 4 * d + 4 * d + 4
    if bf16_weights:  # one bf16 norm output, shared by the projections
        qkv_in, w13_in = a * d, a * d
    else:
        qkv_in, w13_in = (3 * a * d, 2 * a * d) if bf16 else (4 * d, 4 * d)
    kv_blocks = 2 if ring > 1 else 1  # its own block, and on a ring the last one received
    attention = 2 * a * h * e + 4 * h + kv_blocks * 2 * a * k * kv_repeat(cfg, ulysses) * e
    if ulysses > 1:  # the output back in sequence order: a new tensor, the o projection's input
        attention += a * h * e
    return norm + qkv_in, attention, norm + w13_in + 4 * a * f


def layer_activation_bytes_per_token(cfg: ModelConfig, *, bf16: bool,
                                     bf16_weights: bool = False, ulysses: int = 1,
                                     ring: int = 1) -> int:
    """Bytes one decoder block saves for its backward, per token (``d`` = dim, ``h``/``k`` =
    query/kv heads, ``e`` = head_dim, ``f`` = ffn_hidden, ``a`` = 2 with bf16, 4 in fp32).
    The residual stream is float32 (float32 weights; bf16 outputs add into it), or bf16 with
    FSDP's bf16 weights (``bf16_weights``)::

        norms      2 x (4d + 4d + 4)   each RMSNorm saves its float32 input (a float32 copy
                                       of a bf16 one), its normalised output (for the gain's
                                       gradient) and 1/rms per token
        q/k/v in   3ad (bf16) | 4d     autocast casts the norm output once per projection
                   | ad (bf16 weights) and each matmul saves its own bf16 copy; in fp32, or
                                       with bf16 weights, the three share one tensor
        w1/w3 in   2ad | 4d | ad       the same for the two SwiGLU input projections
        attention  2ahe + 4h + 2ake b  ring attention saves q and its output (the o
                                       projection's input is that same tensor), the float32
                                       LSE per query head, and b K/V blocks: its own (a
                                       stacked copy, the one it sends), and on a ring of
                                       more than one rank (``ring``) also the last one it
                                       received, b = 2 (an upper bound: a documents call
                                       that reads no other block saves one); with Ulysses
                                       (U > 1) a K/V block is 2aker (r: the K/V repeat,
                                       :func:`kv_repeat`) and the o projection's input is
                                       the all-to-all's own output, + ahe
        SwiGLU     4af                 w1 out (SiLU's input), SiLU out, w3 out, and their
                                       product (w2's input)

    Rotary embeddings save only the shared cos/sin tables (the head's term): a product with
    a constant keeps the constant, not the activation. ``tests/test_capacity.py`` checks
    this count against the tensors autograd actually saves.
    """
    return sum(_block_terms(cfg, bf16=bf16, bf16_weights=bf16_weights, ulysses=ulysses,
                            ring=ring))


def head_activation_bytes_per_token(cfg: ModelConfig, *, bf16: bool) -> int:
    """Bytes outside the blocks, per token::

        final norm   4d + 4d + 4        as in a block
        loss input   ad                 the final norm's output as the output projection
                                        takes it (bf16 under autocast or with bf16
                                        weights), which the loss's checkpoints keep
        rotary       8e                 float32 cos and sin tables, shared by every layer
        tokens       16                 int64 inputs (embedding) and labels (loss)

    No logits: the loss rebuilds them a chunk at a time in the backward
    (:func:`loss_chunk_bytes`).
    """
    d, e = cfg.dim, cfg.head_dim
    a = 2 if bf16 else 4
    return (4 * d + 4 * d + 4) + a * d + 8 * e + 16


LOSS_BYTES_PER_LOGIT = 12
"""What one chunk's backward holds per logit (:mod:`ringray.model.loss`): the float32
log-softmax its recompute saved, the gradient the NLL hands back to it, and the gradient it
hands on to the logits, 4 bytes each. (Under bf16 the logits' bf16 copy and their float32
copy are freed before these three meet, and the bf16 gradient after them.)"""


def loss_chunk_bytes(cfg: ModelConfig, *, local_tokens: int,
                     chunk_tokens: int = LOSS_CHUNK_TOKENS) -> int:
    """The cross-entropy's working set at its peak, in the backward of one chunk of
    ``min(chunk_tokens, local_tokens)`` tokens: ``12 V`` bytes a token
    (:data:`LOSS_BYTES_PER_LOGIT`); ``tests/test_loss.py`` checks it against the allocator."""
    return LOSS_BYTES_PER_LOGIT * cfg.vocab_size * min(chunk_tokens, local_tokens)


def kept_activation_bytes_per_token(cfg: ModelConfig, *, bf16: bool, checkpointing: Checkpointing,
                                    bf16_weights: bool = False, ulysses: int = 1,
                                    ring: int = 1) -> int:
    """What the forward leaves alive for the backward, per local token over the whole model:
    every block's saved tensors (``none``); each block's input only (``full``: float32, or
    bf16 with ``bf16_weights``); each block's input and its ring attention's saved tensors
    (``selective``); plus the head's."""
    per_layer = _layer_kept(cfg, bf16=bf16, checkpointing=checkpointing,
                            bf16_weights=bf16_weights, ulysses=ulysses, ring=ring)
    return cfg.n_layers * per_layer + head_activation_bytes_per_token(cfg, bf16=bf16)


def _layer_kept(cfg: ModelConfig, *, bf16: bool, checkpointing: Checkpointing,
                bf16_weights: bool, ulysses: int = 1, ring: int = 1) -> int:
    """What one block keeps from its forward for its backward, per token."""
    before, saved, after = _block_terms(cfg, bf16=bf16, bf16_weights=bf16_weights,
                                        ulysses=ulysses, ring=ring)
    block_input = (2 if bf16_weights else 4) * cfg.dim
    return {"none": before + saved + after, "full": block_input,
            "selective": block_input + saved}[checkpointing]


def recompute_bytes_per_token(cfg: ModelConfig, *, bf16: bool, checkpointing: Checkpointing,
                              bf16_weights: bool = False, ulysses: int = 1,
                              ring: int = 1) -> int:
    """What the backward rebuilds at one time, per local token: one whole block (``full``),
    the larger of a block's two regions around the ring pass (``selective``: the part after
    it is recomputed and released before the part before it), or nothing (``none``)."""
    before, saved, after = _block_terms(cfg, bf16=bf16, bf16_weights=bf16_weights,
                                        ulysses=ulysses, ring=ring)
    return {"none": 0, "full": before + saved + after,
            "selective": max(before, after)}[checkpointing]


def activation_bytes_per_token(cfg: ModelConfig, *, bf16: bool, checkpointing: Checkpointing,
                               bf16_weights: bool = False, ulysses: int = 1,
                               ring: int = 1) -> int:
    """Activations per local token at their peak (the start of the backward): what the
    forward kept plus what the backward recomputes at once, on a ring of ``ring`` ranks."""
    terms = dict(bf16=bf16, checkpointing=checkpointing, bf16_weights=bf16_weights,
                 ulysses=ulysses, ring=ring)
    return kept_activation_bytes_per_token(cfg, **terms) + recompute_bytes_per_token(cfg, **terms)


def ring_buffer_bytes_per_token(cfg: ModelConfig, *, cp: int, bf16: bool,
                                ulysses: int = 1, cuda: bool = False) -> int:
    """Buffers one ring-attention call allocates beyond what it saves, per local token
    (only one layer's ring runs at a time), counted from :mod:`ringray.attention.ring` and
    measured (``tests/test_ring_buffers_measured.py``); a K/V block is ``2ke`` elements per
    token, and the ring has R = cp / U ranks::

        forward   K/V blocks x n (a)              + out accumulator (float32, 4he)
        backward  K/V blocks x m (a)              + dK/dV sums x s (float32)
                                                  + dq accumulator (float32, 4he)
                                                  + dq, dk, dv cast back (a, when a = 2)

    A reader gets only the rows of a block it reads (:mod:`~ringray.attention.transfers`):
    they arrive in a pool buffer and are placed into a second one, and the rows a rank sends
    are first gathered into a copy of at most a block. So with R >= 2 the forward holds
    n = 3 blocks at most (two pool buffers and the gathered rows; 0 at R = 1). In the
    backward the own block's sum accumulates the others' returns (s = 1 at R = 1); at R = 2
    the one other block is the one the forward saved, so no K/V moves (m = 0), and its
    partial sum and the incoming return make s = 3; from R = 3 a partial is computed while
    the last one goes back (s = 4; a sum's gathered rows replace it), two K/V blocks are in
    the pool and the own block's rows are gathered for a reader (m = 3). These are bounds:
    the gathered rows are a whole block only for a reader that reads every row (then
    nothing is gathered), so a rank's peak is up to one block below. The current block is
    the one saved by the forward (an activation). The larger phase is the figure.

    On CUDA (``cuda``) each step's messages are posted from a side stream that waits only on
    what they carry (:class:`~ringray.attention.comm.CudaStepScheduler`), so a receive may
    land a step ahead of the compute: from R = 3 each pool holds one buffer more (n = 4,
    m = 4, s = 5; at R = 2 no K/V moves in the backward and nothing changes), measured on
    the scheduler's rules with rings of 4 and 8.

    With Ulysses (``ulysses`` U > 1, :mod:`ringray.attention.ulysses`) the ring has cp / U
    ranks and its K/V block per local token is ``2ker`` elements (``r``: :func:`kv_repeat`);
    the forward also holds the caller's q/k/v in sequence order, ``(h + 2k)ea``, while the
    ring runs on their all-to-all'd copies; the backward holds dout in head order (``hea``)
    beside the ring's buffers; and the backward's all-to-all of dq/dk/dv holds its input,
    send and receive buffers and output at once, ``4(h + 2kr)ea``::

        forward   kv_incoming + out accumulator + q/k/v in sequence order
        backward  max(the ring's buffers above + dout in head order,
                      4 x (h + 2kr)ea)
    """
    h, k, e = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    a = 2 if bf16 else 4
    repeat = kv_repeat(cfg, ulysses)
    kv_block = 2 * k * repeat * e
    ring = cp // ulysses
    incoming = 0 if ring == 1 else 3
    received, sums = {1: (0, 1), 2: (0, 3)}.get(ring, (3, 4))
    if cuda and ring >= 3:  # one more buffer per pool: receives may run a step ahead
        incoming, received, sums = incoming + 1, received + 1, sums + 1
    forward = incoming * kv_block * a + 4 * h * e
    backward = received * kv_block * a + sums * kv_block * 4 + 4 * h * e
    if bf16:
        backward += (h * e + kv_block) * a  # the gradients handed back in the inputs' dtype
    if ulysses > 1:
        forward += (h + 2 * k) * e * a
        backward = max(backward + h * e * a, 4 * (h + 2 * k * repeat) * e * a)
    return max(forward, backward)


def _matmul_params(cfg: ModelConfig) -> int:
    """Parameters autocast casts to bf16: every linear layer (not norms, not the embedding)."""
    attn = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    return cfg.n_layers * (attn + 3 * cfg.dim * cfg.ffn_hidden) + cfg.vocab_size * cfg.dim


def gathered_bytes(cfg: ModelConfig, *, bf16: bool) -> int:
    """Full (unsharded) weights and gradients that FSDP materialises at the backward's
    peak, with ``w`` bytes per gathered element (2 with bf16, else 4)::

        root        2w x (embedding, output, final norm)   kept gathered through the whole
                                                            step; its gradients through the
                                                            whole backward
        blocks      (2w + max(w, 4)) x one block           the block computing and the next
                                                            one, prefetched; then the first's
                                                            gradients and, once it is freed,
                                                            their float32 reduce-scatter input
    """
    w = 2 if bf16 else 4
    root, block = _root_and_block_params(cfg)
    return 2 * w * root + (2 * w + max(w, 4)) * block


def _root_and_block_params(cfg: ModelConfig) -> tuple[int, int]:
    """Parameters outside the blocks (embedding, output, final norm), and in one block."""
    root = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2) + cfg.dim
    return root, (cfg.num_params() - root) // cfg.n_layers


@dataclass(frozen=True, kw_only=True)
class Footprint:
    """Bytes on one rank. The forward leaves ``kept_activations``; the backward of a block
    adds its working set, ``backward_working = max(recompute, ring_buffers + what a full
    recompute keeps alive during the ring's backward)`` (a selective recompute's two regions
    are rebuilt before and after the ring's backward, not during it), and before any block
    the loss's backward rebuilds one chunk of logits, ``loss_chunk``. Gradients fill in as
    the backward frees activations, so the peak is ``weights + optimizer`` plus the largest
    of three moments:

    - the backward's start: ``kept_activations + max(backward_working, loss_chunk) +
      gathered + first_gradients`` (the root's and one block's gradients);
    - its end: all ``gradients`` + ``last_block_kept + backward_working + gathered``;
    - the optimizer step: all ``gradients + step_transient``.

    ``gathered`` is FSDP's unsharded weights and gradients (0 when replicated);
    ``activations`` (kept plus one recompute) is what a report shows as the activations."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    kept_activations_bytes: int
    recompute_bytes: int
    ring_buffers_bytes: int
    backward_working_bytes: int
    loss_chunk_bytes: int
    gathered_bytes: int
    step_transient_bytes: int
    first_gradients_bytes: int
    last_block_kept_bytes: int
    peak_bytes: int
    peak_moment: str  # "backward start" | "backward end" | "optimizer step"

    @property
    def static_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes


def largest_param(cfg: ModelConfig) -> int:
    """Elements of the model's largest parameter (the embedding, or a block's matrix)."""
    attn = cfg.dim * cfg.head_dim * max(cfg.n_heads, cfg.n_kv_heads)
    return max(cfg.vocab_size * cfg.dim, cfg.dim * cfg.ffn_hidden, attn)


def step_transient_bytes(cfg: ModelConfig, *, shards: int, ranks: int | None,
                         foreach: bool) -> int:
    """The float32 temporaries of the step after the backward, the largest of:

    - AdamW's update: with ``foreach`` (torch's default on CUDA) one temporary the size of
      the local parameters at once; one tensor at a time otherwise (torch's default on CPU),
      about two of the largest local parameter (measured: 262 MiB beside a 125 MiB
      embedding, benchmarks/replica_memory.py);
    - a replicated group's gradient all-reduce (``ranks`` > 1, or ``None``: not known, so
      counted), which copies every gradient into one flat buffer first.

    Replica groups add nothing here: under FSDP their sum runs in each unit's own reduced
    gradient shards, inside the backward; with replicated weights in buckets of at most
    ``ringray.train.replicas.AVERAGE_BUCKET_BYTES``, two in flight."""
    local_params = math.ceil(cfg.num_params() / shards)
    adamw = 4 * local_params if foreach else 2 * 4 * math.ceil(largest_param(cfg) / shards)
    flat = 4 * local_params if shards == 1 and (ranks is None or ranks > 1) else 0
    return max(adamw, flat)


def rank_footprint(cfg: ModelConfig, *, local_tokens: int, cp: int, shards: int, bf16: bool,
                   checkpointing: Checkpointing, ulysses: int = 1,
                   loss_chunk_tokens: int = LOSS_CHUNK_TOKENS, ranks: int | None = None,
                   foreach: bool = True) -> Footprint:
    """One rank's memory with ``local_tokens`` tokens (its sequences' shares over ``cp``
    ranks, a ring of cp / ``ulysses`` Ulysses groups), weights split ``shards`` ways (dp × cp
    with FSDP, 1 replicated), bf16 compute (autocast when replicated, FSDP's bf16 weights
    when sharded) or float32, the loss computed ``loss_chunk_tokens`` tokens at a time.
    ``ranks`` (dp × cp of one world; ``None``: more than one) and ``foreach`` (AdamW's
    foreach update: CUDA; ``False`` on CPU) size the step's temporaries
    (:func:`step_transient_bytes`); ``foreach`` also stands for CUDA's ring buffers
    (:func:`ring_buffer_bytes_per_token`'s ``cuda``)."""
    sharded = shards > 1
    local_params = math.ceil(cfg.num_params() / shards)
    autocast_copies = 2 * _matmul_params(cfg) if bf16 and not sharded else 0
    weights = 4 * local_params + autocast_copies
    terms = dict(bf16=bf16, checkpointing=checkpointing, bf16_weights=bf16 and sharded,
                 ulysses=ulysses, ring=cp // ulysses)
    kept = local_tokens * kept_activation_bytes_per_token(cfg, **terms)
    recompute = local_tokens * recompute_bytes_per_token(cfg, **terms)
    ring = local_tokens * ring_buffer_bytes_per_token(cfg, cp=cp, bf16=bf16, ulysses=ulysses,
                                                      cuda=foreach)
    before, ring_saved, _ = _block_terms(cfg, bf16=bf16, bf16_weights=terms["bf16_weights"],
                                         ulysses=ulysses, ring=cp // ulysses)
    alongside = local_tokens * (before + ring_saved) if checkpointing == "full" else 0
    working = max(recompute, alongside + ring)
    loss_chunk = loss_chunk_bytes(cfg, local_tokens=local_tokens,
                                  chunk_tokens=loss_chunk_tokens)
    last_block_kept = local_tokens * _layer_kept(cfg, **terms)
    gathered = gathered_bytes(cfg, bf16=bf16) if sharded else 0
    gradients = 4 * local_params
    transient = step_transient_bytes(cfg, shards=shards, ranks=ranks, foreach=foreach)
    first_gradients = 4 * math.ceil(sum(_root_and_block_params(cfg)) / shards)
    moments = {"backward start": first_gradients + kept + max(working, loss_chunk) + gathered,
               "backward end": gradients + last_block_kept + working + gathered,
               "optimizer step": gradients + transient}
    moment = max(moments, key=moments.__getitem__)
    return Footprint(
        weights_bytes=weights, gradients_bytes=gradients, optimizer_bytes=8 * local_params,
        activations_bytes=kept + recompute, kept_activations_bytes=kept,
        recompute_bytes=recompute, ring_buffers_bytes=ring, backward_working_bytes=working,
        loss_chunk_bytes=loss_chunk,
        gathered_bytes=gathered, step_transient_bytes=transient,
        first_gradients_bytes=first_gradients, last_block_kept_bytes=last_block_kept,
        peak_bytes=weights + 8 * local_params + moments[moment], peak_moment=moment,
    )
