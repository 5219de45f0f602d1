"""``ringray export RUN --hf OUT``: a run's checkpoint as a Hugging Face checkpoint."""

from __future__ import annotations

import typer
from rich.console import Console

from ringray.cli.common import err, fail, load_run

_DTYPES = ("float32", "bfloat16", "float16")


def export(
    run: str = typer.Argument(..., metavar="RUN",
                              help="Run directory (holding job.yaml), e.g. runs/quickstart; "
                              "read from wherever it is now, moved or not."),
    hf: str = typer.Option(..., "--hf", metavar="OUT",
                           help="Directory (or fsspec URL) to write the HF checkpoint to."),
    step: int | None = typer.Option(None, "--step", min=0,
                                    help="The checkpoint's step; default: the newest."),
    dtype: str = typer.Option("float32", "--dtype",
                              help="Weights' dtype: float32 (as trained), bfloat16, float16."),
) -> None:
    """Write a run's checkpoint (replicated or sharded) as a Hugging Face checkpoint that
    transformers.AutoModelForCausalLM.from_pretrained loads.

    Example: ringray export runs/quickstart --hf exported/quickstart --dtype bfloat16
    """
    import torch

    from ringray.spec import JobSpecError
    from ringray.spec.load import _check_output_dir
    from ringray.train.checkpoint import CheckpointError
    from ringray.train.export import export_hf

    if dtype not in _DTYPES:
        fail(f"--dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
    if "://" not in hf:
        try:
            _check_output_dir("--hf", hf)
        except JobSpecError as exc:
            fail(str(exc))
    options = load_run(run, [], check_paths=False).train_options()
    try:
        with err.status("exporting..."):
            ref = export_hf(options, hf, step=step, dtype=getattr(torch, dtype))
    except OSError as exc:  # "[Errno 17] File exists" alone names neither path nor problem
        fail(f"{exc.filename or hf}: {exc.strerror or exc}")
    except (CheckpointError, ValueError) as exc:
        fail(str(exc))
    Console().print(f"exported step {ref.step} ({ref.location}) to {hf}", highlight=False)
