"""ringray's panel kinds on Grafana's foundation SDK: one look per kind, queries, the grid.

    from ringray.dashboards.panels import query, timeseries_panel, place
    loss = timeseries_panel("Loss", 8, "Token-mean cross-entropy.").targets(
        queries(query('ringray_loss{job="$job"}', "loss")))
    board = place(dashboard.Dashboard("ringray / Job").uid("ringray-job"), [[loss, ...], ...])

The SDK (``grafana-foundation-sdk``, generated from Grafana's own schema) types every field;
this module only fixes what every ringray panel shares: the ``$datasource`` variable on each
panel and query, a green base threshold, and each kind's look (legend, tooltip, line style,
reduction). A panel constructor returns the SDK's builder, so a dashboard adds what is its own
(unit, bounds, thresholds) with the SDK's methods.

:func:`place` lays rows of panels out top to bottom and assigns panel ids in that order, so
panels fit the 24-column grid and never overlap by construction, and ids are stable as long
as the order is.
"""

from __future__ import annotations

from collections.abc import Sequence

from grafana_foundation_sdk.builders import (
    bargauge,
    common,
    dashboard,
    heatmap,
    prometheus,
    stat,
    statetimeline,
    timeseries,
)
from grafana_foundation_sdk.models import common as common_model
from grafana_foundation_sdk.models import dashboard as dashboard_model
from grafana_foundation_sdk.models import heatmap as heatmap_model
from grafana_foundation_sdk.models.prometheus import QueryEditorMode

GRID_COLUMNS = 24  # Grafana's dashboard grid is 24 columns wide
DATASOURCE = dashboard_model.DataSourceRef(type_val="prometheus", uid="${datasource}")

Panel = timeseries.Panel | stat.Panel | bargauge.Panel | statetimeline.Panel | heatmap.Panel
Threshold = tuple[float | None, str]  # a colour from the value upwards (None: from -infinity)


def query(expr: str, legend: str = "", *, instant: bool = False) -> prometheus.Dataquery:
    """One PromQL query on the ``$datasource``. ``instant`` asks for the last value only
    (stat and bar-gauge panels that show "now"); otherwise it is a range query drawn over the
    dashboard's time range. An empty legend lets Grafana name the series (``__auto``)."""
    built = (prometheus.Dataquery().datasource(DATASOURCE).editor_mode(QueryEditorMode.CODE)
             .expr(expr).legend_format(legend or "__auto"))
    return built.instant() if instant else built.range()


def queries(*targets: prometheus.Dataquery) -> list[prometheus.Dataquery]:
    """The panel's queries with their reference ids A, B, C... (the SDK leaves them empty)."""
    return [target.ref_id(chr(ord("A") + i)) for i, target in enumerate(targets)]


def thresholds(*steps: Threshold) -> dashboard.ThresholdsConfig:
    """Absolute thresholds; the first step is the base colour (value ``None``)."""
    if not steps or steps[0][0] is not None:
        raise ValueError(f"thresholds {steps}: the first step is the base, (None, colour)")
    return (dashboard.ThresholdsConfig().mode(dashboard_model.ThresholdsMode.ABSOLUTE)
            .steps([dashboard_model.Threshold(value=value, color=color)
                    for value, color in steps]))


def fixed_colors(panel: Panel, colors: Sequence[tuple[str, str]]) -> Panel:
    """Fix a series' colour by its legend name (e.g. a controller state's)."""
    for name, color in colors:
        panel.override_by_name(name, [dashboard_model.DynamicConfigValue(
            id_val="color", value={"fixedColor": color, "mode": "fixed"})])
    return panel


def _common(panel: Panel, title: str, width: int, height: int, description: str) -> Panel:
    """What every panel shares: title, size, description, the datasource variable, the
    ``short`` unit and a green base threshold (a panel may set its own)."""
    if not 1 <= width <= GRID_COLUMNS or height < 1:
        raise ValueError(f"panel {title!r}: width {width} must be 1..{GRID_COLUMNS} and "
                         f"height {height} at least 1")
    return (panel.title(title).description(description).datasource(DATASOURCE)
            .span(width).height(height).unit("short").thresholds(thresholds((None, "green"))))


def _legend(*, show: bool = True) -> common.VizLegendOptions:
    return (common.VizLegendOptions().show_legend(show).display_mode(
        common_model.LegendDisplayMode.LIST).placement(common_model.LegendPlacement.BOTTOM)
            .calcs([]))


def _last_value() -> common.ReduceDataOptions:
    return common.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)


def timeseries_panel(title: str, width: int, description: str = "", *,
                     height: int = 8) -> timeseries.Panel:
    """Lines over time, thin and lightly filled; the tooltip lists every series, largest
    first, so a straggler rank is on top."""
    panel = _common(timeseries.Panel(), title, width, height, description)
    return (panel.legend(_legend())
            .tooltip(common.VizTooltipOptions().mode(common_model.TooltipDisplayMode.MULTI)
                     .sort(common_model.SortOrder.DESCENDING))
            .fill_opacity(10).line_width(1).show_points(common_model.VisibilityMode.NEVER)
            .span_nulls(False))


