"""The trainer in one plain process (no torch.distributed): other data sources, and options
it must refuse before building anything."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from train_cases import changed, tiny_options

from ringray.train import Trainer


def test_trains_on_synthetic_passkey_samples(tmp_path: Path) -> None:
    """data.source 'passkey' packs one retrieval sample per sequence and trains."""
    trainer = Trainer(tiny_options(str(tmp_path), data={"source": "passkey"},
                                   train={"seq_len": 256}))
    first = trainer.step()
    inputs, _ = trainer.loader.batch(0)
    assert b"pass key" in bytes(t for t in inputs[0].tolist() if t < 256)
    assert first.tokens == 2 * 256 and first.loss > 0


def test_trains_on_a_directory_of_text(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.txt").write_text("ring attention " * 200)
    trainer = Trainer(tiny_options(str(tmp_path),
                                   data={"source": "files", "path": str(tmp_path / "docs")}))
    assert trainer.step().loss > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model": None}, "model.vocab_size: 256 is smaller than the tokenizer's 320"),
        ({"train": {"precision": "fp16"}}, "train.precision: 'fp16' is not one of"),
        ({"parallel": {"dp": 2}}, "cp = world size / dp = 1 / 2: not a whole number"),
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
