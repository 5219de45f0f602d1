"""Exactness on real weights, the training modes: packed documents (``data.documents``) over
a zigzag ring and over the ``balanced`` layout, FSDP over dp x cp, and bf16, each against
transformers on the same checkpoint and the same real text.

    write_corpus(directory / "corpus")                     # a few short stdlib texts
    ranks = run_gloo_ranks(4, rank_trainer_modes, ckpt, str(directory / "corpus"),
                           str(directory / "runs"), tokens)
    first = ranks[0]["documents"]
    row = packed_row(first["inputs"], first["next"], eos_id)   # cut at its EOS tokens
    logits, loss = transformers_documents(transformers_model(ckpt), row)  # each alone

The ranks run ringray's own :class:`~ringray.train.Trainer` (a job spec's options, its
loader, its model and ring contexts; under FSDP its step), so what is compared is what a
job trains on: with ``data.documents`` the
loader packs the corpus's documents (each followed by EOS) into one sequence, attention
stays inside each document, RoPE positions restart in each, and no token's loss predicts the
next document's first token. transformers runs each document separately, so its reference
owes nothing to ringray's document mask; the boundaries it splits at are found from the
EOS tokens, not from ringray's loader, and the corpus's texts are checked to be what the
documents hold.

Used by ``tests/test_real_model_modes.py`` and ``benchmarks/real_model_parity.py``.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringray.attention import make_layout
from ringray.bench.parity import mean_cross_entropy
from ringray.model import RingContext, hf_parameter_names

IGNORE = -100

CORPUS = (("fnmatch.py", 200), ("bisect.py", 300), ("colorsys.py", 160), ("heapq.py", 600))
"""The documents: the first characters of these standard library files (about 45, 90, 45
and 180 tokens under SmolLM2's tokenizer; with their EOS tokens more than one 264-token
sequence, so the first sequence holds three whole documents and the start of a fourth)."""


def write_corpus(directory: str | Path) -> list[str]:
    """Write :data:`CORPUS` as ``.txt`` files under ``directory`` (a ``files`` source);
    returns the texts, in :data:`CORPUS` order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    texts = []
    for index, (name, chars) in enumerate(CORPUS):
        text = (stdlib / name).read_text()[:chars]
        (directory / f"{index}-{name}.txt").write_text(text)
        texts.append(text)
    return texts


def trainer_options(checkpoint: str, corpus: str, run_dir: str, *, seq_len: int,
                    global_batch: int = 1, documents: bool = False, precision: str = "fp32",
                    **parallel: object):
    """The training options a job spec would give: ``model.from_pretrained`` the checkpoint,
    ``files`` data from ``corpus``, SDPA attention, one step, no gradient clipping (the
    gradients a step leaves are the summed ones)."""
    from ringray.data.sources import DataOptions
    from ringray.model.options import ModelOptions
    from ringray.train.options import (
        EvalOptions,
        OptimizerOptions,
        ParallelOptions,
        TrainingOptions,
        TrainOptions,
    )

    return TrainOptions(
        model=ModelOptions(from_pretrained=checkpoint).build(),
        data=DataOptions(source="files", path=corpus, documents=documents),
        parallel=ParallelOptions(attention_backend="sdpa", **parallel),
        train=TrainingOptions(steps=1, global_batch=global_batch, seq_len=seq_len,
                              precision=precision, peak_tflops_per_device=1.0,
                              optimizer=OptimizerOptions(grad_clip=0.0)),
        eval=EvalOptions(passkey_lengths=()), run_dir=run_dir, pretrained=checkpoint)


def _forward(model, tokens: torch.Tensor, ring: RingContext) -> torch.Tensor:
    with torch.no_grad():
        return model(ring.layout.shard(tokens, ring.rank), ring).float()


