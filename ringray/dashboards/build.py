"""ringray's two Grafana dashboards, built from the metric catalog, and their JSON files.

    from ringray.dashboards.build import dashboards, write_dashboards, panel_queries
    write_dashboards("dashboards/")          # ringray-job.json, ringray-ring.json
    panel_queries(json.load(f), job="quickstart")   # [(panel title, PromQL), ...]

"ringray / Job" answers how the job is doing (state, throughput, MFU, loss, step time,
checkpoints, restarts and recovery, world size against its target); "ringray / Ring" answers
how its rings are doing (overlap and imbalance per ring, exposed communication per rank and
its split into transfer not hidden and waiting for a late peer, the Ulysses all-to-alls'
time, ring traffic, the straggler, memory). Every metric name goes through
:func:`ringray.metrics.catalog.metric`, so a name that is not in the catalog fails the build.

The dashboards are built with Grafana's foundation SDK (``grafana-foundation-sdk``, typed
builders generated from Grafana's dashboard schema; :mod:`ringray.dashboards.panels` holds
ringray's look per panel kind). The SDK's version is pinned exactly in pyproject.toml: a
different build may write different JSON, and the committed files are checked against a fresh
build.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_model
from grafana_foundation_sdk.models import dashboard as dashboard_model

from ringray.dashboards.panels import (
    DATASOURCE,
    as_steps,
    bargauge_panel,
    fixed_colors,
    heatmap_panel,
    place,
    queries,
    query,
    stat_panel,
    state_timeline_panel,
    thresholds,
    timeseries_panel,
    with_threshold_areas,
)
from ringray.metrics.catalog import CONTROLLER_STATES, RESTART_REASONS, metric

Dashboard = dashboard_model.Dashboard  # what dashboards() returns: the SDK's built model

JOB_FILTER = 'job="$job"'
RATE_WINDOW = "$__rate_interval"


def series(name: str, suffix: str = "") -> str:
    """The selector of a catalog metric for the dashboard's job, e.g.
    ``ringray_loss{job="$job"}``; ``suffix`` is a histogram's ``_bucket``/``_sum``/``_count``.
    """
    spec = metric(name)
    if suffix and spec.kind != "histogram":
        raise ValueError(f"metric {name!r} is a {spec.kind}: the suffix {suffix!r} is only "
                         "for histograms")
    return f"{spec.name}{suffix}{{{JOB_FILTER}}}"


def rate(selector: str) -> str:
    return f"rate({selector}[{RATE_WINDOW}])"


def step_time_quantile(q: float) -> str:
    """A quantile of step time over the last rate window, from the histogram's buckets."""
    buckets = rate(series("ringray_step_duration_seconds", "_bucket"))
    return f"histogram_quantile({q}, sum by (le) ({buckets}))"


def lifetime_quantile(name: str, q: float) -> str:
    """A quantile over everything the controller observed: for rare events (checkpoints,
    recoveries) that a rate window would mostly miss."""
    return f"histogram_quantile({q}, sum by (le) ({series(name, '_bucket')}))"


def lifetime_mean(name: str) -> str:
    return f"{series(name, '_sum')} / {series(name, '_count')}"


def ring_seconds() -> str:
    """A rank's ring time in the last step: attention compute plus exposed communication."""
    return (f"{series('ringray_attention_compute_seconds')} + "
            f"{series('ringray_exposed_comm_seconds')}")


def _board(uid: str, title: str, description: str) -> dashboard.Dashboard:
    """A dashboard with ringray's settings: the ``datasource`` and ``job`` variables, a shared
    crosshair (the same moment on every panel), the last 6 hours refreshed every 30 s, and
    the viewer's own time zone ("")."""
    job_values = f"label_values({metric('ringray_training_step').name}, job)"
    return (
        dashboard.Dashboard(title).uid(uid).description(description).tags(["ringray"])
        .editable().tooltip(dashboard_model.DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now").refresh("30s").timezone("")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus")
                       .type("prometheus"))
        # refresh on a time-range change: the job list is read again when the range moves.
        .with_variable(dashboard.QueryVariable("job").label("Job").datasource(DATASOURCE)
                       .query(job_values)
                       .refresh(dashboard_model.VariableRefresh.ON_TIME_RANGE_CHANGED)
                       .sort(dashboard_model.VariableSort.ALPHABETICAL_ASC))
    )


