"""Grafana dashboards kept as code: "ringray / Job" and "ringray / Ring".

    python dashboards/build.py                        # regenerate dashboards/*.json
    ringray dashboards export DIR                     # write them anywhere
    ringray dashboards push --url URL --token TOKEN   # create or update them on a Grafana

:mod:`ringray.dashboards.build` holds the two dashboards (every metric name from
:mod:`ringray.metrics.catalog`), built with Grafana's foundation SDK
(``grafana-foundation-sdk``); :mod:`ringray.dashboards.panels` ringray's look per panel kind
on the SDK's builders; :mod:`ringray.dashboards.push` the upload through ``grafana-client``.
"""

from ringray.dashboards.build import dashboards, panel_queries, render, write_dashboards

__all__ = ["dashboards", "panel_queries", "render", "write_dashboards"]
