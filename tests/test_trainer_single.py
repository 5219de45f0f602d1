"""The trainer in one plain process (no torch.distributed): other data sources, and options
it must refuse before building anything."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from train_cases import changed, tiny_options

from ringray.data import IGNORE_LABEL
from ringray.train import Trainer


def _batch_loss(trainer: Trainer, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """Torch's own mean cross-entropy of the trainer's model on one batch (no gradients)."""
    with torch.no_grad():
        logits = trainer.model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_LABEL).item()


def test_trains_on_synthetic_passkey_samples(tmp_path: Path) -> None:
    """data.source 'passkey' packs one retrieval sample per sequence: every row is a whole
    sample (one needle, and the question at the end asking for that needle's key) closed by
    the end-of-document token. The step's loss is torch's cross-entropy of that batch, and
    the step lowers it."""
    trainer = Trainer(tiny_options(str(tmp_path), data={"source": "passkey"},
                                   train={"seq_len": 256}))
    inputs, labels = trainer.loader.batch(0)
    eos = trainer.tokenizer.eos_id
    for row in inputs.tolist():
        assert row[-1] == eos and eos not in row[:-1]
        text = bytes(row[:-1]).decode()
        keys = re.findall(r"The pass key is (\d{5})\. Remember it\.", text)
        assert len(keys) == 1, text
        assert text.endswith(f"What is the pass key? The pass key is {keys[0]}"), text
    before = _batch_loss(trainer, inputs, labels)
    first = trainer.step()
    assert first.tokens == 2 * 256
    assert first.loss == pytest.approx(before, rel=1e-5)
    assert _batch_loss(trainer, inputs, labels) < before


@pytest.mark.parametrize("documents", [False, True])
def test_a_loss_masked_source_reports_the_mean_over_its_counted_labels(
    tmp_path: Path, documents: bool,
) -> None:
    """data.source 'passkey_retrieval' counts 10 labels of each 256-token sample: the step's
    loss is their mean cross-entropy (torch's own, ignore_index), not their sum over all 512
    tokens, and the gradients it steps with are torch's gradients of that mean."""
    options = tiny_options(str(tmp_path), data={"source": "passkey_retrieval",
                                                "documents": documents},
                           train={"seq_len": 256})
    optimizer = replace(options.train.optimizer, grad_clip=0.0)
    options = changed(options, train={"optimizer": optimizer})
    trainer = Trainer(options)
    model = trainer.model
    inputs, labels = (trainer.loader.packed(0).inputs, trainer.loader.packed(0).labels) \
        if documents else trainer.loader.batch(0)
    assert int((labels != IGNORE_LABEL).sum()) == 20
    want = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_LABEL)
    want.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    stats = trainer.step()
    assert stats.loss == pytest.approx(want.item(), rel=1e-5)
    for name, p in model.named_parameters():  # zero_grad left the step's own gradients
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_trains_on_a_directory_of_text(tmp_path: Path) -> None:
    """data.source 'files' reads the .txt files under data.path, subdirectories included:
    the batch is their text (documents closed by the end-of-document token), the step's loss
    is torch's cross-entropy of that batch, and the step lowers it."""
    texts = {"docs/a.txt": "ring attention " * 40, "docs/more/b.txt": "zigzag layout " * 40}
    for name, text in texts.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    trainer = Trainer(tiny_options(str(tmp_path), train={"global_batch": 16},
                                   data={"source": "files", "path": str(tmp_path / "docs")}))
    inputs, labels = trainer.loader.batch(0)
    eos = trainer.tokenizer.eos_id
    stream = b"".join(bytes(t if t != eos else 0 for t in row) for row in inputs.tolist())
    pieces = [piece.decode() for piece in stream.split(b"\0") if piece]
    assert all(any(piece in text for text in texts.values()) for piece in pieces), pieces
    for text in texts.values():  # both files, the nested one too, are in the batch
        assert any(piece in text and len(piece) >= 32 for piece in pieces), text[:16]
    before = _batch_loss(trainer, inputs, labels)
    stats = trainer.step()
    assert stats.loss == pytest.approx(before, rel=1e-5)
    assert _batch_loss(trainer, inputs, labels) < before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model": None}, "model.vocab_size: 256 is smaller than the tokenizer's 320"),
        ({"train": {"precision": "fp16"}}, "train.precision: 'fp16' is not one of"),
        ({"parallel": {"dp": 2}}, "cp = world size / dp = 1 / 2: not a whole number; give "
                                  "parallel.dp a divisor of 1 (1) or run on a multiple of 2 "
                                  "ranks"),
        ({"parallel": {"dp": 2, "cp": 1}}, "2 × 1 = 2, but the world has 1 rank(s)"),
    ],
)
def test_refuses_options_that_cannot_work(tmp_path: Path, overrides: dict, message: str) -> None:
    options = tiny_options(str(tmp_path))
    if "model" in overrides:
        overrides = {"model": replace(options.model, vocab_size=256)}
    with pytest.raises(ValueError) as info:
        Trainer(changed(options, **overrides))
    assert message in str(info.value)


def test_fsdp_and_checkpointing_in_one_process(tmp_path: Path) -> None:
    """With one rank there is nothing to shard: ``parallel.fsdp`` trains exactly as the
    replicated run; and the three activation checkpointing modes give the same losses
    (float32: the recompute repeats the same arithmetic)."""
    def losses(**sections: dict) -> list[float]:
        trainer = Trainer(tiny_options(str(tmp_path), **sections))
        assert not trainer.sharded
        return [trainer.step().loss for _ in range(2)]

    want = losses()
    assert losses(parallel={"fsdp": True}) == want
    for mode in ("full", "selective"):
        assert losses(train={"activation_checkpointing": mode}) == pytest.approx(want, abs=1e-6)


def test_old_boolean_checkpointing_is_refused_naming_the_new_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="activation_checkpointing: true is no longer a value; "
                                         "write 'full' for true"):
        tiny_options(str(tmp_path), train={"activation_checkpointing": True})
