"""Packed documents through the trainer (issue 17): ``data.documents: true``.

Real gloo processes, float32, SDPA, the two-layer test model on 64-token rows packed from a
small JSONL corpus whose rows hold documents of length 1 and lengths that are not multiples
of 2 × cp (asserted, not assumed):

- **Exact masking.** At CP=1 the trainer's step-0 loss equals a reference that nobody here
  wrote for documents: the same initial model run on each document *alone* (a plain forward,
  positions from 0, no document mask), cross entropy over the labels that stay inside a
  document (the document-ending eos predicts nothing), divided by their count (1e-5). A
  whole-row forward with the same labels is checked to differ (> 1e-3), so the comparison
  would see a token attending across a boundary.
- **RoPE positions** restart at 0 in each document with ``data.document_positions`` (the
  default) and run over the row without it: the positions the model receives are checked
  against the eos cuts. RoPE is relative, so within one document the two give the same
  attention and the same loss up to rounding: both equal the reference (1e-5), and CP=2
  equals CP=1 for either.
- **CP = N equals CP = 1.** CP=4 with documents (``parallel.layout: auto``, i.e. balanced,
  and zigzag) gives the CP=1 losses and summed, clipped gradients of each of 3 AdamW steps
  (1e-5) and its final weights (1e-4: AdamW amplifies tiny gradient differences, see
  WEIGHT_TOL); dp 2 × cp 2 (replicated, and FSDP, reduce-scattering every row) gives
  those of dp 1 × cp 1 on the same 4-row global batch.
- **Bad combinations** are refused in one line naming the field, before any training.

Each launch of processes runs several jobs, one after another, to keep the test short.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from distributed import run_gloo_ranks
from train_cases import (
    TINY_MODEL,
    rank_record_steps,
    rank_record_steps_counting_reduce_scatters,
    record_steps,
    tiny_options,
)

from ringray.attention import make_layout
from ringray.data import ByteTokenizer
from ringray.model import RingContext, Transformer
from ringray.spec import JobSpecError, parse_job_spec
from ringray.train import Trainer, TrainOptions

STEPS = 3
SEQ_LEN = 64
TOL = {"atol": 1e-5, "rtol": 1e-5}
# AdamW divides each element's update by its own gradient scale, so for an element whose
# gradient is ~0 a 1e-7 difference in it becomes a visible share of lr (tests/test_train_exact.py).
# Measured on these runs: weights differ by at most 3.7e-5 (dp 2 × cp 2; cp 4 zigzag 1.7e-5,
# balanced 9.7e-6), gradients by 1.5e-6 and losses by 7.6e-7.
WEIGHT_TOL = {"atol": 1e-4, "rtol": 1e-5}
EOS = ByteTokenizer().eos_id
# Short documents, some of one character; with data.seed 6 the first rows begin or end with
# a one-token document (checked by _assert_hard_documents).
DOCUMENT_LENGTHS = [1, 5, 2, 13, 3, 17, 9, 30, 1, 11, 6, 23, 2, 40, 7, 1, 19, 4, 70, 3]
DATA_SEED = 6
_cache: dict = {}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A JSONL file of the documents (source 'files': one document per line)."""
    directory = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    with (directory / "documents.jsonl").open("w") as f:
        for length in DOCUMENT_LENGTHS:
            text = "".join(rng.choice("abcdefgh ") for _ in range(length))
            f.write(json.dumps({"text": text}) + "\n")
    return str(directory)


def _options(run_dir: str, corpus: str, *, data: dict | None = None,
             parallel: dict | None = None, train: dict | None = None) -> TrainOptions:
    return tiny_options(
        run_dir,
        data={"source": "files", "path": corpus, "seed": DATA_SEED, "documents": True,
              **(data or {})},
        parallel={"dp": 1, "cp": 1, **(parallel or {})},
        train={"seq_len": SEQ_LEN, "steps": STEPS, **(train or {})},
    )


def _assert_hard_documents(options: TrainOptions, cp: int) -> None:
    """The rows the runs train on hold a document of length 1 and lengths that are not
    multiples of 2 × cp (read from the loader's documents, which the data tests pin)."""
    trainer = Trainer(replace(options, parallel=replace(options.parallel, dp=1, cp=1)))
    rows = [row for index in range(STEPS) for row in trainer.loader.documents(index)]
    lengths = [n for row in rows for n in row]
    assert 1 in lengths
    assert any(n % (2 * cp) for n in lengths)
    assert any(len(row) > 1 for row in rows)