def rank_trainer_modes(rank: int, world: int, checkpoint: str, corpus: str, run_dir: str,
                       tokens: torch.Tensor, fsdp_seq_len: int = 64) -> dict:
    """The gloo rank function (4 ranks) of every mode: three trainers, one after another.

    - ``data.documents`` over a zigzag ring of 4 (dp 1, replicated, fp32): of the first
      packed sequence, its logits over the trainer's own document ring (this rank's, in
      local order), its logits over a ``balanced`` layout built for its documents, and its
      loss as the trainer computes it (the cross-entropy sum of the forward with labels,
      summed over the ring, over the batch's counted labels), without the backward. And
      ``tokens``' logits over the trainer's zigzag ring under bf16 autocast (what
      ``train.precision: bf16`` runs replicated).
    - FSDP over dp 2 x cp 2 (zigzag, fp32, sequences of ``fsdp_seq_len``): the first global
      batch's rows (each rank its dp replica's), the first step's loss and gradient norm,
      and on rank 0 the summed gradients gathered from the shards (by HF name).
    - FSDP over dp 1 x cp 4 with ``train.precision: bf16`` (FSDP gathers bf16 weights; no
      autocast): ``tokens``' logits over its zigzag ring.
    """
    from ringray.train import Trainer
    from ringray.train.sharding import full_tensor

    if world != 4:
        raise ValueError(f"world: rank_trainer_modes runs on 4 ranks, got {world}")
    seq = tokens.shape[1] - 1
    inputs = tokens[:, :-1]
    out: dict[str, dict] = {}

    trainer = Trainer(trainer_options(checkpoint, corpus, f"{run_dir}/documents", seq_len=seq,
                                      documents=True, layout="zigzag", cp=4))
    model, group = trainer.model, trainer.mesh.ring_group
    batch = trainer.loader.packed(0)
    documents = batch.documents[0]
    ring = trainer._document_ring(documents)  # the trainer's own context for this row
    balanced = RingContext.for_documents(
        documents, layout=make_layout("balanced", 4, seq, documents=documents), rank=rank,
        restart_positions=True, group=group, backend="sdpa")
    with torch.no_grad():
        loss_sum = model(ring.layout.shard(batch.inputs, rank), ring,
                         labels=ring.layout.shard(batch.labels, rank), ignore_index=IGNORE)
    dist.all_reduce(loss_sum, group=group)
    out["documents"] = {
        "inputs": batch.inputs, "labels": batch.labels, "documents": documents,
        "next": trainer.loader.batch(0)[1][:, -1], "counted": batch.counted_labels,
        "loss": (loss_sum / batch.counted_labels).item(),
        "zigzag": _forward(model, batch.inputs, ring),
        "balanced": _forward(model, batch.inputs, balanced),
    }
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as Trainer._autocast does
        out["bf16"] = {"autocast": _forward(model, inputs, trainer.ring)}
    del trainer, model, ring, balanced

    trainer = Trainer(trainer_options(checkpoint, corpus, f"{run_dir}/fsdp",
                                      seq_len=fsdp_seq_len, global_batch=2, layout="zigzag",
                                      dp=2, cp=2, fsdp=True))
    rows, labels = trainer.loader.batch(0)
    stats = trainer.step()
    names = hf_parameter_names(trainer.model)
    grads = {names[name]: full_tensor(p.grad) for name, p in trainer.model.named_parameters()}
    out["fsdp"] = {"inputs": rows, "labels": labels, "loss": stats.loss,
                   "grad_norm": stats.grad_norm, "grads": grads if rank == 0 else None}
    del trainer

    trainer = Trainer(trainer_options(checkpoint, corpus, f"{run_dir}/fsdp-bf16", seq_len=seq,
                                      precision="bf16", layout="zigzag", cp=4, fsdp=True))
    out["bf16"]["fsdp"] = _forward(trainer.model, inputs, trainer.ring)
    dist.barrier()
    return out


@dataclass(frozen=True)
class PackedRow:
    """One packed sequence, cut at its EOS tokens: ``inputs`` ``(1, seq)``, ``labels`` (the
    next token, ``IGNORE`` after each EOS), the document lengths."""

    inputs: torch.Tensor
    labels: torch.Tensor
    lengths: tuple[int, ...]


def packed_row(inputs: torch.Tensor, next_token: torch.Tensor, eos_id: int) -> PackedRow:
    """The documents of a packed row ``inputs`` ``(1, seq)`` found from its EOS tokens
    alone: each ends at an EOS (the last may run past the row), and the label of an EOS,
    the next document's first token, does not count. ``next_token``: the token after the
    row."""
    row = inputs[0]
    labels = torch.cat([row[1:], next_token.reshape(1)])
    labels = labels.masked_fill(row == eos_id, IGNORE)
    ends = [i + 1 for i in (row == eos_id).nonzero().flatten().tolist()]
    bounds = [0, *[e for e in ends if e < len(row)], len(row)]
    lengths = tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    return PackedRow(inputs=inputs, labels=labels.view(1, -1), lengths=lengths)


def transformers_model(checkpoint: str, dtype: torch.dtype = torch.float32):
    """transformers' model of ``checkpoint`` (SDPA attention, eval mode), in ``dtype``.

    Its embedding has no ``padding_idx``: SmolLM2's config.json names EOS (id 2) as the pad
    token, and transformers gives the pad token's embedding row no gradient from its
    lookups, but in a packed sequence EOS is a real input whose row the loss depends on
    (the exact gradient, which ringray computes). Logits are unaffected."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=dtype, attn_implementation="sdpa").eval()
    model.get_input_embeddings().padding_idx = None
    return model


def transformers_documents(model, row: PackedRow) -> tuple[torch.Tensor, float]:
    """transformers on each document of ``row`` separately: the logits, put side by side
    ``(1, seq, vocab)`` (float32), and the cross entropy summed over the counted labels
    divided by their count."""
    pieces, start = [], 0
    with torch.no_grad():
        for length in row.lengths:
            pieces.append(model(input_ids=row.inputs[:, start : start + length]).logits)
            start += length
    logits = torch.cat(pieces, dim=1).float()
    counted = int((row.labels != IGNORE).sum())
    loss = F.cross_entropy(logits.flatten(0, 1), row.labels.flatten(), ignore_index=IGNORE,
                           reduction="sum") / counted
    return logits, loss.item()


def transformers_logits(model, tokens: torch.Tensor, *, autocast: bool = False
                        ) -> torch.Tensor:
    """transformers' logits of ``tokens[:, :-1]``, as float32; with ``autocast``, under bf16
    autocast (what ringray's replicated ``precision: bf16`` runs: float32 weights and
    residual stream, bf16 matmuls). A model loaded in bf16 runs in bf16 throughout."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=tokens[:, :-1]).logits.float()


def transformers_loss(model, inputs: torch.Tensor, labels: torch.Tensor
                      ) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' mean cross entropy over every row of a batch and its gradient (by
    parameter name; a tied output projection is the embedding's)."""
    model.zero_grad(set_to_none=True)
    loss = mean_cross_entropy(model(input_ids=inputs).logits, labels, labels.numel())
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def gradient_norm(grads: dict[str, torch.Tensor]) -> float:
    """The global L2 norm of these gradients (float64 sums)."""
    return torch.linalg.vector_norm(
        torch.stack([g.double().norm() for g in grads.values()])).item()
