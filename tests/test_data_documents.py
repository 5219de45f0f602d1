"""The packed loader's document boundaries: each row's document lengths, the labels that must
not count (a document's last token predicts the next document's first), and the global count
of those that do, checked against the tokens themselves (every eos ends a document)."""

from __future__ import annotations

import random

import pytest
import torch

from ringray.data import IGNORE_LABEL, ByteTokenizer, MemorySource, PackedLoader


def _loader(lengths: list[int], *, seq_len: int, global_batch: int, dp_rank: int = 0,
            dp_size: int = 1, seed: int = 0) -> PackedLoader:
    rng = random.Random(len(lengths))
    docs = ["".join(rng.choice("abcdefgh ") for _ in range(n)) for n in lengths]
    return PackedLoader(MemorySource(docs), tokenizer=ByteTokenizer(), seq_len=seq_len,
                        global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size,
                        seed=seed)


def _cut_at_eos(row: torch.Tensor, eos: int) -> tuple[int, ...]:
    lengths, current = [], 0
    for token in row.tolist():
        current += 1
        if token == eos:
            lengths.append(current)
            current = 0
    if current:
        lengths.append(current)
    return tuple(lengths)


@pytest.mark.parametrize(("lengths", "seq_len"), [
    ([1, 5, 2, 40, 3], 16),          # documents of length 1, shorter and longer than a row
    ([300], 64),                      # one document spanning several rows
    ([7] * 30, 32),                   # many tiny documents, rows ending on boundaries or not
    ([3, 100, 1, 1, 17, 64], 37),     # a length that divides nothing
])
def test_documents_and_labels_follow_the_tokens(lengths: list[int], seq_len: int) -> None:
    eos = ByteTokenizer().eos_id
    loader = _loader(lengths, seq_len=seq_len, global_batch=3)
    for index in range(6):  # crossing several epochs
        packed = loader.packed(index)
        plain_inputs, plain_labels = loader.batch(index)
        assert torch.equal(packed.inputs, plain_inputs)
        for row in range(3):
            inputs, labels = packed.inputs[row], packed.labels[row]
            assert packed.documents[row] == _cut_at_eos(inputs, eos)
            assert sum(packed.documents[row]) == seq_len
            at_eos = inputs == eos
            assert torch.all(labels[at_eos] == IGNORE_LABEL)
            assert torch.equal(labels[~at_eos], plain_labels[row][~at_eos])
        assert packed.counted_labels == int((packed.labels != IGNORE_LABEL).sum())


def test_the_label_count_is_the_global_batchs() -> None:
    """Each DP rank sees its slice; the denominator counts every rank's labels."""
    lengths = [5, 9, 2, 30, 11]
    slices = [_loader(lengths, seq_len=16, global_batch=4, dp_rank=r, dp_size=2).packed(2)
              for r in range(2)]
    counted = sum(int((p.labels != IGNORE_LABEL).sum()) for p in slices)
    assert slices[0].counted_labels == slices[1].counted_labels == counted
