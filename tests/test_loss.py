"""The chunked cross-entropy is the full one, without the full logits.

- :func:`chunked_cross_entropy_sum` against torch's ``F.cross_entropy`` on the whole
  float32 logits: the loss and the gradients of the hidden states and of the weight, within
  the float32 summation bound of each element (2·n·eps·Σ|terms|), with ignored labels and a
  loss mask, for chunks of 1, 7 (which does not divide the
  74 tokens), 74 and more than 74 tokens.
- The model's ``forward(labels=...)`` against ``F.cross_entropy`` of its logits, with each
  activation checkpointing mode: loss and every parameter's gradient at 1e-6.
- Memory: the allocator's peak over a forward and backward is one chunk's working set,
  :func:`ringray.train.footprint.loss_chunk_bytes` (12 bytes × vocabulary per chunk token),
  whatever the number of tokens, and well under the full logits.
- Training: FSDP over dp 2 × cp 2 (4 gloo ranks, selective checkpointing) with 5-token
  chunks trains as one process with the default chunk (losses, gradients 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from allocations import allocation_events
from distributed import run_gloo_ranks
from train_cases import changed, gradients, record_steps, snapshot, tiny_options

from ringray.data import IGNORE_LABEL
from ringray.model import Transformer, model_preset
from ringray.model.loss import chunked_cross_entropy_sum
from ringray.train import Trainer, TrainOptions
from ringray.train.footprint import loss_chunk_bytes

TOL = {"atol": 1e-6, "rtol": 1e-6}


def _case(tokens: int = 74, vocab: int = 50, dim: int = 16):
    """Hidden states ``(2, tokens / 2, dim)``, a weight, labels with some ignored and a loss
    mask applied as the loader applies it (masked labels become ``IGNORE_LABEL``)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, tokens // 2, dim, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=generator)
    labels[0, :3] = IGNORE_LABEL  # e.g. across a document boundary
    mask = torch.rand(2, tokens // 2, generator=generator) > 0.3
    return hidden, weight, labels.masked_fill(~mask, IGNORE_LABEL)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 74, 1000])
def test_chunked_loss_and_gradients_equal_the_full_cross_entropy(chunk_tokens: int) -> None:
    hidden, weight, labels = _case()
    loss = chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk_tokens,
                                     ignore_index=IGNORE_LABEL)
    got = torch.autograd.grad(loss, (hidden, weight))
    logits = hidden @ weight.T
    want_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                ignore_index=IGNORE_LABEL, reduction="sum")
    want = torch.autograd.grad(want_loss, (hidden, weight))
    assert (labels == IGNORE_LABEL).sum() > 10 and want_loss > 0
    # Each side sums in float32 in its own order (chunks against one matmul), so each
    # element may differ by what the standard bound allows for a sum of n float32 products,
    # n·eps·Σ|terms| per side (Higham, Accuracy and Stability, 3.1), twice: the loss over
    # the tokens, dL/dhidden over the vocabulary, dL/dweight over the tokens. A fixed 1e-6
    # failed at 1.06e-6 on a dL/dweight element under load (another thread count's order).
    eps = torch.finfo(torch.float32).eps
    flat = hidden.detach().flatten(0, 1)
    valid = (labels.flatten() != IGNORE_LABEL).unsqueeze(1)
    probs = torch.softmax(logits.detach().flatten(0, 1), dim=-1)
    onehot = F.one_hot(labels.flatten().clamp(min=0), weight.shape[0]).to(probs.dtype)
    residual = ((probs - onehot) * valid).abs()  # |dL/dlogits|, ignored tokens 0
    tokens, vocab = flat.shape[0], weight.shape[0]
    per_token = F.cross_entropy(logits.detach().flatten(0, 1), labels.flatten(),
                                ignore_index=IGNORE_LABEL, reduction="none").abs()
    bounds = (2 * tokens * eps * per_token.sum() + 1e-7,
              2 * vocab * eps * (residual @ weight.detach().abs()).view_as(hidden) + 1e-7,
              2 * tokens * eps * (residual.T @ flat.abs()) + 1e-7)
    for name, value, reference, bound in zip(("loss", "dL/dhidden", "dL/dweight"),
                                             (loss, *got), (want_loss, *want), bounds,
                                             strict=True):
        error = (value.detach() - reference.detach()).abs()
        assert (error <= bound).all(), (name, (error - bound).max().item())


