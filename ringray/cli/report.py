"""``ringray report RUN``: PNG plots of a run's steps and of its evaluations."""

from __future__ import annotations

import typer

from ringray.cli.common import fail


def report(
    run: str = typer.Argument(..., metavar="RUN", help="Run directory, e.g. runs/quickstart."),
    out: str | None = typer.Option(None, "--out", help="Directory for the PNGs; default: "
                                   "RUN/report."),
) -> None:
    """PNG plots of a run's loss, tokens/s, overlap (beside it, the longest wait for a late
    ring peer) and load imbalance per step, of passkey retrieval per depth where the run
    holds passkey evaluations (passkey.json and any passkey-<label>.json beside it, e.g. before
    and after a context extension), of each task's score per context length where it holds
    an lm-evaluation-harness evaluation (eval/results.json, from ringray eval RUN or the job),
    and of each task's score per training step, one line per context length, where the job
    also evaluated its checkpoints (eval/step_<step>/results.json, eval.tasks_at_checkpoints).

    Example: ringray report runs/quickstart
    """
    from ringray.plots import ReportError, write_report
    from ringray.spec import JobSpecError
    from ringray.spec.load import check_output_dir

    try:
        if out is not None:
            check_output_dir("--out", out)
        paths = write_report(run, out)
    except (ReportError, JobSpecError) as exc:
        fail(str(exc))
    except OSError as exc:  # the default RUN/report in a run directory that is read-only
        fail(f"{exc.filename or out or run}: {exc.strerror or exc}")
    for path in paths:
        typer.echo(str(path))
