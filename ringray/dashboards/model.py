"""Typed builders for Grafana dashboard JSON: Dashboard, Panel, Target, Variable.

    panel = Panel("Loss", "timeseries", (Target('ringray_loss{job="$job"}', "loss"),), width=8)
    Dashboard(uid="ringray-job", title="ringray / Job", rows=((panel,),)).to_json()

A dashboard is a list of rows; a row is panels laid left to right. :meth:`Dashboard.to_json`
assigns each panel its id and grid position from that order, so panels fit the 24-column grid
and never overlap by construction, and ids are stable as long as the order is. Every panel and
every query uses the ``$datasource`` variable; the ``$job`` variable picks the job.

Only the fields a panel's look depends on are written; Grafana fills in its defaults for the
rest when it loads the dashboard, so the JSON stays short enough to review in a diff.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GRID_COLUMNS = 24  # Grafana's dashboard grid is 24 columns wide
SCHEMA_VERSION = 39  # Grafana 10.4/11.x's dashboard schema
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel.

    ``instant`` asks for the last value only (stat and bar-gauge panels that show "now");
    otherwise the query is a range query drawn over the dashboard's time range.
    """

    expr: str
    legend: str = ""
    instant: bool = False

    def to_json(self, ref_id: str) -> dict:
        return {
            "datasource": dict(DATASOURCE),
            "editorMode": "code",
            "expr": self.expr,
            "instant": self.instant,
            "legendFormat": self.legend or "__auto",
            "range": not self.instant,
            "refId": ref_id,
        }


@dataclass(frozen=True)
class Threshold:
    """A colour from ``value`` upwards (``None``: from minus infinity)."""

    value: float | None
    color: str


@dataclass(frozen=True)
class Panel:
    """A panel: its kind (``timeseries``, ``stat``, ``heatmap``, ``state-timeline``,
    ``bargauge``), its queries and its size in grid units (24 columns; a row of height 8 is
    about 240 pixels).

    ``unit`` is a Grafana unit id (``s``, ``bytes``, ``Bps``, ``percentunit``, ``short``,
    ``suffix:tok/s``). ``options`` and ``custom`` (the field config's drawing options) are
    merged over the kind's defaults, for the few panels that need something else.
    ``colors`` fixes a series' colour by its legend name.
    """

    title: str
    kind: str
    targets: tuple[Target, ...]
    width: int
    height: int = 8
    description: str = ""
    unit: str = "short"
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    thresholds: tuple[Threshold, ...] = (Threshold(None, "green"),)
    colors: tuple[tuple[str, str], ...] = ()
    no_value: str = ""
    options: dict = field(default_factory=dict)
    custom: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in _KIND_OPTIONS:
            raise ValueError(f"panel {self.title!r}: kind {self.kind!r} is not one of "
                             f"{', '.join(_KIND_OPTIONS)}")
        if not 1 <= self.width <= GRID_COLUMNS or self.height < 1:
            raise ValueError(f"panel {self.title!r}: width {self.width} must be 1..{GRID_COLUMNS}"
                             f" and height {self.height} at least 1")
        if not self.targets:
            raise ValueError(f"panel {self.title!r}: give at least one target")

    def to_json(self, panel_id: int, x: int, y: int) -> dict:
        defaults: dict = {
            "unit": self.unit,
            "thresholds": {"mode": "absolute", "steps": [
                {"color": t.color, "value": t.value} for t in self.thresholds]},
        }
        custom = {**_KIND_CUSTOM.get(self.kind, {}), **self.custom}
        if custom:
            defaults["custom"] = custom
        for key, value in (("min", self.min), ("max", self.max), ("decimals", self.decimals)):
            if value is not None:
                defaults[key] = value
        if self.no_value:
            defaults["noValue"] = self.no_value
        overrides = [
            {"matcher": {"id": "byName", "options": name},
             "properties": [{"id": "color", "value": {"fixedColor": color, "mode": "fixed"}}]}
            for name, color in self.colors
        ]
        return {
            "datasource": dict(DATASOURCE),
            "description": self.description,
            "fieldConfig": {"defaults": defaults, "overrides": overrides},
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "id": panel_id,
            "options": {**_KIND_OPTIONS[self.kind], **self.options},
            "targets": [t.to_json(chr(ord("A") + i)) for i, t in enumerate(self.targets)],
            "title": self.title,
            "type": self.kind,
        }


