"""The job's Prometheus series, kept by its controller and served over HTTP.

    metrics = JobMetrics("quickstart")
    url = metrics.serve("127.0.0.1", 9477)           # http://127.0.0.1:9477/metrics
    metrics.placed(dp=2, cp=2, nodes=["5903eec0", ...])
    metrics.step(stats)                              # after every step
    metrics.state("checkpointing"); metrics.checkpoint(seconds=1.2, step=100)

Every series comes from :mod:`ringray.metrics.catalog`. Each job has a registry of its own
(no module-level state), so several controllers in one process never share a series. Per-rank
and per-ring series are dropped when the job is placed anew, so a rank that no longer exists
after a shrink does not linger with its last value.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from annotated_types import Ge, Le
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

from ringray.metrics.catalog import (
    CATALOG,
    CONTROLLER_STATES,
    JOB,
    RANK,
    RESTART_REASONS,
    RING,
    MetricSpec,
)
from ringray.train.step_stats import StepStats

_KINDS = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True, kw_only=True)
class MetricsOptions:
    """Where a job's controller serves its metrics (the job spec's ``metrics`` section)."""

    address: str = "127.0.0.1"
    """IP address or host name the controller serves Prometheus metrics on: loopback by
    default; 0.0.0.0 lets a cluster's Prometheus scrape the head node."""
    port: Annotated[int, Ge(0), Le(65535)] | None = 9477
    """Port of the /metrics endpoint (0: any free port, shown at start; null: no endpoint)."""

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.address)
            return
        except ValueError:
            pass
        labels = self.address.rstrip(".").split(".")
        if len(self.address) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
            raise ValueError(f"address: {self.address!r} is not an IP address or a host name; "
                             f"e.g. 127.0.0.1, 0.0.0.0 or head.example.com")


def _make(spec: MetricSpec, registry: CollectorRegistry):
    kwargs = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
    # prometheus-client adds the _total suffix itself; the catalog spells counters in full.
    name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
    return _KINDS[spec.kind](name, spec.help, spec.labels, registry=registry, **kwargs)