def as_steps(panel: timeseries.Panel) -> timeseries.Panel:
    """Counts and sizes that change in steps (world size, restarts): drawn as steps, not
    slopes, and unfilled."""
    return (panel.fill_opacity(0).line_width(2)
            .line_interpolation(common_model.LineInterpolation.STEP_AFTER))


def with_threshold_areas(panel: timeseries.Panel) -> timeseries.Panel:
    """Draw the thresholds behind the lines (a line and a shaded area per step)."""
    return panel.thresholds_style(common.GraphThresholdsStyleConfig().mode(
        common_model.GraphThresholdsStyleMode.LINE_AND_AREA))


def stat_panel(title: str, width: int = 4, description: str = "", *,
               height: int = 4) -> stat.Panel:
    """One big number: the last value, coloured by the thresholds, no sparkline."""
    panel = _common(stat.Panel(), title, width, height, description)
    return (panel.color_mode(common_model.BigValueColorMode.VALUE)
            .graph_mode(common_model.BigValueGraphMode.NONE)
            .justify_mode(common_model.BigValueJustifyMode.AUTO)
            .orientation(common_model.VizOrientation.AUTO)
            .text_mode(common_model.BigValueTextMode.AUTO).reduce_options(_last_value()))


def bargauge_panel(title: str, width: int, description: str = "", *,
                   height: int = 8) -> bargauge.Panel:
    """Horizontal bars of the last values, one per series: the longest stands out."""
    panel = _common(bargauge.Panel(), title, width, height, description)
    return (panel.display_mode(common_model.BarGaugeDisplayMode.GRADIENT).min_viz_height(16)
            .orientation(common_model.VizOrientation.HORIZONTAL).show_unfilled(True)
            .reduce_options(_last_value()))


def state_timeline_panel(title: str, width: int, description: str = "", *,
                         height: int = 8) -> statetimeline.Panel:
    """One row per series, coloured while its value holds (merged runs, no value text)."""
    panel = _common(statetimeline.Panel(), title, width, height, description)
    return (panel.align_value(common_model.TimelineValueAlignment.LEFT)
            .legend(_legend(show=False)).merge_values(True).row_height(0.8)
            .show_value(common_model.VisibilityMode.NEVER)
            .tooltip(common.VizTooltipOptions().mode(common_model.TooltipDisplayMode.SINGLE)
                     .sort(common_model.SortOrder.NONE)))


def heatmap_panel(title: str, width: int, description: str = "", *, height: int = 8,
                  row_label: str = "", cell_unit: str = "") -> heatmap.Panel:
    """Series as rows of cells (``calculate`` off: the series are the rows already, e.g. one
    per rank, not buckets to compute), an exponential orange scale that makes a small
    exposed time visible next to a large one."""
    panel = _common(heatmap.Panel(), title, width, height, description)
    color = (heatmap.HeatmapColorOptions().mode(heatmap_model.HeatmapColorMode.SCHEME)
             .scheme("Oranges").fill("dark-orange").scale(heatmap_model.HeatmapColorScale
                                                          .EXPONENTIAL)
             .exponent(0.5).steps(64).reverse(False))
    y_axis = heatmap.YAxisConfig().axis_placement(common_model.AxisPlacement.LEFT).reverse(False)
    if row_label:
        y_axis.axis_label(row_label)
    panel = (panel.calculate(False).cell_gap(1).color(color).show_legend()
             .rows_frame(heatmap.RowsHeatmapOptions().layout(
                 common_model.HeatmapCellLayout.AUTO))
             .mode(common_model.TooltipDisplayMode.SINGLE).hide_y_histogram().y_axis(y_axis))
    if cell_unit:
        panel.cell_values(heatmap.CellValues().unit(cell_unit))
    return panel


def place(board: dashboard.Dashboard,
          rows: Sequence[Sequence[Panel]]) -> dashboard.Dashboard:
    """Add ``rows`` (top to bottom; each row's panels left to right) to ``board``, each panel
    at its explicit grid position with the next id (1, 2, ...).

    Raises:
        ValueError: for a row wider than the grid, naming its panels and their widths.
    """
    panel_id, y = 1, 0
    for row in rows:
        sizes = [panel.build().grid_pos for panel in row]  # build() is the live object
        widths = [size.w for size in sizes]
        if sum(widths) > GRID_COLUMNS:
            titles = [panel.build().title for panel in row]
            raise ValueError(f"the row {titles} is {' + '.join(map(str, widths))} = "
                             f"{sum(widths)} columns wide, more than the grid's {GRID_COLUMNS}")
        x = 0
        for panel, size in zip(row, sizes, strict=True):
            panel.id(panel_id).grid_pos(dashboard_model.GridPos(h=size.h, w=size.w, x=x, y=y))
            board.with_panel(panel)
            panel_id, x = panel_id + 1, x + size.w
        y += max(size.h for size in sizes)
    return board