def test_chunk_size_is_checked() -> None:
    hidden, weight, labels = _case()
    with pytest.raises(ValueError, match="chunk_tokens: 0 must be >= 1"):
        chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"labels: shape \(2, 36\) does not match"):
        chunked_cross_entropy_sum(hidden, weight, labels[:, 1:])


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_model_loss_equals_cross_entropy_of_its_logits(mode: str) -> None:
    """``model(tokens, labels=...)`` with 7-token chunks is ``F.cross_entropy`` of
    ``model(tokens)``'s logits: the loss and every parameter's gradient."""
    cfg = model_preset("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    torch.manual_seed(0)
    model = Transformer(cfg, activation_checkpointing=mode, loss_chunk_tokens=7)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=generator)
    labels = torch.randint(0, cfg.vocab_size, (2, 40), generator=generator)
    labels[1, 5:9] = IGNORE_LABEL
    params = list(model.parameters())

    loss = model(tokens, labels=labels, ignore_index=IGNORE_LABEL)
    got = torch.autograd.grad(loss, params)
    want_loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(),
                                ignore_index=IGNORE_LABEL, reduction="sum")
    want = torch.autograd.grad(want_loss, params)
    torch.testing.assert_close(loss, want_loss, **TOL)
    for (name, _), g, w in zip(model.named_parameters(), got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _peak_allocated_bytes(fn) -> int:
    """The most bytes torch's CPU allocator held at once while ``fn()`` ran, above what it
    held before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = allocation_events(prof)
    _, first_size, first_total = events[0]
    return max(total for _, _, total in events) - (first_total - first_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1024, 4096])
def test_memory_is_one_chunk_of_logits(tokens: int, dtype: torch.dtype) -> None:
    """256-token chunks over a vocabulary of 2000 and 16-dim hidden states (so the
    vocabulary dominates): the peak of a forward and backward is the footprint's loss chunk
    (12 x 2000 x 256 B) within 10% (the rest: the hidden states' gradient, small here),
    for 1024 and 4096 tokens alike, against 4 x 2000 x 4096 B for the full logits alone.
    In float32 and with bf16 weights and hidden states."""
    vocab, chunk = 2000, 256
    hidden = torch.randn(tokens, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, 16, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))

    def step() -> None:
        chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk).backward()

    step()  # the gradients exist: later steps accumulate into them
    peak = _peak_allocated_bytes(step)
    predicted = loss_chunk_bytes(model_preset("debug", vocab_size=vocab), local_tokens=tokens,
                                 chunk_tokens=chunk)
    assert predicted == 12 * vocab * chunk
    assert predicted <= peak <= 1.1 * predicted
    assert peak < 4 * vocab * 4096 / 2


def rank_record_chunked(rank: int, world: int, options: TrainOptions, steps: int,
                        chunk_tokens: int) -> dict:
    """:func:`train_cases.record_steps` with the model's loss cut into ``chunk_tokens``-token
    chunks."""
    trainer = Trainer(options)
    trainer.model.loss_chunk_tokens = chunk_tokens
    losses, norms, grads = [], [], []
    for _ in range(steps):
        stats = trainer.step()
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        grads.append(gradients(trainer))
    return {"losses": losses, "grad_norms": norms, "grads": grads, "weights": snapshot(trainer)}


def test_fsdp_training_with_small_chunks_equals_one_process(tmp_path) -> None:
    """FSDP dp 2 x cp 2, selective checkpointing, 5-token loss chunks (each rank holds 2 x 32
    tokens: 13 chunks, the last of 4) trains as one process with the default (one) chunk:
    losses, gradient norms and gradients at 1e-5 for three steps."""
    base = tiny_options(str(tmp_path / "one"), parallel={"dp": 1, "cp": 1},
                        train={"global_batch": 4})
    want = record_steps(base, 3)
    sharded = changed(base, run_dir=str(tmp_path / "fsdp"),
                      parallel={"dp": 2, "cp": 2, "fsdp": True},
                      train={"activation_checkpointing": "selective"})
    per_rank = run_gloo_ranks(4, rank_record_chunked, sharded, 3, 5, timeout_seconds=300)
    tol = {"atol": 1e-5, "rtol": 1e-5}
    for got in per_rank:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   **tol)
        torch.testing.assert_close(torch.tensor(got["grad_norms"]),
                                   torch.tensor(want["grad_norms"]), **tol)
        for step, (g_step, w_step) in enumerate(zip(got["grads"], want["grads"], strict=True)):
            for name in w_step:
                torch.testing.assert_close(g_step[name], w_step[name], **tol,
                                           msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