class JobMetrics:
    """One job's series (the ``job`` label is its name)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.registry = CollectorRegistry()
        self._series = {spec.name: _make(spec, self.registry) for spec in CATALOG}
        self._nodes: tuple[str, ...] = ()  # node label of each rank
        self._cp = 1
        self._replica_groups = 1
        self._server = None
        # Every job-level series exists from the start (counters at 0, so increase() sees
        # the first restart; histograms empty), and a dashboard shows 0 rather than nothing.
        for spec in CATALOG:
            if spec.labels == JOB:
                self._job(spec.name)
        for reason in RESTART_REASONS:
            self._series["ringray_restarts_total"].labels(job=job, reason=reason)
            self._series["ringray_replica_groups_lost_total"].labels(job=job, reason=reason)
        for state in CONTROLLER_STATES:
            self._series["ringray_controller_state"].labels(job=job, state=state).set(0)

    def _job(self, name: str):
        return self._series[name].labels(job=self.job)

    def serve(self, address: str, port: int) -> str:
        """Serve ``/metrics`` on ``address:port`` (port 0: any free one); returns the URL.

        Raises:
            OSError: the address cannot be bound (e.g. the port is taken).
        """
        self._server, _ = start_http_server(port, addr=address, registry=self.registry)
        host, bound = self._server.server_address[:2]
        return f"http://{host}:{bound}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def render(self) -> bytes:
        """The exposition text, as a scrape would get it."""
        return generate_latest(self.registry)

    # ----------------------------------------------------------------- the service
    def state(self, state: str) -> None:
        gauge = self._series["ringray_controller_state"]
        for name in CONTROLLER_STATES:
            gauge.labels(job=self.job, state=name).set(1 if name == state else 0)

    def target(self, world_size: int, *, replica_groups: int = 1) -> None:
        self._job("ringray_world_size_target").set(world_size)
        self._replica_groups = replica_groups
        self._job("ringray_replica_groups").set(replica_groups)

    def replica_lost(self, reason: str) -> None:
        self._series["ringray_replica_groups_lost_total"].labels(job=self.job,
                                                                 reason=reason).inc()

    def replica_healed(self, seconds: float) -> None:
        self._job("ringray_replica_heals_total").inc()
        self._job("ringray_replica_heal_duration_seconds").observe(seconds)

    def placed(self, *, dp: int, cp: int, nodes: Sequence[str]) -> None:
        """A new placement: the world size, and fresh per-rank and per-ring series."""
        for spec in CATALOG:
            if spec.labels in (RANK, RING):
                self._series[spec.name].clear()
        self._nodes, self._cp = tuple(node[:8] for node in nodes), cp
        self._job("ringray_world_size").set(dp * cp)
        for rank in range(dp * cp):  # counters start at 0, so rate() sees the first step
            self._series["ringray_ring_sent_bytes_total"].labels(**self._rank(rank))
            self._series["ringray_ring_skipped_bytes_total"].labels(**self._rank(rank))

    def stopped(self) -> None:
        """No ring runs (between a teardown and the next start, or at the end)."""
        self._job("ringray_world_size").set(0)

    def restart(self, reason: str) -> None:
        self._series["ringray_restarts_total"].labels(job=self.job, reason=reason).inc()

    def recovered(self, seconds: float) -> None:
        self._job("ringray_recovery_duration_seconds").observe(seconds)

    def resized(self) -> None:
        self._job("ringray_resizes_total").inc()

    def checkpoint(self, *, seconds: float, step: int) -> None:
        self._job("ringray_checkpoint_duration_seconds").observe(seconds)
        self._job("ringray_last_checkpoint_step").set(step)
        self._job("ringray_last_checkpoint_timestamp_seconds").set(time.time())

    def task_score(self, *, task: str, length: int, score: float) -> None:
        self._series["ringray_eval_task_score_ratio"].labels(
            job=self.job, task=task, length=str(length)).set(score)

    # ----------------------------------------------------------------- a step
    def _rank(self, rank: int) -> dict[str, str]:
        node = self._nodes[rank] if rank < len(self._nodes) else ""
        return {"job": self.job, "ring": str(rank // self._cp), "rank": str(rank),
                "node": node}

    def step(self, stats: StepStats) -> None:
        self._job("ringray_step_duration_seconds").observe(stats.step_seconds)
        self._job("ringray_tokens_per_second").set(stats.tokens_per_second)
        if stats.mfu is not None:
            self._job("ringray_model_flops_utilization_ratio").set(stats.mfu)
        self._job("ringray_loss").set(stats.loss)
        self._job("ringray_grad_norm").set(stats.grad_norm)
        self._job("ringray_learning_rate").set(stats.learning_rate)
        self._job("ringray_training_step").set(stats.step)
        groups = self._replica_groups
        participating = len(stats.replicas_participating) or 1
        self._job("ringray_replica_groups_participating").set(participating)
        if participating < groups:
            self._job("ringray_replica_degraded_steps_total").inc()
        if stats.nonfinite_skipped:
            self._job("ringray_nonfinite_steps_skipped_total").inc(stats.nonfinite_skipped)
        if stats.samples_dropped:
            self._job("ringray_replica_samples_dropped_total").inc(stats.samples_dropped)
        self._job("ringray_last_step_timestamp_seconds").set(time.time())
        per_rank = (
            ("ringray_attention_compute_seconds", stats.attention_compute_seconds),
            ("ringray_exposed_comm_seconds", stats.exposed_comm_seconds),
            ("ringray_transfer_exposed_seconds", stats.transfer_exposed_seconds),
            ("ringray_peer_wait_seconds", stats.peer_wait_seconds),
            ("ringray_a2a_seconds", stats.a2a_seconds),
            ("ringray_peak_memory_bytes", stats.peak_memory_bytes_per_rank),
        )
        for name, values in per_rank:
            for rank, value in enumerate(values):
                self._series[name].labels(**self._rank(rank)).set(value)
        for rank, sent in enumerate(stats.ring_bytes_sent):
            self._series["ringray_ring_sent_bytes_total"].labels(**self._rank(rank)).inc(sent)
        for rank, skipped in enumerate(stats.ring_bytes_skipped):
            self._series["ringray_ring_skipped_bytes_total"].labels(
                **self._rank(rank)).inc(skipped)
        per_ring = (
            ("ringray_ring_overlap_ratio", stats.overlap_ratio_per_ring),
            ("ringray_load_imbalance_ratio", stats.load_imbalance_per_ring),
        )
        for name, values in per_ring:
            for ring, value in enumerate(values):
                self._series[name].labels(job=self.job, ring=str(ring)).set(value)