# Colours of the controller's states (ringray.metrics.catalog.CONTROLLER_STATES).
_STATE_COLORS = {
    "placing": "purple", "starting": "purple", "running": "green", "checkpointing": "blue",
    "evaluating": "blue", "recovering": "orange", "resizing": "yellow", "finished": "text",
    "failed": "red", "stopped": "text",
}


def _state_colors() -> list[tuple[str, str]]:
    """Every controller state of the catalog with its colour, in the catalog's order."""
    missing = [state for state in CONTROLLER_STATES if state not in _STATE_COLORS]
    if missing:
        raise ValueError(f"controller states without a colour: {', '.join(missing)}")
    return [(state, _STATE_COLORS[state]) for state in CONTROLLER_STATES]


def job_dashboard() -> dashboard.Dashboard:
    """"ringray / Job": is the job training, how fast, how well, and how safely."""
    state_now = f"{series('ringray_controller_state')} == 1"
    checkpoint_age = f"time() - ({series('ringray_last_checkpoint_timestamp_seconds')} > 0)"
    stats = [
        fixed_colors(stat_panel("State", description="The controller's state now.")
                     .targets(queries(query(state_now, "{{state}}", instant=True)))
                     .color_mode(common_model.BigValueColorMode.BACKGROUND)
                     .text_mode(common_model.BigValueTextMode.NAME), _state_colors()),
        stat_panel("Step", description="Optimizer steps completed (goes back after a recovery "
                   "restores a checkpoint).")
        .targets(queries(query(series("ringray_training_step"), "step", instant=True))),
        stat_panel("World size", description="Ranks the job runs on now, and the ranks it "
                   "asks for.")
        .targets(queries(query(series("ringray_world_size"), "now", instant=True),
                         query(series("ringray_world_size_target"), "target", instant=True))),
        stat_panel("Restarts", description="Rings rebuilt after a failure or a preemption, "
                   "all reasons.")
        .targets(queries(query(f"sum({series('ringray_restarts_total')})", "restarts",
                               instant=True)))
        .thresholds(thresholds((None, "green"), (1, "orange"))),
        stat_panel("Since last step", description="Seconds since the last step completed.")
        .targets(queries(query(f"time() - {series('ringray_last_step_timestamp_seconds')}",
                               "age", instant=True)))
        .unit("s").decimals(0)
        .thresholds(thresholds((None, "green"), (300, "orange"), (900, "red"))),
        stat_panel("Last checkpoint", description="Seconds since the last complete checkpoint "
                   "was committed.")
        .targets(queries(query(checkpoint_age, "age", instant=True)))
        .unit("s").decimals(0).no_value("none yet")
        .thresholds(thresholds((None, "green"), (3600, "orange"), (4 * 3600, "red"))),
    ]
    training = [
        timeseries_panel("Throughput", 8, "Tokens of the global batch per second, per step.")
        .targets(queries(query(series("ringray_tokens_per_second"), "tokens/s")))
        .unit("suffix: tok/s").min(0),
        timeseries_panel("Model FLOPs utilisation", 8, "Model FLOPs per second (causal "
                         "attention counted at half) over the devices' peak.")
        .targets(queries(query(series("ringray_model_flops_utilization_ratio"), "MFU")))
        .unit("percentunit").min(0).max(1),
        timeseries_panel("Loss", 8, "Token-mean cross-entropy of each step.")
        .targets(queries(query(series("ringray_loss"), "loss"))),
    ]
    step_seconds = "ringray_step_duration_seconds"
    step_time = [
        timeseries_panel("Step time", 12, "Wall-clock seconds per optimizer step over the "
                         "rate window: quantiles from the histogram's buckets, and the mean.")
        .targets(queries(
            query(step_time_quantile(0.5), "p50"),
            query(step_time_quantile(0.9), "p90"),
            query(step_time_quantile(0.99), "p99"),
            query(f"sum({rate(series(step_seconds, '_sum'))}) / "
                  f"sum({rate(series(step_seconds, '_count'))})", "mean"),
        )).unit("s").min(0),
        timeseries_panel("Gradient norm", 6, "Global L2 norm of the gradients before "
                         "clipping, and the attempts passed over because their loss or "
                         "norm was not finite (train.nonfinite_skips).")
        .targets(queries(query(series("ringray_grad_norm"), "grad norm"),
                         query(series("ringray_nonfinite_steps_skipped_total"),
                               "non-finite skipped"))).min(0),
        timeseries_panel("Learning rate", 6)
        .targets(queries(query(series("ringray_learning_rate"), "lr"))).unit("sci").min(0),
    ]
    service = [
        fixed_colors(state_timeline_panel("State over time", 12, "One row per state the "
                                          "controller was in, coloured while it was.")
                     .targets(queries(query(state_now, "{{state}}"))), _state_colors()),
        as_steps(timeseries_panel("World size vs target", 12, "Ranks the job runs on against "
                                  "the ranks it asks for: below the target while shrunk "
                                  "after a failure or waiting for capacity."))
        .targets(queries(query(series("ringray_world_size"), "world size"),
                         query(series("ringray_world_size_target"), "target")))
        .min(0).decimals(0),
    ]
    checkpoint_seconds = "ringray_checkpoint_duration_seconds"
    checkpoints = [
        as_steps(timeseries_panel("Steps since the last checkpoint", 12, "The training step "
                                  "and the step of the last complete checkpoint: the gap is "
                                  "the work a failure now would lose."))
        .targets(queries(query(series("ringray_training_step"), "step"),
                         query(series("ringray_last_checkpoint_step"), "last checkpoint")))
        .min(0).decimals(0),
        timeseries_panel("Checkpoint duration", 12, "Seconds to write and commit a "
                         "checkpoint, over every checkpoint since the controller started "
                         "(checkpoints are too rare for a rate window).")
        .targets(queries(query(lifetime_mean(checkpoint_seconds), "mean"),
                         query(lifetime_quantile(checkpoint_seconds, 0.9), "p90")))
        .unit("s").min(0),
    ]
    recovery_seconds = "ringray_recovery_duration_seconds"
    failures = [
        as_steps(timeseries_panel("Restarts by reason", 12, "Rings rebuilt, by reason "
                                  f"({', '.join(RESTART_REASONS)}), and times the job grew "
                                  "into new capacity."))
        .targets(queries(
            query(f"sum by (reason) ({series('ringray_restarts_total')})", "{{reason}}"),
            query(series("ringray_resizes_total"), "resizes (growth)"),
        )).min(0).decimals(0),
        timeseries_panel("Recovery time", 12, "Seconds from noticing a failure to the first "
                         "step completed after it, over every recovery since the controller "
                         "started.")
        .targets(queries(query(lifetime_mean(recovery_seconds), "mean"),
                         query(lifetime_quantile(recovery_seconds, 0.5), "p50"),
                         query(lifetime_quantile(recovery_seconds, 0.9), "p90")))
        .unit("s").min(0),
    ]
    evaluation = [
        timeseries_panel("Task score by length", 24, "Score (0 to 1) of each lm_eval task the "
                         "job evaluates after training (eval.tasks), at each context length "
                         "(eval.task_lengths): one line per task and length, set when the "
                         "evaluation ends.")
        .targets(queries(query(series("ringray_eval_task_score_ratio"),
                               "{{task}} @ {{length}}")))
        .min(0).max(1),
    ]
    heal_seconds = "ringray_replica_heal_duration_seconds"
    replicas = [
        as_steps(timeseries_panel("Replica groups in the quorum", 8, "Replica groups "
                                  "(parallel.dp_replicate) whose gradients each committed "
                                  "step averaged, against the groups the job asks for: below "
                                  "it while a lost group is being replaced."))
        .targets(queries(query(series("ringray_replica_groups_participating"), "participating"),
                         query(series("ringray_replica_groups"), "asked for")))
        .min(0).decimals(0),
        as_steps(timeseries_panel("Replica losses and heals", 8, "Replica groups torn down "
                                  "after a failure (by reason; the others trained on), "
                                  "groups that healed from a live peer, and steps committed "
                                  "with fewer groups."))
        .targets(queries(
            query(f"sum by (reason) ({series('ringray_replica_groups_lost_total')})",
                  "lost: {{reason}}"),
            query(series("ringray_replica_heals_total"), "heals"),
            query(series("ringray_replica_degraded_steps_total"), "degraded steps"),
            query(series("ringray_replica_samples_dropped_total"), "samples dropped"),
        )).min(0).decimals(0),
        timeseries_panel("Heal time", 8, "Seconds a replica group took to join a quorum and "
                         "load a live peer's state, over every heal since the controller "
                         "started.")
        .targets(queries(query(lifetime_mean(heal_seconds), "mean"),
                         query(lifetime_quantile(heal_seconds, 0.9), "p90")))
        .unit("s").min(0),
    ]
    board = _board("ringray-job", "ringray / Job", "A ringray training job: state, "
                   "throughput, MFU, loss, step time, checkpoints, restarts, recovery, "
                   "replica groups and the evaluation after training.")
    return place(board, [stats, training, step_time, service, checkpoints, failures, replicas,
                         evaluation])


