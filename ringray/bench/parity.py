"""Exactness on real weights: ringray's logits and gradients against transformers' on the same
checkpoint and the same real text, in one process and over gloo rings (float32, CPU).

    tokens = stdlib_tokens(ckpt, 264)                       # (1, 265): inputs and targets
    reference = transformers_reference(ckpt, tokens)        # HF LlamaForCausalLM, SDPA
    ours = one_process(ckpt, tokens)
    ranks = run_gloo_ranks(4, rank_modes, ckpt, tokens)     # every MODES entry in one launch
    report = parity_report(reference, ours, ranks, tokens.shape[1] - 1)

The text is real source code (the first tokens of the standard library's ``argparse.py``),
so the model sees what it was trained on and its outlier features show, which random
tokens and random weights do not exercise. The loss is the mean next-token cross entropy;
over a ring each rank adds its tokens' share (sum / all tokens), and the gradients are
summed over the ranks.

Used by ``tests/test_real_model.py`` and ``benchmarks/real_model_parity.py``.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringray.attention import make_layout
from ringray.data.tokenizer import HFTokenizer
from ringray.model import RingContext, Transformer, hf_parameter_names, load_pretrained

TEXT_FILE = "argparse.py"
"""The standard library file whose first tokens are the text (about 22k tokens long)."""

MODES = ("ring 4", "ring 2", "ulysses 3")
"""What :func:`rank_modes` runs in one launch of 4 ranks: a zigzag ring of all 4 ranks
(logits and gradients), zigzag rings of ranks 0-1 and of ranks 2-3 (logits), and ring 1 x
Ulysses 3 on ranks 0-2 (logits). A sequence length for all three is a multiple of 24."""


@dataclass(frozen=True, kw_only=True)
class Result:
    """Logits ``(1, seq, vocab)``, the gradient of every parameter by its HF name (or None)
    and the loss, in sequence order."""

    logits: torch.Tensor
    grads: dict[str, torch.Tensor] | None
    loss: float


def stdlib_tokens(checkpoint: str, count: int) -> torch.Tensor:
    """``(1, count + 1)``: the first ``count + 1`` tokens of :data:`TEXT_FILE` under the
    checkpoint's tokenizer (inputs ``[:, :-1]``, targets ``[:, 1:]``)."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / TEXT_FILE).read_text()
    ids = HFTokenizer.from_pretrained(checkpoint).encode(text)
    if len(ids) < count + 1:
        raise ValueError(f"count: {count} is more than {TEXT_FILE}'s {len(ids) - 1} tokens")
    return torch.tensor([ids[: count + 1]])


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, count: int) -> torch.Tensor:
    """Summed cross entropy of these tokens divided by ``count`` (all the ring's tokens), so
    the ranks' losses add up to the sequence's mean."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           reduction="sum") / count


def transformers_reference(checkpoint: str, tokens: torch.Tensor, *,
                           dtype: torch.dtype = torch.float32,
                           attention: str = "sdpa") -> Result:
    """transformers' ``LlamaForCausalLM`` (or the checkpoint's architecture) on ``tokens``:
    logits and the gradients of the mean cross entropy, in ``dtype``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=dtype, attn_implementation=attention).eval()
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = mean_cross_entropy(logits, tokens[:, 1:], tokens.shape[1] - 1)
    loss.backward()
    return Result(logits=logits.detach(), loss=loss.item(),
                  grads={name: p.grad for name, p in model.named_parameters()})


def _grads(model: Transformer) -> dict[str, torch.Tensor]:
    names = hf_parameter_names(model)
    return {names[name]: p.grad for name, p in model.named_parameters()}


def one_process(checkpoint: str, tokens: torch.Tensor) -> Result:
    """ringray's :class:`Transformer` loaded from ``checkpoint``, ``model(tokens)`` with no
    ring: logits and gradients of the mean cross entropy."""
    model = load_pretrained(checkpoint)
    logits = model(tokens[:, :-1])
    loss = mean_cross_entropy(logits, tokens[:, 1:], tokens.shape[1] - 1)
    loss.backward()
    return Result(logits=logits.detach(), grads=_grads(model), loss=loss.item())


def _ring_logits(model: Transformer, tokens: torch.Tensor, ring: RingContext, *,
                 grads: bool) -> tuple[torch.Tensor, float]:
    """This rank's logits (in its local order) and loss share; with ``grads`` the backward
    runs too (the caller sums the gradients over the ring)."""
    layout, rank = ring.layout, ring.rank
    count = tokens.shape[1] - 1
    with torch.set_grad_enabled(grads):
        logits = model(layout.shard(tokens[:, :-1], rank), ring)
        loss = mean_cross_entropy(logits, layout.shard(tokens[:, 1:], rank), count)
    if grads:
        loss.backward()
    return logits.detach(), loss.item()


