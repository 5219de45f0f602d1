"""``ringray plan`` times a masked ring from the step plan the ring runs (issue 27): the walk
of every rank's planned steps (:mod:`ringray.capacity.masked`) by hand on a ring of 2, its
bytes equal to the transfer plan's, and the report's lines for packed documents
(``--documents``) and sliding-window layers."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from ringray.accelerators import parse_cluster
from ringray.attention import make_layout
from ringray.attention.documents import check_documents
from ringray.attention.transfers import plan_transfers
from ringray.capacity import PlanInputs, plan
from ringray.capacity.masked import RingShape, masked_ring, plain_ring
from ringray.cli import app
from ringray.data.mixes import document_lengths
from ringray.model import model_preset

# One pair costs 1 s (4 FLOP at 4 FLOP/s); a K/V row (2 B) 10 s and a dK/dV row (8 B) 40 s.
SLOW = RingShape(q_heads=1, kv_heads=1, head_dim=1, batch=1, kv_bytes=1, peak_flops=4,
                 link_bytes_per_second=0.2)


def test_a_ring_of_two_by_hand():
    """Zigzag over 2 ranks, 8 tokens, one causal document: rank 0 holds 0, 1, 6, 7 and rank 1
    holds 2, 3, 4, 5. Visible pairs: each own block 10, each other block 8. Rank 1 reads rows
    0 and 1 of rank 0's block (2 rows), rank 0 all 4 of rank 1's.

    Rank 0 forward: round 1 sends 2 rows and receives 4 (the busier way: 4 x 10 s = 40 s)
    while the own block computes 10 s -> 40; then rank 1's block, 8 -> 48. Backward: rank 1's
    block again (kept from the forward), 2.5 x 8 = 20; then the own block, 25 s, while rank
    1's dK/dV rows go back (4 x 40 s = 160) and its return of 2 rows arrives -> 160. Total
    228 s, compute 63, exposed 40 - 10 + 160 - 25 = 165. Rank 1 mirrors it: 228.
    The plain ring relays whole blocks: forward 40 then 8; backward 4 x (10 + 40) = 200
    then 20 -> 268, exposed 30 + 175 = 205. Bytes: K/V rows 2 + 4 at 2 B, dK/dV rows 4 + 2
    at 8 B = 60 against the plain ring's 2 x 4 x (2 x 2 + 8) = 96."""
    layout = make_layout("zigzag", 2, 8)
    ring = masked_ring(layout, None, None, SLOW)
    assert (ring.seconds, ring.compute_seconds, ring.exposed_seconds) == (228, 63, 165)
    assert (ring.bytes_sent, ring.plain_bytes) == (60, 96)
    assert ring.bytes_fraction == 0.625
    assert ring.useful_flops == 36 * 3.5 * 4
    plain = plain_ring(layout, None, None, SLOW)
    assert (plain.seconds, plain.compute_seconds, plain.exposed_seconds) == (268, 63, 205)
    assert plain.bytes_fraction == 1.0
    fast = dataclasses.replace(SLOW, link_bytes_per_second=1e9)
    assert masked_ring(layout, None, None, fast).exposed_seconds == 0
    assert masked_ring(layout, None, None, fast).seconds == pytest.approx(63)


@pytest.mark.parametrize("layout", ["balanced", "whole"])
def test_the_walk_sends_what_the_transfer_plan_sends(layout):
    """The bytes the walk counts are the transfer plan's (bf16 K/V rows, float32 dK/dV):
    on the stdlib mix at 16k over 8 ranks, whole 33.8 % of the plain ring, balanced 70.5 %
    (the figures of ``benchmarks/ring_transfers.py``)."""
    documents = document_lengths("stdlib", 16384)
    lay = make_layout(layout, 8, 16384, documents=documents)
    shape = RingShape(q_heads=8, kv_heads=2, head_dim=64, peak_flops=989e12,
                      link_bytes_per_second=50e9)
    ring = masked_ring(lay, documents, None, shape)
    transfers = plan_transfers(lay, True, check_documents(documents, 16384))
    want = sum(transfers.counts(r).bytes_sent(2 * 2 * 64 * 2, 2 * 2 * 64 * 4) for r in range(8))
    assert ring.bytes_sent == want
    assert ring.bytes_fraction == pytest.approx({"balanced": 0.705, "whole": 0.338}[layout],
                                                abs=5e-4)


def _inputs(**changes) -> PlanInputs:
    fields = dict(name="masked", model=model_preset("debug", dim=256, n_layers=4, n_heads=8,
                                                    n_kv_heads=2, ffn_hidden=512),
                  seq_len=16384, global_batch=1, dp=1, cp=8, layout="whole", bf16=True,
                  activation_checkpointing="none")
    return PlanInputs(**{**fields, **changes})


def test_the_report_has_a_line_per_mask():
    """Packed documents: one line for the full causal layers; a model with a window on two
    of its four layers: one line per mask, with the layer counts. Without either, no step
    plan (the overlap rule is the plan)."""
    cluster = parse_cluster("8x8xH100")
    documents = tuple(document_lengths("stdlib", 16384))
    report = plan(_inputs(documents=documents, documents_spec="stdlib"), cluster)
    assert [(line.mask, line.layers) for line in report.step_plan] == [("full causal", 4)]
    text = report.format()
    assert "ring step plan (whole layout, documents stdlib (7 in a sequence)" in text
    assert "full causal (4 layers)" in text and "34% of the plain ring's bytes" in text
    assert report.to_dict()["step_plan"][0]["ringray"]["bytes_fraction"] == pytest.approx(
        0.338, abs=5e-4)

    windowed = dataclasses.replace(_inputs().model, sliding_window=1024, sliding_layers=(1, 3))
    report = plan(_inputs(model=windowed, layout="zigzag"), cluster)
    assert [(line.mask, line.layers) for line in report.step_plan] == [
        ("full causal", 2), ("window 1024", 2)]
    window = report.step_plan[1]
    assert window.ringray.bytes_fraction < report.step_plan[0].ringray.bytes_fraction
    assert window.ringray.seconds < window.plain.seconds
    assert plan(_inputs(layout="zigzag"), cluster).step_plan == ()


def test_plan_documents_on_the_command_line():
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "jobs/quickstart.yaml", "--cluster", "1x8xH100",
                                 "--documents", "lognormal:512"])
    assert result.exit_code == 0, result.output
    assert "ring step plan (zigzag layout, documents lognormal:512" in result.output
    result = runner.invoke(app, ["plan", "jobs/quickstart.yaml", "--cluster", "1x8xH100",
                                 "--documents", "zipf:2"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --documents: unknown spec 'zipf:2'; valid: stdlib, lognormal:MEAN[:SIGMA], "
        "fixed:LEN"]
    result = runner.invoke(app, ["plan", "jobs/quickstart.yaml", "--cluster", "1x8xH100",
                                 "--set", "data.documents=true", "--set", "parallel.layout=auto"])
    assert result.exit_code == 0, result.output
    assert ("ring step plan: the job packs documents (data.documents); give --documents SPEC"
            in result.output)
