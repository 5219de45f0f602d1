"""``ringray eval RUN_OR_MODEL``: RULER's offline tasks and passkey, with lm_eval, over the ring.

    ringray eval runs/quickstart --tasks niah_single_1,ruler_vt --lengths 4096,8192 --cp 2
    ringray eval ckpt/ --lengths 16384 --rope-scaling yarn --rope-factor 2 --limit 20

The evaluation itself is :mod:`ringray.harness.evaluate` (rank 0 of the ring); the tasks are
:mod:`ringray.harness.ruler`'s. Refused in one line before anything starts: an unknown task, a
length past the model's position limit without RoPE scaling, a missing lm_eval.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import typer

from ringray.cli.common import err, fail, load_run

_SCALINGS = ("linear", "llama3", "yarn")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _lengths(text: str, minimum: int) -> list[int]:
    values = []
    for part in _csv(text):
        try:
            value = int(part)
        except ValueError:
            fail(f"--lengths: {part!r} is not a whole number of tokens; e.g. 4096,8192")
        if value < minimum:
            fail(f"--lengths: {value} is below {minimum}, the shortest RULER's templates fit")
        if value not in values:
            values.append(value)
    if not values:
        fail("--lengths: give at least one length, e.g. 4096")
    return values


def _rope_args(pretrained: str, positions: int, scaling: str | None,
               factor: float | None) -> tuple[dict[str, object], int, str]:
    """``(rope.* model arguments, the longest length they allow, how that limit is made)``;
    a bad combination ends the command in one line."""
    from ringray.model import ModelOptions, RopeOptions

    where = f"the model's max_position_embeddings ({positions})"
    if scaling is None and factor is None:
        return {}, positions, where
    if scaling is None:
        fail("--rope-factor: needs --rope-scaling (linear, llama3 or yarn)")
    if scaling not in _SCALINGS:
        fail(f"--rope-scaling: {scaling!r} is not one of {', '.join(_SCALINGS)}")
    if factor is None:
        fail(f"--rope-scaling {scaling}: needs --rope-factor, the context extension factor "
             f"(e.g. 4 for four times {positions} tokens)")
    args: dict[str, object] = {"rope.scaling": scaling, "rope.factor": factor}
    try:
        base = ModelOptions(from_pretrained=pretrained).build().rope_scaling
        original = base.original_max_position_embeddings
        if original is None and scaling in ("llama3", "yarn"):
            original = positions  # the length the checkpoint was trained at
            args["rope.original_max_position_embeddings"] = original
        rope = RopeOptions(scaling=scaling, factor=factor,
                           original_max_position_embeddings=args.get(
                               "rope.original_max_position_embeddings"))
        ModelOptions(from_pretrained=pretrained, rope=rope).build()
    except ValueError as exc:
        fail(f"--rope-scaling {scaling} --rope-factor {factor:g}: {exc}")
    original = original or positions
    limit = int(original * factor)
    return args, limit, f"{original} x --rope-factor {factor:g}"


def _check_lengths(lengths: list[int], limit: int, where: str, scaled: bool,
                   positions: int, config: str) -> None:
    past = [n for n in lengths if n > limit]
    if not past:
        return
    longest = max(past)
    if not scaled:
        fail(f"--lengths: {longest} is past {where}, read from {config}, and no RoPE "
             f"scaling is set; pass --rope-scaling yarn --rope-factor "
             f"{max(2, math.ceil(longest / positions))} (or a length up to {positions})")
    fail(f"--lengths: {longest} is past {limit} ({where}); raise --rope-factor or give a "
         f"length up to {limit}")


def _config_positions(pretrained: Path) -> int:
    from ringray.train.export import read_model_config_positions

    try:
        value = read_model_config_positions(str(pretrained))
    except (OSError, ValueError) as exc:
        fail(" ".join(str(exc).split()))  # names the file
    if value is None:
        fail(f"{pretrained / 'config.json'}: no max_position_embeddings; ringray eval needs "
             f"the model's position limit")
    return value


def evaluate(
    target: str = typer.Argument(
        ..., metavar="RUN_OR_MODEL",
        help="A run directory (job.yaml: its newest checkpoint is exported to a temporary "
             "Hugging Face directory) or a Hugging Face checkpoint directory (config.json, "
             "safetensors, tokenizer)."),
    tasks: str = typer.Option(
        "all", "--tasks",
        help="Comma-separated tasks, or all: niah_single_1, niah_multikey_2, niah_multikey_3, "
             "ringray_niah_multivalue, ringray_niah_multiquery, ruler_vt, ruler_cwe, "
             "ruler_fwe, ringray_passkey. RULER's tasks that download data (the essay "
             "haystacks, SQuAD, HotpotQA) are skipped with a line each; with all, so is a "
             "cell lm_eval cannot build with the model's tokenizer (a named one is refused)."),
    lengths: str = typer.Option("4096", "--lengths",
                                help="Comma-separated context lengths in tokens, e.g. "
                                     "4096,8192 (at least 1024)."),
    cp: int = typer.Option(1, "--cp", min=1,
                           help="Ranks of the ring: local processes (gloo on CPUs, NCCL "
                                "with a GPU each) that split every prompt."),
    limit: int | None = typer.Option(None, "--limit", min=1,
                                     help="Samples per task and length; default: all 500 "
                                          "that lm_eval makes."),
    max_gen_toks: int | None = typer.Option(
        None, "--max-gen-toks", min=1,
        help="Cap on the tokens a sample generates (RULER's tasks allow 30-128). Each token "
             "re-runs the whole prompt (no KV cache), so a cap shortens a CPU run; an answer "
             "longer than it scores lower (a needle's 7-digit value fits in 10)."),
    rope_scaling: str | None = typer.Option(
        None, "--rope-scaling",
        help="RoPE scaling for lengths past the model's max_position_embeddings: linear, "
             "llama3 or yarn (with --rope-factor)."),
    rope_factor: float | None = typer.Option(
        None, "--rope-factor", min=1.0,
        help="Context extension factor of --rope-scaling: lengths up to factor x the "
             "model's max_position_embeddings."),
    out: str | None = typer.Option(
        None, "--out",
        help="Directory for results.json, samples.jsonl and lm_eval.log; default: RUN/eval, "
             "or ./eval-NAME for a Hugging Face directory NAME."),
) -> None:
    """Evaluate a run or a Hugging Face checkpoint on RULER's synthetic long-context tasks
    (lm_eval's own, their data made here for each length; nothing is downloaded) and
    ringray's passkey, every forward over a ring of --cp ranks. Shows a progress bar with
    the time left, prints the scores by task and length, and writes them as JSON.

    Example: ringray eval runs/quickstart --tasks niah_single_1,ruler_vt --cp 2 --limit 20
    """
    from ringray.harness.ruler import missing_packages

    missing = missing_packages()
    if missing:
        fail(f"{', '.join(missing)} not installed: ringray eval runs RULER with lm_eval; "
             f"pip install 'ringray[eval]'")
    from ringray.harness.evaluate import (
        ERROR,
        EvalPlan,
        evaluate_plan,
        format_table,
        offline_environment,
        run_plan,
    )
    from ringray.harness.ruler import MIN_LENGTH, OFFLINE_TASKS, select_tasks
    from ringray.spec import JobSpecError
    from ringray.spec.load import check_output_dir
    from ringray.train.export import exported_positions
    from ringray.train.run_dir import TASK_EVALUATION

    offline_environment()  # before anything imports the hub's libraries; the ranks inherit it

    names = list(OFFLINE_TASKS) if tasks.strip() == "all" else _csv(tasks)
    try:
        chosen, skipped = select_tasks(names)
    except ValueError as exc:
        fail(f"--tasks: {exc}")
    for line in skipped:
        err.print(line, soft_wrap=True)
    if not chosen:
        fail(f"--tasks: nothing left to run offline; valid: {', '.join(OFFLINE_TASKS)}")
    wanted = _lengths(lengths, MIN_LENGTH)

    path = Path(target)
    run_options = None
    if (path / "job.yaml").is_file():
        run_options = load_run(target, [], check_paths=False).train_options()
        positions, config = exported_positions(run_options), f"{target}/job.yaml"
        default_out = path / TASK_EVALUATION
    elif (path / "config.json").is_file():
        positions, config = _config_positions(path), str(path / "config.json")
        default_out = Path(f"eval-{path.resolve().name}")
    else:
        fail(f"RUN_OR_MODEL: {target!r} is neither a run directory (job.yaml) nor a Hugging "
             f"Face checkpoint directory (config.json)")
    if run_options is None:
        rope, limit_length, where = _rope_args(str(path), positions, rope_scaling, rope_factor)
        _check_lengths(wanted, limit_length, where, bool(rope), positions, config)
    elif rope_scaling is None and rope_factor is None:  # checked before the export
        _check_lengths(wanted, positions, f"the run's position limit ({positions})", False,
                       positions, config)
    out_dir = Path(out) if out is not None else default_out
    try:
        check_output_dir("--out", str(out_dir))
    except JobSpecError as exc:
        fail(str(exc))

    exported = None
    about: dict[str, object] = {"source": str(path.resolve())}
    try:
        if run_options is not None:
            exported, step = _export(run_options)
            about.update(run=str(path.resolve()), step=step)
            pretrained = exported
            rope, limit_length, where = _rope_args(pretrained, positions, rope_scaling,
                                                   rope_factor)
            _check_lengths(wanted, limit_length, where, bool(rope), positions, config)
        else:
            pretrained = str(path.resolve())
        model_args = dict(rope)
        plan = EvalPlan(pretrained=pretrained, tasks=tuple(chosen), lengths=tuple(wanted),
                        out=str(out_dir), cp=cp, limit=limit, model_args=model_args,
                        gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None,
                        about=about, skipped=tuple(skipped),
                        skip_unbuildable=tasks.strip() == "all")
        err.print(f"evaluating {about['source']} on {len(chosen)} task(s) x {len(wanted)} "
                  f"length(s), {limit or 500} samples each, ring of {cp}; writing to {out_dir}",
                  soft_wrap=True)
        started = time.monotonic()
        if cp == 1:
            try:
                results = evaluate_plan(plan)
            except (ValueError, OSError) as exc:
                fail(" ".join(str(exc).split()))
        else:
            results = _run_ring(plan, run_plan, out_dir / ERROR)
    finally:
        if exported is not None:
            shutil.rmtree(Path(exported).parent, ignore_errors=True)
    typer.echo(format_table(results))
    typer.echo(f"results: {out_dir / 'results.json'} ({time.monotonic() - started:.0f} s)")


def _export(options) -> tuple[str, int]:
    """The run's newest checkpoint as a Hugging Face directory in a temporary directory."""
    from ringray.train.checkpoint import CheckpointError
    from ringray.train.export import export_hf

    directory = Path(tempfile.mkdtemp(prefix="ringray-eval-")) / "hf"
    try:
        with err.status("exporting the run's newest checkpoint..."):
            ref = export_hf(options, str(directory),
                            refused=lambda exc: err.print(f"refused {exc}", soft_wrap=True))
    except (CheckpointError, ValueError, OSError) as exc:
        shutil.rmtree(directory.parent, ignore_errors=True)
        fail(str(exc))
    err.print(f"exported step {ref.step} ({ref.location})", soft_wrap=True)
    return str(directory), ref.step


def _run_ring(plan, entry, error_file: Path) -> dict:
    """Rank 0 runs ``entry`` over a ring of ``plan.cp`` local processes; its results, or the
    command ends with its error in one line."""
    import torch

    from ringray.harness.evaluate import RESULTS
    from ringray.harness.launch import launch

    error_file.unlink(missing_ok=True)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= plan.cp else "gloo"
    if backend == "gloo" and gpus:  # fewer GPUs than ranks: the ring runs on the CPUs
        plan = replace(plan, model_args={**plan.model_args, "device": "cpu"})
    sys.stderr.flush()
    status = launch(plan.cp, [plan.to_json()], backend=backend, entry=entry)
    if status != 0:
        reason = error_file.read_text(encoding="utf-8").strip() if error_file.is_file() else \
            f"a rank of the ring exited with status {status} (see above)"
        fail(reason)
    return json.loads((Path(plan.out) / RESULTS).read_text(encoding="utf-8"))
