"""Grafana dashboards kept as code: "ringray / Job" and "ringray / Ring".

    python dashboards/build.py                        # regenerate dashboards/*.json
    ringray dashboards export DIR                     # write them anywhere
    ringray dashboards push --url URL --token TOKEN   # create or update them on a Grafana

:mod:`ringray.dashboards.model` holds the typed builders, :mod:`ringray.dashboards.build`
the two dashboards (every metric name from :mod:`ringray.metrics.catalog`),
:mod:`ringray.dashboards.push` the upload through ``grafana-client``.
"""

from ringray.dashboards.build import dashboards, panel_queries, render, write_dashboards

__all__ = ["dashboards", "panel_queries", "render", "write_dashboards"]
