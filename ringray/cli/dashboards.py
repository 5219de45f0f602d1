"""``ringray dashboards export | push``: the Grafana dashboards kept as code."""

from __future__ import annotations

import typer
from rich.console import Console

from ringray.cli.common import fail

app = typer.Typer(help="Grafana dashboards (kept as code in ringray.dashboards).",
                  no_args_is_help=True)


@app.command("export")
def dashboards_export(
    directory: str = typer.Argument(..., metavar="DIR",
                                    help="Directory to write the JSON files into."),
) -> None:
    """Write the dashboards' JSON (ringray-job.json, ringray-ring.json) into DIR.

    Example: ringray dashboards export infra/grafana/dashboards
    """
    from ringray.dashboards import write_dashboards
    from ringray.spec import JobSpecError
    from ringray.spec.load import check_output_dir

    if not directory.strip():
        fail("DIR: empty; give the directory to write the JSON files into, e.g. "
             "infra/grafana/dashboards")
    try:
        check_output_dir("DIR", directory)
        paths = write_dashboards(directory)
    except JobSpecError as exc:
        fail(str(exc))
    except OSError as exc:  # e.g. ringray-job.json there is a directory
        fail(f"DIR {directory}: {exc.filename or directory}: {exc.strerror or exc}; give a "
             f"directory where the dashboards' JSON files can be written")
    for path in paths:
        Console().print(str(path), highlight=False, markup=False)


@app.command("push")
def dashboards_push(
    url: str = typer.Option(..., "--url", envvar="GRAFANA_URL",
                            help="Grafana's address, e.g. https://grafana.example.com "
                            "(or $GRAFANA_URL)."),
    token: str = typer.Option(..., "--token", envvar="GRAFANA_TOKEN",
                              help="A Grafana service-account token (or $GRAFANA_TOKEN, which "
                              "keeps it out of the shell history)."),
    folder: str | None = typer.Option(None, "--folder",
                                      help="Folder to put them in (created if missing); "
                                      "default: General."),
) -> None:
    """Create or update the dashboards on a Grafana server (same uids: updates in place).

    Example: ringray dashboards push --url http://localhost:3000 --token $TOKEN --folder ringray
    """
    from ringray.dashboards.push import DashboardPushError, push_dashboards

    try:
        pushed = push_dashboards(url=url, token=token, folder=folder)
    except DashboardPushError as exc:
        fail(str(exc))
    for board in pushed:
        Console().print(f"{board.title}: {board.url} (version {board.version})",
                        highlight=False, markup=False)
