"""The online-softmax merge: combine attention results over disjoint key sets.

If ``(out_a, lse_a)`` is softmax attention of some queries over key set A and
``(out_b, lse_b)`` over a disjoint key set B, then attention over A ∪ B is

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

LSE is the natural log. A query row that saw no key has ``lse = -inf`` and output 0; the merge
keeps such rows at 0 and never produces NaN (``-inf - -inf`` is never evaluated).
Shapes: ``out`` is ``(..., seq, head_dim)`` and ``lse`` is ``(..., seq)``.
"""

from __future__ import annotations

import torch


def _weights(
    lse_a: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merged lse and the two sides' weights (each ``(..., seq, 1)``)."""
    lse = torch.logaddexp(lse_a, lse_b)
    # Where both sides are empty the merged lse is -inf; subtract 0 there instead so that
    # both weights come out exp(-inf) = 0 rather than exp(nan).
    finite_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - finite_lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite_lse).unsqueeze(-1)
    return lse, weight_a, weight_b


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged ``(out, lse)`` in ``lse_a``'s dtype (float32 or float64), out-of-place."""
    acc = lse_a.dtype
    lse, weight_a, weight_b = _weights(lse_a, lse_b.to(acc))
    return out_a.to(acc) * weight_a + out_b.to(acc) * weight_b, lse


def merge_into(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_new: torch.Tensor, lse_new: torch.Tensor
) -> None:
    """Merge ``(out_new, lse_new)`` into float accumulators in place (views are fine).

    Two passes over the output (scale, then fused multiply-add) and no temporaries of its
    size: this runs once per kernel call of every ring step.
    """
    lse, weight_acc, weight_new = _weights(lse_acc, lse_new.to(lse_acc.dtype))
    out_acc.mul_(weight_acc).addcmul_(out_new, weight_new)
    lse_acc.copy_(lse)