def rank_modes(rank: int, world: int, checkpoint: str, tokens: torch.Tensor) -> dict:
    """The gloo rank function of :data:`MODES` (``world`` must be 4): this rank's logits per
    mode it takes part in (local order), and on rank 0 the ring of 4's summed gradients
    and loss."""
    if world != 4:
        raise ValueError(f"world: rank_modes runs on 4 ranks, got {world}")
    seq = tokens.shape[1] - 1
    model = load_pretrained(checkpoint)
    out: dict[str, object] = {"logits": {}, "loss": {}}

    # A zigzag ring of all four ranks, forward and backward.
    ring = RingContext(layout=make_layout("zigzag", 4, seq), rank=rank, backend="sdpa")
    out["logits"]["ring 4"], loss = _ring_logits(model, tokens, ring, grads=True)
    losses = torch.tensor([loss])
    dist.reduce(losses, 0)
    grads = _grads(model)
    for grad in grads.values():  # one flat reduce would need 540 MB more per rank
        dist.reduce(grad, 0)
    if rank == 0:
        out["grads"], out["loss"]["ring 4"] = grads, losses.item()

    # Two zigzag rings of two (ranks 0-1 and 2-3, as dp 2 x cp 2 would be). Both pairs run,
    # though one would do: each ring lazily makes a side group for its agreement checks
    # (ringray.attention.comm.agreement_group, torch's use_local_synchronization), and torch
    # names such a group after how many groups its rank has made, so ranks 0-2 must
    # have made as many as each other before the Ulysses group's side group below (with one
    # pair idle, ranks 0-1 would be one group ahead of rank 2, and its creation would hang).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank calls
    ring = RingContext(layout=make_layout("zigzag", 2, seq), rank=rank % 2,
                       group=pairs[rank // 2], backend="sdpa")
    out["logits"]["ring 2"], _ = _ring_logits(model, tokens, ring, grads=False)

    # Ring 1 x Ulysses 3 on ranks 0-2: 9 query heads and 3 kv heads split 3 ways.
    triple = dist.new_group([0, 1, 2])
    alone = [dist.new_group([r]) for r in range(3)]  # each one's ring of one
    if rank < 3:
        ring = RingContext(layout=make_layout("zigzag", 3, seq, ulysses=3), rank=rank,
                           group=alone[rank], ulysses_group=triple, backend="sdpa")
        out["logits"]["ulysses 3"], _ = _ring_logits(model, tokens, ring, grads=False)
    dist.barrier()
    return out


def unshard(mode: str, ranks: list[dict], seq: int, *, first_rank: int = 0) -> torch.Tensor:
    """The logits of ``mode`` from :func:`rank_modes`' results, in sequence order (the ring
    of 2 that starts at ``first_rank``: 0 or 2)."""
    world, ulysses = {"ring 4": (4, 1), "ring 2": (2, 1), "ulysses 3": (3, 3)}[mode]
    layout = make_layout("zigzag", world, seq, ulysses=ulysses)
    return layout.unshard([ranks[first_rank + r]["logits"][mode] for r in range(world)])


def max_grad_error(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
                   ) -> tuple[float, float, str]:
    """Over every parameter: the largest absolute difference, and the largest difference
    relative to that tensor's largest reference entry, with the tensor's name."""
    worst_abs, worst_rel, worst_name = 0.0, 0.0, ""
    for name, grad in ours.items():
        diff = (grad.double() - reference[name].double()).abs().max().item()
        rel = diff / reference[name].abs().max().item()
        worst_abs = max(worst_abs, diff)
        if rel > worst_rel:
            worst_rel, worst_name = rel, name
    return worst_abs, worst_rel, worst_name


def parity_report(reference: Result, ours: Result, ranks: list[dict], seq: int
                  ) -> dict[str, dict[str, float | str]]:
    """Per mode: the max abs difference of the logits from ``reference``'s, and for the
    modes with gradients the max abs and max relative-to-tensor gradient differences."""
    report: dict[str, dict[str, float | str]] = {}
    logits = {"one process": ours.logits,
              **{mode: unshard(mode, ranks, seq) for mode in MODES}}
    for mode, value in logits.items():
        report[mode] = {"logits_max_abs": (value - reference.logits).abs().max().item()}
    for mode, grads in (("one process", ours.grads), ("ring 4", ranks[0]["grads"])):
        worst_abs, worst_rel, name = max_grad_error(grads, reference.grads)
        report[mode].update(grads_max_abs=worst_abs, grads_max_rel=worst_rel,
                            grads_worst_tensor=name)
    return report