def _assert_same_training(got: dict, want: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL)
    for step, (g_step, w_step) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        for name in w_step:
            torch.testing.assert_close(g_step[name], w_step[name], **TOL,
                                       msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
    for name in want["weights"]:
        torch.testing.assert_close(got["weights"][name], want["weights"][name], **WEIGHT_TOL)


def _single(tmp_path_factory, corpus: str, *, global_batch: int = 2, **data) -> dict:
    key = ("single", global_batch, tuple(sorted(data.items())))
    if key not in _cache:
        run_dir = str(tmp_path_factory.mktemp("single"))
        _cache[key] = record_steps(
            _options(run_dir, corpus, data=data, train={"global_batch": global_batch}), STEPS)
    return _cache[key]


# ------------------------------------------------------------------ exact masking, at CP=1
def _cut_at_eos(row: list[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each document of a row: each ends at its eos, or at the row's end."""
    spans, start = [], 0
    for t, token in enumerate(row):
        if token == EOS or t == len(row) - 1:
            spans.append((start, t + 1))
            start = t + 1
    return spans


def _reference_loss(model: Transformer, inputs: torch.Tensor, labels: torch.Tensor, *,
                    per_document: bool) -> float:
    """Mean cross entropy over the labels that stay inside a document (every label but an
    eos token's), float64; ``per_document``: each document run alone (positions from 0),
    else each whole row."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in range(inputs.shape[0]):
            spans = (_cut_at_eos(inputs[row].tolist()) if per_document
                     else [(0, inputs.shape[1])])
            for start, stop in spans:
                logits = model(inputs[row : row + 1, start:stop])[0].double()
                counted = inputs[row, start:stop] != EOS
                total += F.cross_entropy(logits[counted], labels[row, start:stop][counted],
                                         reduction="sum").item()
                count += int(counted.sum())
    return total / count


@pytest.mark.parametrize("document_positions", [True, False])
def test_step0_loss_is_each_document_alone(tmp_path, corpus: str,
                                           document_positions: bool) -> None:
    """The first step's loss is that of every document run on its own; a run without
    documents (and the whole-row reference) is not, so a leak across a boundary would show."""
    options = _options(str(tmp_path), corpus, data={"document_positions": document_positions})
    _assert_hard_documents(options, cp=2)
    trainer = Trainer(options)
    model = Transformer(options.model)
    model.load_state_dict(trainer.model.state_dict())  # the initial weights, before the step
    inputs, labels = trainer.loader.batch(0)  # the plain batch: labels not masked
    want = _reference_loss(model, inputs, labels, per_document=True)
    got = trainer.step().loss
    assert got == pytest.approx(want, abs=1e-5)

    whole_rows = _reference_loss(model, inputs, labels, per_document=False)
    assert abs(whole_rows - want) > 1e-3
    plain = Trainer(_options(str(tmp_path / "plain"), corpus, data={"documents": False,
                                                                    "document_positions": True}))
    assert abs(plain.step().loss - want) > 1e-3


@pytest.mark.parametrize("document_positions", [True, False])
def test_rope_positions_restart_in_each_document(tmp_path, corpus: str,
                                                 document_positions: bool) -> None:
    """The positions the model rotates by are each token's offset in its document (or its
    position in the row), in the layout's local order, for every row and rank of a ring."""
    options = _options(str(tmp_path), corpus, data={"document_positions": document_positions})
    trainer = Trainer(options)
    packed = trainer.loader.packed(0)
    for row, documents in enumerate(packed.documents):
        want = []
        for start, stop in _cut_at_eos(packed.inputs[row].tolist()):
            want += range(stop - start) if document_positions else range(start, stop)
        want = torch.tensor(want)
        for cp in (1, 4):
            layout = make_layout("balanced", cp, SEQ_LEN, documents=documents)
            for rank in range(cp):
                ring = RingContext.for_documents(documents, layout=layout, rank=rank,
                                                 restart_positions=document_positions)
                assert torch.equal(ring.positions(torch.device("cpu")),
                                   layout.shard(want[None], rank)[0])
    seen = []
    trainer.model.register_forward_pre_hook(
        lambda module, args: seen.append(args[1].positions(torch.device("cpu"))))
    trainer.step()
    assert len(seen) == len(packed.documents)  # one forward per row
    for row, positions in enumerate(seen):
        spans = _cut_at_eos(packed.inputs[row].tolist())
        want = [t - (start if document_positions else 0)
                for start, stop in spans for t in range(start, stop)]
        assert positions.tolist() == want


def test_document_positions_false_is_exact_over_a_ring(tmp_path_factory, corpus: str) -> None:
    """With positions over the whole row, CP=2 (balanced and zigzag) still equals CP=1."""
    want = _single(tmp_path_factory, corpus, document_positions=False)
    run_dir = str(tmp_path_factory.mktemp("cp2"))
    runs = [_options(run_dir, corpus, data={"document_positions": False},
                     parallel={"cp": 2, "layout": layout}) for layout in ("auto", "zigzag")]
    for rank_runs in run_gloo_ranks(2, rank_record_steps, runs, STEPS, timeout_seconds=300):
        for got in rank_runs:
            _assert_same_training(got, want)


# ------------------------------------------------------------------ rings and replicas
def _world4(tmp_path_factory, corpus: str) -> list[list[dict]]:
    """One launch of 4 ranks: cp 4 (auto = balanced, zigzag), dp 2 × cp 2 (replicated, FSDP),
    cp 4 with the whole layout."""
    if "world4" not in _cache:
        run_dir = str(tmp_path_factory.mktemp("world4"))
        runs = [
            _options(run_dir, corpus, parallel={"cp": 4, "layout": "auto"}),
            _options(run_dir, corpus, parallel={"cp": 4, "layout": "zigzag"}),
            _options(run_dir, corpus, parallel={"dp": 2, "cp": 2}, train={"global_batch": 4}),
            _options(run_dir, corpus, parallel={"dp": 2, "cp": 2, "fsdp": True},
                     train={"global_batch": 4}),
            _options(run_dir, corpus, parallel={"cp": 4, "layout": "whole"}),
        ]
        assert runs[0].layout_kind == "balanced"
        _cache["world4"] = run_gloo_ranks(4, rank_record_steps_counting_reduce_scatters, runs,
                                          STEPS, timeout_seconds=300)
    return _cache["world4"]


@pytest.mark.parametrize("layout", ["auto", "zigzag", "whole"])
def test_cp4_equals_cp1(tmp_path_factory, corpus: str, layout: str) -> None:
    """Every rank of a 4-rank ring ends each step with the one-device gradients."""
    _assert_hard_documents(_options("unused", corpus), cp=4)
    want = _single(tmp_path_factory, corpus)
    for rank_runs in _world4(tmp_path_factory, corpus):
        _assert_same_training(rank_runs[{"auto": 0, "zigzag": 1, "whole": 4}[layout]], want)


@pytest.mark.parametrize("fsdp", [False, True])
def test_dp2_cp2_equals_one_device(tmp_path_factory, corpus: str, fsdp: bool) -> None:
    """Two replicas of a 2-rank ring, two rows each, equal one device on the same 4 rows:
    the loss is the mean over the global batch's counted labels, however rows are split."""
    want = _single(tmp_path_factory, corpus, global_batch=4)
    for rank_runs in _world4(tmp_path_factory, corpus):
        _assert_same_training(rank_runs[3 if fsdp else 2], want)


def test_fsdp_reduces_every_row(tmp_path_factory, corpus: str) -> None:
    """Under FSDP every row's backward reduce-scatters into the gradient shards: one per FSDP
    unit (each block and the root) per row, 2 rows per rank (global batch 4 over dp 2), so
    no rank ever holds the unsharded float32 gradients the plan does not count; the
    replicated runs issue none."""
    units = TINY_MODEL.n_layers + 1
    for rank_runs in _world4(tmp_path_factory, corpus):
        assert [run["reduce_scatters"] for run in rank_runs] == [0, 0, 0, STEPS * units * 2, 0]


def test_documents_train(tmp_path_factory, corpus: str) -> None:
    """The runs compared above train for real (a test of the reference itself)."""
    losses = _single(tmp_path_factory, corpus)["losses"]
    assert losses[-1] < losses[0] - 0.5


# ------------------------------------------------------------------ options
def test_auto_layout_follows_documents(tmp_path, corpus: str) -> None:
    """auto is balanced with documents and zigzag without; sequence lengths are checked for
    the layout auto chose (balanced: a multiple of cp; zigzag, and passkey evaluation beside
    balanced training: of 2 × cp)."""
    with_documents = _options(str(tmp_path), corpus, parallel={"cp": 4},
                              train={"seq_len": 68})
    assert with_documents.layout_kind == "balanced"
    assert with_documents.eval_layout_kind == "zigzag"
    without = tiny_options(str(tmp_path), parallel={"cp": 4})
    assert without.parallel.layout == "auto" and without.layout_kind == "zigzag"


def _spec(corpus: str, **sections: dict) -> dict:
    spec = {"model": {"preset": "debug"},
            "data": {"source": "files", "path": corpus},
            "train": {"seq_len": 64}}
    for name, fields in sections.items():
        spec[name] = {**spec.get(name, {}), **fields}
    return spec


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"parallel": {"layout": "balanced"}},
         "parallel.layout: 'balanced' lays each sequence out by its documents and needs "
         "data.documents: true; use 'auto' (zigzag without documents) or another layout"),
        ({"parallel": {"layout": "whole"}},
         "parallel.layout: 'whole' lays each sequence out by its documents and needs "
         "data.documents: true; use 'auto' (zigzag without documents) or another layout"),
        ({"data": {"document_positions": False}},
         "data.document_positions: false only applies with documents: true"),
        ({"data": {"documents": True}, "parallel": {"cp": 4}, "train": {"seq_len": 66}},
         "train.seq_len: 66 cannot be split by layout 'balanced' over cp=4 ranks; use a "
         "multiple of 4"),
        ({"parallel": {"cp": 4}, "train": {"seq_len": 68}},
         "train.seq_len: 68 cannot be split by layout 'zigzag' over cp=4 ranks; use a "
         "multiple of 8"),
        ({"data": {"documents": True}, "parallel": {"cp": 4},
          "eval": {"passkey_lengths": [260]}},
         "eval.passkey_lengths: 260 cannot be split by layout 'zigzag' over cp=4 ranks; use a "
         "multiple of 8"),
    ],
)
def test_bad_combinations_are_one_line_errors(corpus: str, sections: dict,
                                              message: str) -> None:
    with pytest.raises(JobSpecError) as info:
        parse_job_spec(_spec(corpus, **sections))
    assert message in str(info.value)
    assert "\n" not in str(info.value).strip()