_LEGEND = {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True}
_REDUCE_LAST = {"calcs": ["lastNotNull"], "fields": "", "values": False}
_KIND_OPTIONS: dict[str, dict] = {
    "timeseries": {"legend": _LEGEND, "tooltip": {"mode": "multi", "sort": "desc"}},
    "stat": {"colorMode": "value", "graphMode": "none", "justifyMode": "auto",
             "orientation": "auto", "reduceOptions": _REDUCE_LAST, "textMode": "auto"},
    "bargauge": {"displayMode": "gradient", "minVizHeight": 16, "orientation": "horizontal",
                 "reduceOptions": _REDUCE_LAST, "showUnfilled": True},
    "state-timeline": {"alignValue": "left", "legend": {**_LEGEND, "showLegend": False},
                       "mergeValues": True, "rowHeight": 0.8, "showValue": "never",
                       "tooltip": {"mode": "single", "sort": "none"}},
    # calculate=false: the series are the heatmap's rows already (one per rank), no buckets.
    "heatmap": {"calculate": False, "cellGap": 1,
                "color": {"exponent": 0.5, "fill": "dark-orange", "mode": "scheme",
                          "reverse": False, "scale": "exponential", "scheme": "Oranges",
                          "steps": 64},
                "legend": {"show": True}, "rowsFrame": {"layout": "auto"},
                "tooltip": {"mode": "single", "yHistogram": False},
                "yAxis": {"axisPlacement": "left", "reverse": False}},
}
_KIND_CUSTOM: dict[str, dict] = {
    "timeseries": {"fillOpacity": 10, "lineWidth": 1, "showPoints": "never",
                   "spanNulls": False},
}


@dataclass(frozen=True)
class Variable:
    """A template variable: ``datasource`` (the Prometheus to query) or ``query`` (values of a
    label, e.g. ``label_values(ringray_training_step, job)``)."""

    name: str
    label: str
    kind: str  # "datasource" or "query"
    query: str

    def to_json(self) -> dict:
        common = {"current": {}, "hide": 0, "includeAll": False, "label": self.label,
                  "multi": False, "name": self.name, "options": [], "regex": "",
                  "type": self.kind}
        if self.kind == "datasource":
            return {**common, "query": self.query, "refresh": 1}
        if self.kind == "query":
            # refresh 2: the job list is read again whenever the time range changes.
            return {**common, "datasource": dict(DATASOURCE), "definition": self.query,
                    "query": self.query, "refresh": 2, "sort": 1}
        raise ValueError(f"variable {self.name!r}: kind {self.kind!r} is not one of "
                         "datasource, query")


@dataclass(frozen=True)
class Dashboard:
    """A dashboard: a stable uid, a title, variables, and rows of panels (top to bottom)."""

    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[tuple[Panel, ...], ...]
    tags: tuple[str, ...] = ("ringray",)
    refresh: str = "30s"
    time_from: str = "now-6h"

    def __post_init__(self) -> None:
        for row in self.rows:
            width = sum(panel.width for panel in row)
            if width > GRID_COLUMNS:
                raise ValueError(f"dashboard {self.uid!r}: the row {[p.title for p in row]} is "
                                 f"{' + '.join(str(p.width) for p in row)} = {width} columns "
                                 f"wide, more than the grid's {GRID_COLUMNS}")

    def to_json(self) -> dict:
        panels, y = [], 0
        for row in self.rows:
            x = 0
            for panel in row:
                panels.append(panel.to_json(len(panels) + 1, x, y))
                x += panel.width
            y += max(panel.height for panel in row)
        return {
            "annotations": {"list": []},
            "description": self.description,
            "editable": True,
            "fiscalYearStartMonth": 0,
            "graphTooltip": 1,  # a shared crosshair: the same moment on every panel
            "id": None,
            "links": [],
            "panels": panels,
            "refresh": self.refresh,
            "schemaVersion": SCHEMA_VERSION,
            "tags": list(self.tags),
            "templating": {"list": [v.to_json() for v in self.variables]},
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "timezone": "",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
        }
