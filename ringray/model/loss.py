"""Cross-entropy from the last hidden states, a chunk of tokens at a time, never the whole
logits tensor.

    loss_sum = chunked_cross_entropy_sum(hidden, output_weight, labels, chunk_tokens=4096)

The logits of a long-context step are its largest tensor: 32k tokens against a 128k
vocabulary are 17 GB in float32, and their gradient as much again. Here the tokens are cut
into chunks of ``chunk_tokens``; each chunk's logits (``hidden @ weight.T``, in the dtype the
matmul runs in, e.g. bf16 under autocast, then float32, as the full computation does) and
their cross-entropy sum are computed inside a non-reentrant
:func:`torch.utils.checkpoint.checkpoint`, so the forward keeps only the chunk's hidden
states, and the backward rebuilds one chunk's logits at a time. Memory is about
``chunk_tokens × vocab``, whatever the sequence length.

The loss and the gradients (of the hidden states and of the weight) are those of
``F.cross_entropy(logits.float(), labels, reduction="sum")`` on the full logits, up to float
summation order: ``tests/test_loss.py`` compares both, with ignored labels and a chunk size
that does not divide the tokens, at 1e-6.

:meth:`ringray.model.llama.Transformer.forward` calls it when given labels: inside the
model's forward, so that FSDP has gathered the output weight (and keeps it gathered for the
backward's recomputation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_CHUNK_TOKENS = 4096
"""Tokens per chunk of the cross-entropy. A chunk's backward holds three float32 tensors of its
logits' size (the log-softmax and two gradients: 12 bytes a logit,
:func:`ringray.train.footprint.loss_chunk_bytes`): 6 GiB for 4096 tokens of a 128k
vocabulary, against 17 GB for the logits alone of 32k tokens at once. Smaller chunks mean
more, shorter matmuls."""


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
    chunk_tokens: int = LOSS_CHUNK_TOKENS, ignore_index: int = -100,
) -> torch.Tensor:
    """The cross-entropy *sum* over the counted labels (``ignore_index`` left out) of the
    logits ``hidden @ weight.T``, computed ``chunk_tokens`` tokens at a time.

    Args:
        hidden: ``(..., dim)`` final hidden states (any leading shape).
        weight: ``(vocab, dim)`` output projection.
        labels: the target ids, shaped like ``hidden`` without its last dimension.
        chunk_tokens: tokens per chunk (the last chunk may be shorter).
        ignore_index: the label of tokens that do not count.

    Returns:
        A float32 scalar. With gradients enabled each chunk is checkpointed (its logits are
        recomputed in the backward, not kept).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: {chunk_tokens} must be >= 1")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels: shape {tuple(labels.shape)} does not match the hidden "
                         f"states' {tuple(hidden.shape[:-1])} tokens")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # the cast the output projection would make anyway, made once: the checkpoints then
        # keep the bf16 hidden states, not the float32 ones
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    recompute = torch.is_grad_enabled()
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    # split, not slicing: one backward node hands each chunk its part of one gradient
    for part, part_labels in zip(flat_hidden.split(chunk_tokens),
                                 flat_labels.split(chunk_tokens), strict=True):
        if recompute:
            total = total + checkpoint(_chunk_loss_sum, part, weight, part_labels, ignore_index,
                                       use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(part, weight, part_labels, ignore_index)
    return total
