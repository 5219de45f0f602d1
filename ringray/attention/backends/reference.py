"""The ``reference`` backend: materialised scores, explicit masks, float32 or float64.

Slow and memory-hungry (it builds the ``Sq × Sk`` score matrix), exact, and able to express
any position mask. It exists for tests and for irregular layouts on devices where no fused
kernel takes a mask.
"""

from __future__ import annotations

import torch

from ringray.attention.backends.common import (
    accumulation_dtype,
    expand_kv_heads,
    position_mask,
    reduce_kv_heads,
    softmax_delta,
)
from ringray.attention.pieces import PieceKind


class ReferenceBackend:
    name = "reference"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def _probs(self, q, k, kind, scale, masking, lse=None):
        """Scores and either their LSE (forward) or probabilities against a given LSE."""
        acc = accumulation_dtype(q.dtype)
        k_full = expand_kv_heads(k, q.shape[1]).to(acc)
        scores = torch.matmul(q.to(acc), k_full.transpose(-1, -2)) * scale
        allowed = _allowed(kind, q.shape[2], k.shape[2], q.device, **masking)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        return torch.exp(scores - finite.unsqueeze(-1)), lse

    def forward(self, q, k, v, *, kind, scale, q_pos=None, k_pos=None, causal=True,
                q_doc=None, k_doc=None, window=None):
        masking = {"q_pos": q_pos, "k_pos": k_pos, "causal": causal, "q_doc": q_doc,
                   "k_doc": k_doc, "window": window}
        probs, lse = self._probs(q, k, kind, scale, masking)
        v_full = expand_kv_heads(v, q.shape[1]).to(probs.dtype)
        return torch.matmul(probs, v_full), lse

    def backward(self, dout, q, k, v, out, lse, *, kind, scale, q_pos=None, k_pos=None,
                 causal=True, q_doc=None, k_doc=None, window=None):
        acc = accumulation_dtype(q.dtype)
        masking = {"q_pos": q_pos, "k_pos": k_pos, "causal": causal, "q_doc": q_doc,
                   "k_doc": k_doc, "window": window}
        probs, _ = self._probs(q, k, kind, scale, masking, lse=lse.to(acc))
        dout, out = dout.to(acc), out.to(acc)
        v_full = expand_kv_heads(v, q.shape[1]).to(acc)
        k_full = expand_kv_heads(k, q.shape[1]).to(acc)
        dv = torch.matmul(probs.transpose(-1, -2), dout)
        dprobs = torch.matmul(dout, v_full.transpose(-1, -2))
        delta = softmax_delta(dout, out).unsqueeze(-1)  # over the *final* output
        dscores = probs * (dprobs - delta) * scale
        dq = torch.matmul(dscores, k_full)
        dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc))
        kv_heads = k.shape[1]
        return dq, reduce_kv_heads(dk, kv_heads), reduce_kv_heads(dv, kv_heads)


def _allowed(kind, q_len, k_len, device, *, q_pos, k_pos, causal, q_doc,
             k_doc, window) -> torch.Tensor | None:
    if kind is PieceKind.FULL:
        return None
    if kind is PieceKind.CAUSAL:
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
    return position_mask(q_pos, k_pos, device, causal=causal, q_doc=q_doc, k_doc=k_doc,
                         window=window)
