"""Every metric ringray exports, in one place: name, type, help, labels.

    from ringray.metrics.catalog import CATALOG, metric
    metric("ringray_ring_overlap_ratio").labels    # ("job", "ring")

Conventions (Prometheus's): a ``ringray_`` prefix; base units in the name (``_seconds``,
``_bytes``, ``_ratio``); ``_total`` only on counters; labels with a bounded set of values:
the job's name, a ring's index, a rank, a node, a state or a restart reason. Never a step,
a run id or a sequence. Dashboards, alert rules and tests take their names from here.

Every figure is also in the run's ``steps.jsonl`` / ``events.jsonl`` (a :class:`StepStats`
field per step, the controller's events), for ``ringray report`` and for people without a
Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass

# Step durations from 10 ms (a tiny CPU job's step) to an hour (a long-context GPU step).
STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)
# Checkpoints and recoveries: a second to half an hour.
SLOW_OPERATION_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

JOB = ("job",)
RING = ("job", "ring")
RANK = ("job", "ring", "rank", "node")

# The controller's states (``ringray.cluster.status.JobState`` values): the ``state`` label.
CONTROLLER_STATES = (
    "placing", "starting", "running", "checkpointing", "evaluating", "recovering",
    "resizing", "finished", "failed", "stopped",
)
# Why a ring was rebuilt (``ringray.cluster.policy.FailureKind`` values): the ``reason`` label.
RESTART_REASONS = ("actor_died", "node_died", "hang", "preempted", "worker_error", "startup",
                   "checkpoint_failed")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "gauge", "counter" or "histogram"
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()  # histograms only
    requires: str = ""
    """The job-file setting without which the series never exists (its panel stays empty);
    "" for the series every job exports."""


CATALOG: tuple[MetricSpec, ...] = (
    # ---- the job's training
    MetricSpec("ringray_step_duration_seconds", "histogram",
               "Wall-clock seconds of one optimizer step.", JOB, STEP_SECONDS_BUCKETS),
    MetricSpec("ringray_tokens_per_second", "gauge",
               "Tokens of the global batch per second, last step.", JOB),
    MetricSpec("ringray_model_flops_utilization_ratio", "gauge",
               "Model FLOPs (causal attention counted at half) per second over the devices' "
               "peak, last step.", JOB),
    MetricSpec("ringray_loss", "gauge", "Token-mean cross-entropy of the last step.", JOB),
    MetricSpec("ringray_grad_norm", "gauge",
               "Global L2 norm of the gradients before clipping, last step.", JOB),
    MetricSpec("ringray_learning_rate", "gauge", "Learning rate of the last step.", JOB),
    MetricSpec("ringray_training_step", "gauge",
               "Optimizer steps completed (goes back when a recovery restores a checkpoint).",
               JOB),
    MetricSpec("ringray_last_step_timestamp_seconds", "gauge",
               "Unix time the last step completed.", JOB),
    # ---- the rings
    MetricSpec("ringray_attention_compute_seconds", "gauge",
               "Seconds of ring-attention compute on the rank, last step (forward and "
               "backward).", RANK),
    MetricSpec("ringray_exposed_comm_seconds", "gauge",
               "Seconds the rank waited for ring transfers after its compute, last step: "
               "ringray_transfer_exposed_seconds plus ringray_peer_wait_seconds.", RANK),
    MetricSpec("ringray_transfer_exposed_seconds", "gauge",
               "Seconds of the rank's ring transfers that compute did not hide, last step "
               "(each ring step's at most that transfer's standalone time).", RANK),
    MetricSpec("ringray_peer_wait_seconds", "gauge",
               "Seconds the rank waited for a late ring peer (a straggler or a descheduled "
               "rank), last step: its exposed wait beyond what the transfers alone explain.",
               RANK),
    MetricSpec("ringray_a2a_seconds", "gauge",
               "Seconds the rank spent in Ulysses all-to-alls (sequence to heads and back, "
               "forward and backward), last step; all exposed, apart from the ring's exposed "
               "communication; 0 without Ulysses.", RANK),
    MetricSpec("ringray_ring_sent_bytes_total", "counter",
               "Bytes the rank has sent around its ring.", RANK),
    MetricSpec("ringray_ring_skipped_bytes_total", "counter",
               "Bytes of K/V blocks and dK/dV sums the plain ring would have sent from the "
               "rank that nobody reads under the mask (documents, a window), so the transfer "
               "plan did not send them.", RANK),
    MetricSpec("ringray_peak_memory_bytes", "gauge",
               "Peak accelerator memory (CUDA) or resident set (CPU) of the rank.", RANK),
    MetricSpec("ringray_ring_overlap_ratio", "gauge",
               "Share of the ring's transfer time hidden behind compute, worst rank of the "
               "ring, last step (1: all hidden, 0: none; waiting for a late peer is not in "
               "it).", RING),
    MetricSpec("ringray_load_imbalance_ratio", "gauge",
               "Max over mean attention compute across the ring's ranks, last step (1: even).",
               RING),
    # ---- the service
    MetricSpec("ringray_world_size", "gauge", "Ranks the job runs on now.", JOB),
    MetricSpec("ringray_world_size_target", "gauge",
               "Ranks the job asks for (parallel.dp × parallel.cp).", JOB),
    MetricSpec("ringray_controller_state", "gauge",
               "1 for the controller's current state, 0 for the others.", ("job", "state")),
    MetricSpec("ringray_restarts_total", "counter",
               "Rings rebuilt after a failure or a preemption, by reason.", ("job", "reason")),
    MetricSpec("ringray_resizes_total", "counter",
               "Times the job grew into new capacity at a checkpoint boundary.", JOB),
    MetricSpec("ringray_recovery_duration_seconds", "histogram",
               "Seconds from noticing a failure to the first step completed after it.", JOB,
               SLOW_OPERATION_BUCKETS),
    MetricSpec("ringray_checkpoint_duration_seconds", "histogram",
               "Seconds to write and commit a checkpoint (every rank).", JOB,
               SLOW_OPERATION_BUCKETS),
    MetricSpec("ringray_last_checkpoint_timestamp_seconds", "gauge",
               "Unix time the last complete checkpoint was committed.", JOB),
    MetricSpec("ringray_last_checkpoint_step", "gauge",
               "Step of the last complete checkpoint.", JOB),
    # ---- the job's evaluation after training (eval.tasks)
    MetricSpec("ringray_eval_task_score_ratio", "gauge",
               "Score of an lm_eval task (eval.tasks) at a context length (eval.task_lengths) "
               "after training: the mean over its samples, 0 to 1.", ("job", "task", "length"),
               requires="eval.tasks"),
    # ---- replica groups (parallel.dp_replicate)
    MetricSpec("ringray_nonfinite_steps_skipped_total", "counter",
               "Step attempts passed over because their loss or gradient norm was not finite "
               "(train.nonfinite_skips); nothing of them was applied.", JOB),
    MetricSpec("ringray_replica_groups", "gauge",
               "Replica groups the job asks for (parallel.dp_replicate; 1 without).", JOB),
    MetricSpec("ringray_replica_groups_participating", "gauge",
               "Replica groups whose gradients the last committed step averaged.", JOB),
    MetricSpec("ringray_replica_degraded_steps_total", "counter",
               "Steps committed with fewer replica groups than the job asks for.", JOB),
    MetricSpec("ringray_replica_samples_dropped_total", "counter",
               "Sequences of the global batch skipped because their replica group was out "
               "of the step's quorum.", JOB),
    MetricSpec("ringray_replica_groups_lost_total", "counter",
               "Replica groups torn down after a failure, by reason (the others trained on).",
               ("job", "reason")),
    MetricSpec("ringray_replica_heals_total", "counter",
               "Replica groups that loaded a live peer's state to rejoin.", JOB),
    MetricSpec("ringray_replica_heal_duration_seconds", "histogram",
               "Seconds a replica group took to join a quorum and load a live peer's state.",
               JOB, SLOW_OPERATION_BUCKETS),
)

_BY_NAME = {spec.name: spec for spec in CATALOG}


def metric(name: str) -> MetricSpec:
    """The catalog entry called ``name``.

    Raises:
        KeyError: naming the metric, when the catalog has no such entry.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not in ringray.metrics.catalog") from None


def exported_series_names() -> set[str]:
    """Every series name Prometheus sees: histograms add ``_bucket``, ``_sum`` and ``_count``,
    counters are exposed with their ``_total`` name."""
    names = set()
    for spec in CATALOG:
        if spec.kind == "histogram":
            names.update(f"{spec.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(spec.name)
    return names
