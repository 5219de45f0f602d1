"""The ``ringray`` command line: one module per command group, assembled here.

    ringray train jobs/quickstart.yaml                 # an embedded local Ray
    ringray train jobs/quickstart.yaml --address auto  # the Ray cluster this machine is in
    ringray submit jobs/quickstart.yaml --address http://head:8265
    ringray plan jobs/llama-8b-1m-64xh100.yaml --cluster 8x8xH100
    ringray bench ring --world 4 --seq 16384 --heads 8 --kv-heads 2 --head-dim 64
    ringray dashboards push --url http://localhost:3000 --token $GRAFANA_TOKEN
    ringray report runs/quickstart                     # PNG plots of a run's steps

- :mod:`~ringray.cli.common`: the stderr console, one-line errors, the spec loader.
- :mod:`~ringray.cli.train`: ``train`` (and its live progress view).
- :mod:`~ringray.cli.jobs`: ``submit``, ``list``, ``status``, ``logs``, ``stop``, ``resume``.
- :mod:`~ringray.cli.plan`, :mod:`~ringray.cli.report`, :mod:`~ringray.cli.export`: ``plan``,
  ``report``, ``export``.
- :mod:`~ringray.cli.bench`, :mod:`~ringray.cli.dashboards`: the ``bench`` and ``dashboards``
  groups.

The group modules do not import each other's commands or this module (``jobs`` calls
``train``'s ``run_job`` for ``resume``), so there are no cycles. Errors are one line on stderr and a
non-zero exit code, never a traceback.
"""

from __future__ import annotations

import typer

from ringray.cli import bench, dashboards, export, jobs, models, plan, report, train

app = typer.Typer(
    help="ringray: exact ring attention and long-context training on Ray.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command("report")(report.report)
app.command("plan")(plan.plan)
app.command("train")(train.train)
app.command("submit")(jobs.submit)
app.command("list")(jobs.list_jobs)
app.command("status")(jobs.status)
app.command("logs")(jobs.logs)
app.command("stop")(jobs.stop)
app.command("resume")(jobs.resume)
app.command("export")(export.export)
app.add_typer(bench.app, name="bench")
app.add_typer(dashboards.app, name="dashboards")
app.add_typer(models.app, name="models")


def main() -> None:
    app()