def ring_dashboard() -> dashboard.Dashboard:
    """"ringray / Ring": is ring communication hidden, is the work even, who is slow."""
    overlap = series("ringray_ring_overlap_ratio")
    imbalance = series("ringray_load_imbalance_ratio")
    exposed_seconds = series("ringray_exposed_comm_seconds")
    not_hidden_seconds = series("ringray_transfer_exposed_seconds")
    peer_wait_seconds = series("ringray_peer_wait_seconds")
    sent_rate = rate(series("ringray_ring_sent_bytes_total"))
    slowest_over_median = f"max({ring_seconds()}) / quantile(0.5, {ring_seconds()})"
    overlap_colors = ((None, "red"), (0.8, "orange"), (0.95, "green"))
    imbalance_colors = ((None, "green"), (1.1, "orange"), (1.3, "red"))
    stats = [
        stat_panel("Worst ring overlap", 6, "Share of ring transfer time hidden behind compute "
                   "on the worst rank of the worst ring, last step (1: all hidden, 0: none; "
                   "waiting for a late peer is not in it: see Peer wait per rank).")
        .targets(queries(query(f"min({overlap})", "overlap", instant=True)))
        .unit("percentunit").decimals(1).thresholds(thresholds(*overlap_colors)),
        stat_panel("Worst ring imbalance", 6, "Max over mean attention compute across a "
                   "ring's ranks, worst ring, last step (1: even).")
        .targets(queries(query(f"max({imbalance})", "imbalance", instant=True)))
        .decimals(3).thresholds(thresholds(*imbalance_colors)),
        stat_panel("Slowest rank ÷ median", 6, "The slowest rank's attention compute plus "
                   "exposed communication over the median rank's, last step: the "
                   "straggler's cost (1: none).")
        .targets(queries(query(slowest_over_median, "slowest ÷ median", instant=True)))
        .decimals(3).thresholds(thresholds(*imbalance_colors)),
        stat_panel("Ring traffic", 6, "Bytes per second sent around all rings, all ranks.")
        .targets(queries(query(f"sum({sent_rate})", "sent", instant=True))).unit("Bps"),
    ]
    rings = [
        with_threshold_areas(timeseries_panel(
            "Overlap per ring", 12, "Share of the ring's transfer time hidden behind "
            "compute, worst rank of the ring, per step (1: all hidden)."))
        .targets(queries(query(overlap, "ring {{ring}}")))
        .unit("percentunit").max(1).thresholds(thresholds(*overlap_colors)),
        with_threshold_areas(timeseries_panel(
            "Load imbalance per ring", 12, "Max over mean attention compute across the ring's "
            "ranks, per step (1: even; causal work on a contiguous layout is the classic "
            "imbalance)."))
        .targets(queries(query(imbalance, "ring {{ring}}")))
        .min(1).decimals(3).thresholds(thresholds(*imbalance_colors)),
    ]
    exposed = [
        heatmap_panel("Exposed communication per rank", 12, "Seconds each rank (a row) waited "
                      "for ring transfers after its compute, per step (transfer not hidden "
                      "plus waiting for a late peer): a bright row is a rank whose link is "
                      "slow or whose peer is late.", row_label="rank", cell_unit="s")
        .targets(queries(query(exposed_seconds, "{{rank}}"))).unit("s"),
        timeseries_panel("Exposed share of ring time per rank", 12, "Exposed communication "
                         "over attention compute plus exposed communication, per rank (0: "
                         "every transfer hidden).")
        .targets(queries(query(f"{exposed_seconds} / ({ring_seconds()})", "rank {{rank}}")))
        .unit("percentunit").min(0),
    ]
    peer_wait = [
        timeseries_panel("Peer wait per rank", 12, "Seconds each rank waited for a late ring "
                         "peer per step: its exposed wait beyond what the transfers alone "
                         "take (a straggler or a descheduled rank upstream; the straggler "
                         "itself waits least).")
        .targets(queries(query(peer_wait_seconds, "rank {{rank}} · node {{node}}")))
        .unit("s").min(0),
        timeseries_panel("Exposed wait split per ring", 12, "Per ring (dp index), the slowest "
                         "rank's transfer not hidden (bounded by the transfers' own time: the "
                         "overlap's complement) beside its longest wait for a late peer, per "
                         "step.")
        .targets(queries(
            query(f"max by (ring) ({not_hidden_seconds})", "ring {{ring}} · transfer not hidden"),
            query(f"max by (ring) ({peer_wait_seconds})", "ring {{ring}} · peer wait"),
        )).unit("s").min(0),
    ]
    straggler = [
        timeseries_panel("Slowest rank ÷ median per ring", 12, "The slowest rank's attention "
                         "compute plus exposed communication over the median's, across all "
                         "ranks and within each ring.")
        .targets(queries(
            query(slowest_over_median, "all ranks"),
            query(f"max by (ring) ({ring_seconds()}) / "
                  f"quantile by (ring) (0.5, {ring_seconds()})", "ring {{ring}}"),
        )).min(1).decimals(3).thresholds(thresholds(*imbalance_colors)),
        bargauge_panel("Ring time by rank (last step)", 12, "Attention compute plus exposed "
                       "communication of each rank in the last step: the longest bar is the "
                       "straggler, and its node is named.")
        .targets(queries(query(ring_seconds(), "rank {{rank}} · ring {{ring}} · node {{node}}",
                               instant=True)))
        .unit("s").min(0),
    ]
    a2a_seconds = series("ringray_a2a_seconds")
    ulysses = [
        timeseries_panel("All-to-all seconds per rank", 12, "Seconds each rank spent in "
                         "Ulysses all-to-alls (heads to sequence and back, forward and "
                         "backward) per step; all exposed: nothing computes meanwhile (0 "
                         "without parallel.ulysses).")
        .targets(queries(query(a2a_seconds, "rank {{rank}}"))).unit("s").min(0),
        timeseries_panel("Ring exposed vs all-to-all per ring", 12, "Per ring (dp index), "
                         "the slowest rank's exposed ring communication beside its slowest "
                         "all-to-all time, per step: with Ulysses, the two waits a step "
                         "trades against each other.")
        .targets(queries(
            query(f"max by (ring) ({exposed_seconds})", "ring {{ring}} · ring exposed"),
            query(f"max by (ring) ({a2a_seconds})", "ring {{ring}} · all-to-all"),
        )).unit("s").min(0),
    ]
    resources = [
        timeseries_panel("Ring bytes sent per rank", 6, "Bytes per second each rank sends "
                         "around its ring.")
        .targets(queries(query(sent_rate, "rank {{rank}}"))).unit("Bps").min(0),
        timeseries_panel("Ring bytes the mask saved per rank", 6, "Bytes per second of K/V "
                         "blocks and dK/dV sums the plain ring would have sent from each rank "
                         "that nobody reads under the mask (documents, a window), so the "
                         "transfer plan did not send them.")
        .targets(queries(query(rate(series("ringray_ring_skipped_bytes_total")),
                               "rank {{rank}}"))).unit("Bps").min(0),
        timeseries_panel("Attention compute per rank", 6, "Seconds of ring-attention compute "
                         "(forward and backward) per rank, per step.")
        .targets(queries(query(series("ringray_attention_compute_seconds"), "rank {{rank}}")))
        .unit("s").min(0),
        timeseries_panel("Peak memory per rank", 6, "Peak accelerator memory (CUDA) or "
                         "resident set (CPU) per rank.")
        .targets(queries(query(series("ringray_peak_memory_bytes"), "rank {{rank}}")))
        .unit("bytes").min(0),
    ]
    board = _board("ringray-ring", "ringray / Ring", "The rings of a ringray job: overlap, "
                   "load balance, exposed communication and peer wait, Ulysses all-to-alls, "
                   "traffic, stragglers and memory.")
    return place(board, [stats, rings, exposed, peer_wait, straggler, ulysses, resources])


