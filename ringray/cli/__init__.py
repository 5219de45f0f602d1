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

import sys

import typer

from ringray.cli import bench, dashboards, evaluate, export, jobs, models, plan, report, train


class _OneLineErrors(typer.Typer):
    """The ``ringray`` command: a usage error (an option's value out of range or of the wrong
    type, a missing argument) is one line, ``error: ... (see ringray CMD --help)``, exit code
    2, as every other error of the command line is, not click's five-line box."""

    def __call__(self, *args, **kwargs):
        if kwargs.get("standalone_mode", True) is False:
            return super().__call__(*args, **kwargs)
        from typer._click import exceptions as click  # typer keeps its own copy of click

        try:
            code = super().__call__(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            where = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
            print(f"error: {exc.format_message()}{where}", file=sys.stderr)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            print(f"error: {exc.format_message()}", file=sys.stderr)
            sys.exit(exc.exit_code)
        except typer.Abort:
            print("Aborted.", file=sys.stderr)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = _OneLineErrors(
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
app.command("eval")(evaluate.evaluate)
app.add_typer(bench.app, name="bench")
app.add_typer(dashboards.app, name="dashboards")
app.add_typer(models.app, name="models")


def main() -> None:
    app()
