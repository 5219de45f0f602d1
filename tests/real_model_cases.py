"""What the tests on SmolLM2's real weights share (tests/test_real_model.py,
tests/test_real_model_modes.py): the float32 tolerances against transformers, and the
assertions that apply them. Why these tolerances: tests/test_real_model.py's docstring
(twice transformers' own float32 error against float64 on the same text)."""

from __future__ import annotations

import torch

from ringray.bench.parity import Result

LOGITS_ATOL = 2e-4
GRAD_ATOL_OF_MAX = 3e-4


def assert_logits_close(ours: torch.Tensor, reference: Result, mode: str) -> None:
    torch.testing.assert_close(ours, reference.logits, atol=LOGITS_ATOL, rtol=0,
                               msg=lambda m: f"{mode}: logits: {m}")


def assert_grads_close(ours: dict[str, torch.Tensor], reference: Result, mode: str) -> None:
    """Every parameter's gradient (tied lm_head: the embedding's), within GRAD_ATOL_OF_MAX of
    the tensor's largest reference entry."""
    assert set(ours) == set(reference.grads)
    for name, grad in ours.items():
        scale = reference.grads[name].abs().max().item()
        torch.testing.assert_close(grad, reference.grads[name], atol=GRAD_ATOL_OF_MAX * scale,
                                   rtol=0, msg=lambda m, n=name: f"{mode}: grad of {n}: {m}")
