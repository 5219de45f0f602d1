"""The exporter's output: exactly the catalog's series, Prometheus conventions, the values of
a step, per-rank series dropped on a new placement, and an exposition that promtool accepts.
Parsed with prometheus-client's own parser; checked with Debian's promtool (CI installs the
`prometheus` package)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringray.metrics.catalog import (
    CATALOG,
    CONTROLLER_STATES,
    RESTART_REASONS,
    exported_series_names,
    metric,
)
from ringray.metrics.exporter import JobMetrics
from ringray.train.step_stats import StepStats

UNIT_SUFFIXES = ("_seconds", "_bytes", "_ratio", "_total", "_second", "_rate")


def _stats(step: int = 3) -> StepStats:
    return StepStats(
        step=step, loss=2.5, grad_norm=0.75, learning_rate=1e-3, step_seconds=0.2,
        tokens=4096, tokens_per_second=20480.0,
        attention_compute_seconds=[0.1, 0.12, 0.09, 0.11], exposed_comm_seconds=[0.01, 0, 0, 0.02],
        overlap_ratio=0.8, load_imbalance=1.1, mfu=0.4, peak_memory_bytes=4000,
        overlap_ratio_per_ring=[0.9, 0.8], load_imbalance_per_ring=[1.05, 1.1],
        ring_bytes_sent=[1000, 1000, 2000, 2000], peak_memory_bytes_per_rank=[1, 2, 3, 4000],
        a2a_seconds=[0.0, 0.0, 0.003, 0.004],
        transfer_exposed_seconds=[0.01, 0, 0, 0.005], peer_wait_seconds=[0, 0, 0, 0.015],
        peer_wait_seconds_max=0.015, ring_transfer_seconds=[0.05, 0.05, 0.05, 0.05],
        ring_bytes_skipped=[0, 100, 200, 300],
    )


def _samples(metrics: JobMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_catalog_follows_prometheus_conventions() -> None:
    names = [spec.name for spec in CATALOG]
    assert len(names) == len(set(names))
    for spec in CATALOG:
        assert spec.name.startswith("ringray_"), spec.name
        assert spec.kind in ("gauge", "counter", "histogram")
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        assert spec.help.endswith("."), spec.name
        assert "job" in spec.labels
        assert not {"step", "run", "run_id", "sequence"} & set(spec.labels), spec.name
        assert bool(spec.buckets) == (spec.kind == "histogram")
    with pytest.raises(KeyError, match="'ringray_nope' is not in ringray.metrics.catalog"):
        metric("ringray_nope")


def test_exporter_serves_exactly_the_catalog() -> None:
    metrics = JobMetrics("j")
    metrics.placed(dp=2, cp=2, nodes=["aaaaaaaa11", "aaaaaaaa11", "bbbbbbbb22", "bbbbbbbb22"])
    metrics.step(_stats())
    metrics.checkpoint(seconds=1.5, step=3)
    metrics.task_score(task="niah_single_1", length=4096, score=0.25)
    names = {name for name, _ in _samples(metrics)}
    served = {n for n in names if not n.endswith("_created")}
    assert served == exported_series_names()


def test_a_step_sets_its_values_on_the_right_labels() -> None:
    metrics = JobMetrics("j")
    metrics.target(4)
    metrics.placed(dp=2, cp=2, nodes=["aaaaaaaa11", "aaaaaaaa11", "bbbbbbbb22", "bbbbbbbb22"])
    metrics.step(_stats())
    metrics.step(_stats(step=4))
    samples = _samples(metrics)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"job": "j", **labels}.items())))]

    assert value("ringray_loss") == 2.5 and value("ringray_training_step") == 4
    metrics.task_score(task="ruler_vt", length=8192, score=0.75)
    assert _samples(metrics)[("ringray_eval_task_score_ratio", tuple(sorted(
        {"job": "j", "task": "ruler_vt", "length": "8192"}.items())))] == 0.75
    assert value("ringray_model_flops_utilization_ratio") == 0.4
    assert value("ringray_world_size") == 4 and value("ringray_world_size_target") == 4
    assert value("ringray_step_duration_seconds_count") == 2
    assert value("ringray_attention_compute_seconds", ring="1", rank="2",
                 node="bbbbbbbb") == 0.09
    assert value("ringray_exposed_comm_seconds", ring="0", rank="1", node="aaaaaaaa") == 0
    assert value("ringray_a2a_seconds", ring="1", rank="2", node="bbbbbbbb") == 0.003
    # Rank 3's exposed 0.02 s: 0.005 s of transfer not hidden, 0.015 s waiting for a peer.
    assert value("ringray_transfer_exposed_seconds", ring="1", rank="3",
                 node="bbbbbbbb") == 0.005
    assert value("ringray_peer_wait_seconds", ring="1", rank="3", node="bbbbbbbb") == 0.015
    assert value("ringray_peer_wait_seconds", ring="0", rank="0", node="aaaaaaaa") == 0
    assert value("ringray_ring_sent_bytes_total", ring="1", rank="3", node="bbbbbbbb") == 4000
    assert value("ringray_ring_skipped_bytes_total", ring="1", rank="3", node="bbbbbbbb") == 600
    assert value("ringray_peak_memory_bytes", ring="1", rank="3", node="bbbbbbbb") == 4000
    assert value("ringray_ring_overlap_ratio", ring="0") == 0.9
    assert value("ringray_load_imbalance_ratio", ring="1") == 1.1


def test_state_is_one_hot_and_restarts_count_by_reason() -> None:
    metrics = JobMetrics("j")
    metrics.state("recovering")
    metrics.restart("node_died")
    metrics.restart("node_died")
    metrics.recovered(4.5)
    metrics.resized()
    samples = _samples(metrics)
    states = {dict(labels)["state"]: v for (name, labels), v in samples.items()
              if name == "ringray_controller_state"}
    assert states == {s: (1.0 if s == "recovering" else 0.0) for s in CONTROLLER_STATES}
    restarts = {dict(labels)["reason"]: v for (name, labels), v in samples.items()
                if name == "ringray_restarts_total"}
    assert restarts == {r: (2.0 if r == "node_died" else 0.0) for r in RESTART_REASONS}
    assert samples[("ringray_recovery_duration_seconds_sum", (("job", "j"),))] == 4.5
    assert samples[("ringray_resizes_total", (("job", "j"),))] == 1


def test_replica_groups_count_degraded_steps_drops_losses_and_heals() -> None:
    """Two replica groups: a step both took is not degraded; one group alone is (its slice,
    2 sequences, dropped); a loss counts by reason, a heal with its seconds."""
    from dataclasses import replace

    metrics = JobMetrics("j")
    metrics.target(8, replica_groups=2)
    metrics.step(replace(_stats(step=1), replicas_participating=[0, 1], quorum_size=2))
    metrics.step(replace(_stats(step=2), replicas_participating=[0], quorum_size=1,
                         samples_dropped=2))
    metrics.replica_lost("node_died")
    metrics.replica_healed(0.25)
    samples = _samples(metrics)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"job": "j", **labels}.items())))]

    assert value("ringray_replica_groups") == 2
    assert value("ringray_replica_groups_participating") == 1
    assert value("ringray_replica_degraded_steps_total") == 1
    assert value("ringray_replica_samples_dropped_total") == 2
    assert value("ringray_replica_groups_lost_total", reason="node_died") == 1
    assert value("ringray_replica_groups_lost_total", reason="hang") == 0
    assert value("ringray_replica_heals_total") == 1
    assert value("ringray_replica_heal_duration_seconds_sum") == 0.25
    # Without replica groups a step is one group of one: never degraded.
    plain = JobMetrics("j")
    plain.target(4)
    plain.step(_stats())
    assert _samples(plain)[("ringray_replica_degraded_steps_total", (("job", "j"),))] == 0


def test_a_new_placement_drops_the_old_ranks() -> None:
    """After a shrink from 4 ranks to 2, ranks 2 and 3 are gone rather than frozen."""
    metrics = JobMetrics("j")
    metrics.placed(dp=2, cp=2, nodes=["a" * 8] * 4)
    metrics.step(_stats())
    metrics.placed(dp=1, cp=2, nodes=["a" * 8] * 2)
    ranks = {dict(labels).get("rank") for (name, labels) in _samples(metrics)
             if name == "ringray_ring_sent_bytes_total"}
    assert ranks == {"0", "1"}
    rings = {dict(labels).get("ring") for (name, labels) in _samples(metrics)
             if name == "ringray_ring_overlap_ratio"}
    assert rings == set()


def test_serve_answers_a_scrape_and_promtool_accepts_it() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install Debian's `prometheus` package (.ci/run does)"
    metrics = JobMetrics("j")
    url = metrics.serve("127.0.0.1", 0)
    try:
        metrics.placed(dp=1, cp=2, nodes=["a" * 8] * 2)
        metrics.step(StepStats(**{**_stats().__dict__, "attention_compute_seconds": [0.1, 0.2],
                                  "exposed_comm_seconds": [0, 0],
                                  "overlap_ratio_per_ring": [1.0],
                                  "load_imbalance_per_ring": [1.0],
                                  "ring_bytes_sent": [10, 10],
                                  "peak_memory_bytes_per_rank": [1, 1]}))
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
    finally:
        metrics.close()
    assert b'ringray_loss{job="j"} 2.5' in body
    check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                           timeout=60)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), (
        check.stdout.decode() + check.stderr.decode())
