"""``ringray export RUN --hf OUT``: a run's checkpoint as a Hugging Face checkpoint."""

from __future__ import annotations

import re

import typer
from rich.console import Console

from ringray.cli.common import err, fail, load_run

_DTYPES = ("float32", "bfloat16", "float16")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(field: str, text: str) -> int:
    """Bytes from ``5GB``, ``500MB``, ``2GiB`` or a plain count (as transformers'
    ``max_shard_size`` reads them: GB is 10**9 bytes, GiB 2**30); raises ``ValueError``
    naming ``field``."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]I?B|B)?", text.strip().upper())
    if match is None:
        raise ValueError(f"{field}: {text!r} is not a size; use bytes or a number with "
                         f"KB, MB, GB (10**3 steps) or KiB, MiB, GiB (2**10 steps), "
                         f"e.g. 5GB")
    size = float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""]
    if size < 1:
        raise ValueError(f"{field}: {text!r} must be at least 1 byte")
    return int(size)


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
    max_shard_size: str = typer.Option(
        "5GB", "--max-shard-size", metavar="SIZE",
        help="Largest safetensors file (e.g. 5GB, 500MB, 2GiB). The export holds one file's "
             "tensors in memory at a time, not the model."),
) -> None:
    """Write a run's checkpoint (replicated or sharded) as a Hugging Face checkpoint that
    transformers.AutoModelForCausalLM.from_pretrained loads.

    Example: ringray export runs/quickstart --hf exported/quickstart --dtype bfloat16
    """
    import torch

    from ringray.spec import JobSpecError
    from ringray.spec.load import check_output_dir
    from ringray.train.checkpoint import CheckpointError
    from ringray.train.export import export_hf

    if dtype not in _DTYPES:
        fail(f"--dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
    try:
        shard_bytes = parse_size("--max-shard-size", max_shard_size)
    except ValueError as exc:
        fail(str(exc))
    if "://" not in hf:
        try:
            check_output_dir("--hf", hf)
        except JobSpecError as exc:
            fail(str(exc))
    options = load_run(run, [], check_paths=False).train_options()
    try:
        with err.status("exporting..."):
            ref = export_hf(options, hf, step=step, dtype=getattr(torch, dtype),
                            max_shard_bytes=shard_bytes,
                            refused=lambda exc: err.print(f"refused {exc}", highlight=False,
                                                          soft_wrap=True))
    except OSError as exc:  # "[Errno 17] File exists" alone names neither path nor problem
        fail(f"{exc.filename or hf}: {exc.strerror or exc}")
    except (CheckpointError, ValueError) as exc:
        fail(str(exc))
    Console().print(f"exported step {ref.step} ({ref.location}) to {hf}", highlight=False,
                    markup=False, soft_wrap=True)
