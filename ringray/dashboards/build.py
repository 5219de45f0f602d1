"""ringray's two Grafana dashboards, built from the metric catalog, and their JSON files.

    from ringray.dashboards.build import dashboards, write_dashboards, panel_queries
    write_dashboards("dashboards/")          # ringray-job.json, ringray-ring.json
    panel_queries(json.load(f), job="quickstart")   # [(panel title, PromQL), ...]

"ringray / Job" answers how the job is doing (state, throughput, MFU, loss, step time,
checkpoints, restarts and recovery, world size against its target); "ringray / Ring" answers
how its rings are doing (overlap and imbalance per ring, exposed communication per rank, ring
traffic, the straggler, memory). Every metric name goes through
:func:`ringray.metrics.catalog.metric`, so a name that is not in the catalog fails the build.

Why plain typed builders rather than Grafana's foundation SDK: the SDK's Python package is
generated per Grafana release and would be pinned to one, for two dashboards of a few panel
kinds; ~200 lines of frozen dataclasses (:mod:`ringray.dashboards.model`) write the same JSON,
need no dependency, and keep the output small and byte-stable, which is what lets the
committed JSON be checked against a fresh build.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ringray.dashboards.model import Dashboard, Panel, Target, Threshold, Variable
from ringray.metrics.catalog import metric

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


def _variables() -> tuple[Variable, ...]:
    return (
        Variable("datasource", "Prometheus", "datasource", "prometheus"),
        Variable("job", "Job", "query",
                 f"label_values({metric('ringray_training_step').name}, job)"),
    )


def _stat(title: str, *targets: Target, unit: str = "short", **kwargs) -> Panel:
    return Panel(title, "stat", targets, width=4, height=4, unit=unit, **kwargs)


# Counts and sizes that change in steps: drawn as steps, not slopes.
_STEPS = {"fillOpacity": 0, "lineInterpolation": "stepAfter", "lineWidth": 2}

# Colours of the controller's states (ringray.metrics.catalog.CONTROLLER_STATES).
_STATE_COLORS = (
    ("placing", "purple"), ("starting", "purple"), ("running", "green"),
    ("checkpointing", "blue"), ("evaluating", "blue"), ("recovering", "orange"),
    ("resizing", "yellow"), ("finished", "text"), ("failed", "red"), ("stopped", "text"),
)


def job_dashboard() -> Dashboard:
    """"ringray / Job": is the job training, how fast, how well, and how safely."""
    state_now = f"{series('ringray_controller_state')} == 1"
    checkpoint_age = (f"time() - ({series('ringray_last_checkpoint_timestamp_seconds')} > 0)")
    stats = (
        _stat("State", Target(state_now, "{{state}}", instant=True),
              description="The controller's state now.", colors=_STATE_COLORS,
              options={"colorMode": "background", "textMode": "name"}),
        _stat("Step", Target(series("ringray_training_step"), "step", instant=True),
              description="Optimizer steps completed (goes back after a recovery restores a "
              "checkpoint)."),
        _stat("World size", Target(series("ringray_world_size"), "now", instant=True),
              Target(series("ringray_world_size_target"), "target", instant=True),
              description="Ranks the job runs on now, and the ranks it asks for."),
        _stat("Restarts", Target(f"sum({series('ringray_restarts_total')})", "restarts",
                                 instant=True),
              description="Rings rebuilt after a failure or a preemption, all reasons.",
              thresholds=(Threshold(None, "green"), Threshold(1, "orange"))),
        _stat("Since last step",
              Target(f"time() - {series('ringray_last_step_timestamp_seconds')}", "age",
                     instant=True),
              unit="s", decimals=0, description="Seconds since the last step completed.",
              thresholds=(Threshold(None, "green"), Threshold(300, "orange"),
                          Threshold(900, "red"))),
        _stat("Last checkpoint", Target(checkpoint_age, "age", instant=True),
              unit="s", decimals=0, no_value="none yet",
              description="Seconds since the last complete checkpoint was committed.",
              thresholds=(Threshold(None, "green"), Threshold(3600, "orange"),
                          Threshold(4 * 3600, "red"))),
    )
    training = (
        Panel("Throughput", "timeseries",
              (Target(series("ringray_tokens_per_second"), "tokens/s"),),
              width=8, unit="suffix: tok/s", min=0,
              description="Tokens of the global batch per second, per step."),
        Panel("Model FLOPs utilisation", "timeseries",
              (Target(series("ringray_model_flops_utilization_ratio"), "MFU"),),
              width=8, unit="percentunit", min=0, max=1,
              description="Model FLOPs per second (causal attention counted at half) over "
              "the devices' peak."),
        Panel("Loss", "timeseries", (Target(series("ringray_loss"), "loss"),), width=8,
              description="Token-mean cross-entropy of each step."),
    )
    step_time = (
        Panel("Step time", "timeseries", (
            Target(step_time_quantile(0.5), "p50"),
            Target(step_time_quantile(0.9), "p90"),
            Target(step_time_quantile(0.99), "p99"),
            Target(f"sum({rate(series('ringray_step_duration_seconds', '_sum'))}) / "
                   f"sum({rate(series('ringray_step_duration_seconds', '_count'))})", "mean"),
        ), width=12, unit="s", min=0,
            description="Wall-clock seconds per optimizer step over the rate window: "
            "quantiles from the histogram's buckets, and the mean."),
        Panel("Gradient norm", "timeseries",
              (Target(series("ringray_grad_norm"), "grad norm"),), width=6, min=0,
              description="Global L2 norm of the gradients before clipping."),
        Panel("Learning rate", "timeseries",
              (Target(series("ringray_learning_rate"), "lr"),), width=6, unit="sci", min=0),
    )
    service = (
        Panel("State over time", "state-timeline", (Target(state_now, "{{state}}"),),
              width=12, colors=_STATE_COLORS,
              description="One row per state the controller was in, coloured while it was."),
        Panel("World size vs target", "timeseries", (
            Target(series("ringray_world_size"), "world size"),
            Target(series("ringray_world_size_target"), "target"),
        ), width=12, min=0, decimals=0,
            custom=_STEPS,
            description="Ranks the job runs on against the ranks it asks for: below the "
            "target while shrunk after a failure or waiting for capacity."),
    )
    checkpoints = (
        Panel("Steps since the last checkpoint", "timeseries", (
            Target(series("ringray_training_step"), "step"),
            Target(series("ringray_last_checkpoint_step"), "last checkpoint"),
        ), width=12, min=0, decimals=0, custom=_STEPS,
            description="The training step and the step of the last complete checkpoint: "
            "the gap is the work a failure now would lose."),
        Panel("Checkpoint duration", "timeseries", (
            Target(lifetime_mean("ringray_checkpoint_duration_seconds"), "mean"),
            Target(lifetime_quantile("ringray_checkpoint_duration_seconds", 0.9), "p90"),
        ), width=12, unit="s", min=0,
            description="Seconds to write and commit a checkpoint, over every checkpoint "
            "since the controller started (checkpoints are too rare for a rate window)."),
    )
    failures = (
        Panel("Restarts by reason", "timeseries", (
            Target(f"sum by (reason) ({series('ringray_restarts_total')})", "{{reason}}"),
            Target(series("ringray_resizes_total"), "resizes (growth)"),
        ), width=12, min=0, decimals=0,
            custom=_STEPS,
            description="Rings rebuilt, by reason (actor_died, node_died, hang, preempted, "
            "worker_error, startup), and times the job grew into new capacity."),
        Panel("Recovery time", "timeseries", (
            Target(lifetime_mean("ringray_recovery_duration_seconds"), "mean"),
            Target(lifetime_quantile("ringray_recovery_duration_seconds", 0.5), "p50"),
            Target(lifetime_quantile("ringray_recovery_duration_seconds", 0.9), "p90"),
        ), width=12, unit="s", min=0,
            description="Seconds from noticing a failure to the first step completed after "
            "it, over every recovery since the controller started."),
    )
    return Dashboard(
        uid="ringray-job", title="ringray / Job",
        description="A ringray training job: state, throughput, MFU, loss, step time, "
        "checkpoints, restarts and recovery.",
        variables=_variables(),
        rows=(stats, training, step_time, service, checkpoints, failures),
    )


def ring_dashboard() -> Dashboard:
    """"ringray / Ring": is ring communication hidden, is the work even, who is slow."""
    overlap = series("ringray_ring_overlap_ratio")
    imbalance = series("ringray_load_imbalance_ratio")
    sent_rate = rate(series("ringray_ring_sent_bytes_total"))
    slowest_over_median = (f"max({ring_seconds()}) / quantile(0.5, {ring_seconds()})")
    overlap_colors = (Threshold(None, "red"), Threshold(0.8, "orange"), Threshold(0.95, "green"))
    imbalance_colors = (Threshold(None, "green"), Threshold(1.1, "orange"), Threshold(1.3, "red"))
    stats = (
        Panel("Worst ring overlap", "stat", (Target(f"min({overlap})", "overlap", instant=True),),
              width=6, height=4, unit="percentunit", decimals=1, thresholds=overlap_colors,
              description="Share of ring transfer time hidden behind compute on the worst "
              "rank of the worst ring, last step (1: all hidden; negative: waiting longer "
              "than the transfers alone take)."),
        Panel("Worst ring imbalance", "stat",
              (Target(f"max({imbalance})", "imbalance", instant=True),),
              width=6, height=4, decimals=3, thresholds=imbalance_colors,
              description="Max over mean attention compute across a ring's ranks, worst ring, "
              "last step (1: even)."),
        Panel("Slowest rank ÷ median", "stat",
              (Target(slowest_over_median, "slowest ÷ median", instant=True),),
              width=6, height=4, decimals=3, thresholds=imbalance_colors,
              description="The slowest rank's attention compute plus exposed communication "
              "over the median rank's, last step: the straggler's cost (1: none)."),
        Panel("Ring traffic", "stat", (Target(f"sum({sent_rate})", "sent", instant=True),),
              width=6, height=4, unit="Bps",
              description="Bytes per second sent around all rings, all ranks."),
    )
    rings = (
        Panel("Overlap per ring", "timeseries", (Target(overlap, "ring {{ring}}"),),
              width=12, unit="percentunit", max=1, thresholds=overlap_colors,
              custom={"thresholdsStyle": {"mode": "line+area"}},
              description="Share of the ring's transfer time hidden behind compute, worst "
              "rank of the ring, per step (1: all hidden)."),
        Panel("Load imbalance per ring", "timeseries", (Target(imbalance, "ring {{ring}}"),),
              width=12, min=1, decimals=3, thresholds=imbalance_colors,
              custom={"thresholdsStyle": {"mode": "line+area"}},
              description="Max over mean attention compute across the ring's ranks, per step "
              "(1: even; causal work on a contiguous layout is the classic imbalance)."),
    )
    exposed = (
        Panel("Exposed communication per rank", "heatmap",
              (Target(series("ringray_exposed_comm_seconds"), "{{rank}}"),),
              width=12, unit="s",
              options={"cellValues": {"unit": "s"},
                       "yAxis": {"axisLabel": "rank", "axisPlacement": "left",
                                 "reverse": False}},
              description="Seconds each rank (a row) waited for ring transfers that compute "
              "did not hide, per step: a bright row is a rank whose link is slow."),
        Panel("Exposed share of ring time per rank", "timeseries", (
            Target(f"{series('ringray_exposed_comm_seconds')} / ({ring_seconds()})",
                   "rank {{rank}}"),
        ), width=12, unit="percentunit", min=0,
            description="Exposed communication over attention compute plus exposed "
            "communication, per rank (0: every transfer hidden)."),
    )
    straggler = (
        Panel("Slowest rank ÷ median per ring", "timeseries", (
            Target(slowest_over_median, "all ranks"),
            Target(f"max by (ring) ({ring_seconds()}) / "
                   f"quantile by (ring) (0.5, {ring_seconds()})", "ring {{ring}}"),
        ), width=12, min=1, decimals=3, thresholds=imbalance_colors,
            description="The slowest rank's attention compute plus exposed communication "
            "over the median's, across all ranks and within each ring."),
        Panel("Ring time by rank (last step)", "bargauge", (
            Target(ring_seconds(), "rank {{rank}} · ring {{ring}} · node {{node}}",
                   instant=True),
        ), width=12, unit="s", min=0,
            description="Attention compute plus exposed communication of each rank in the "
            "last step: the longest bar is the straggler, and its node is named."),
    )
    resources = (
        Panel("Ring bytes sent per rank", "timeseries", (Target(sent_rate, "rank {{rank}}"),),
              width=8, unit="Bps", min=0,
              description="Bytes per second each rank sends around its ring."),
        Panel("Attention compute per rank", "timeseries",
              (Target(series("ringray_attention_compute_seconds"), "rank {{rank}}"),),
              width=8, unit="s", min=0,
              description="Seconds of ring-attention compute (forward and backward) per rank, "
              "per step."),
        Panel("Peak memory per rank", "timeseries",
              (Target(series("ringray_peak_memory_bytes"), "rank {{rank}}"),),
              width=8, unit="bytes", min=0,
              description="Peak accelerator memory (CUDA) or resident set (CPU) per rank."),
    )
    return Dashboard(
        uid="ringray-ring", title="ringray / Ring",
        description="The rings of a ringray job: overlap, load balance, exposed "
        "communication, traffic, stragglers and memory.",
        variables=_variables(),
        rows=(stats, rings, exposed, straggler, resources),
    )


def dashboards() -> dict[str, Dashboard]:
    """Every dashboard by its file name."""
    return {"ringray-job.json": job_dashboard(), "ringray-ring.json": ring_dashboard()}


def render(dashboard: Dashboard) -> str:
    """The dashboard's JSON text, byte-stable: the committed files are exactly this."""
    return json.dumps(dashboard.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_dashboards(directory: str | Path) -> list[Path]:
    """Write every dashboard's JSON into ``directory`` (created if missing); the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, dashboard in dashboards().items():
        path = out / filename
        path.write_text(render(dashboard), encoding="utf-8")
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