def dashboards() -> dict[str, Dashboard]:
    """Every dashboard by its file name (the SDK's built models)."""
    return {"ringray-job.json": job_dashboard().build(),
            "ringray-ring.json": ring_dashboard().build()}


def as_json(board: Dashboard) -> dict:
    """The dashboard as plain JSON data (what Grafana's HTTP API takes), through the SDK's
    encoder (its models serialise themselves field by field)."""
    return json.loads(json.dumps(board, cls=JSONEncoder))


def render(board: Dashboard) -> str:
    """The dashboard's JSON text, byte-stable (sorted keys, one pinned SDK): the committed
    files are exactly this."""
    return json.dumps(board, cls=JSONEncoder, indent=2, sort_keys=True,
                      ensure_ascii=False) + "\n"


def write_dashboards(directory: str | Path) -> list[Path]:
    """Write every dashboard's JSON into ``directory`` (created if missing); the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, board in dashboards().items():
        path = out / filename
        path.write_text(render(board), encoding="utf-8")
        paths.append(path)
    return paths


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def panel_queries(dashboard_json: dict, *, job: str,
                  rate_interval: str = "1m") -> list[tuple[str, str]]:
    """Every PromQL expression of a dashboard's panels, as ``(panel title, expression)``, with
    the variables Grafana would substitute: ``$job`` (escaped for a PromQL string),
    ``$__rate_interval``; ``$datasource`` picks the server and is not in any expression.

    Raises:
        ValueError: naming the panel and the variable, for a variable not listed above.
    """
    escaped_job = job.replace("\\", "\\\\").replace('"', '\\"')
    values = {"job": escaped_job, "__rate_interval": rate_interval}
    queries = []
    for panel in _all_panels(dashboard_json.get("panels", [])):
        for target in panel.get("targets", []):
            def substitute(match: re.Match, title: str = panel["title"]) -> str:
                name = match.group(1) or match.group(2)
                if name not in values:
                    raise ValueError(f"panel {title!r}: the variable ${name} has no value "
                                     f"here (known: {', '.join(sorted(values))})")
                return values[name]

            queries.append((panel["title"], _VARIABLE.sub(substitute, target["expr"])))
    return queries


def _all_panels(panels: list[dict]) -> list[dict]:
    """Panels in order, including those folded inside a collapsed row panel."""
    flat = []
    for panel in panels:
        flat.append(panel)
        flat.extend(_all_panels(panel.get("panels", [])))
    return flat
