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
    if scaling is None and factor is None:  # the checkpoint's own scaling, if it has one
        own = _own_limit(ModelOptions(from_pretrained=pretrained).build().rope_scaling,
                         positions)
        return ({}, positions, where) if own is None else ({}, *own)
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


def _own_limit(scaling, positions: int) -> tuple[int, str] | None:
    """``(the longest length, how it is made)`` that a model's own RoPE scaling (its
    config.json's ``rope_scaling``, or a run's ``model.rope``) allows; None without one. An
    exported extension keeps its pretrained ``max_position_embeddings`` beside the scaling,
    so that alone would refuse the lengths it was extended to."""
    if scaling.kind == "none" or scaling.factor <= 1:
        return None
    original = scaling.original_max_position_embeddings or positions
    limit = max(int(original * scaling.factor), positions)
    return limit, f"{original} x the model's {scaling.kind} rope factor {scaling.factor:g}"


def _check_lengths(lengths: list[int], limit: int, where: str, scaled: bool,
                   positions: int, config: str) -> None:
    past = [n for n in lengths if n > limit]
    if not past:
        return
    longest = max(past)
    if not scaled and limit <= positions:
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
        help="Cap on the tokens a sample generates (RULER's tasks allow 30-128). Tokens "
             "after the prompt's forward are decoded from a KV cache, so a cap shortens a "
             "run little; an answer longer than it scores lower (a needle's 7-digit value "
             "fits in 10)."),
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
    address: str | None = typer.Option(
        None, "--address",
        help="Run the ring as Ray workers of the cluster at this address (auto, host:port), "
             "placed as a job's workers are; the model directory, or the run's checkpoint "
             "location (where its export goes), must be on storage every node reads. "
             "Default: local processes."),
    accelerator: str | None = typer.Option(
        None, "--accelerator",
        help="With --address: what each worker owns, cpu (a CPU slot, gloo) or gpu (a GPU, "
             "NCCL); default: the run's cluster.accelerator, or cpu."),
) -> None:
    """Evaluate a run or a Hugging Face checkpoint on RULER's synthetic long-context tasks
    (lm_eval's own, their data made here for each length; nothing is downloaded) and
    ringray's passkey, every forward over a ring of --cp ranks. Shows a progress bar with
    the time left, prints the scores by task and length, and writes them as JSON.

    Example: ringray eval runs/quickstart --tasks niah_single_1,ruler_vt --cp 2 --limit 20
    On a Ray cluster: ringray eval /shared/ckpt --address auto --cp 8 --lengths 32768
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
    if accelerator is not None and accelerator not in ("cpu", "gpu"):
        fail(f"--accelerator: {accelerator!r} is not cpu or gpu")
    if accelerator is not None and address is None:
        fail("--accelerator: only with --address (local ranks use a GPU each when there are "
             "enough, else the CPUs)")

    path = Path(target)
    run_options = run_cluster = None
    if (path / "job.yaml").is_file():
        run_spec = load_run(target, [], check_paths=False)
        run_options, run_cluster = run_spec.train_options(), run_spec.job_options().cluster
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
        own = _own_limit(run_options.model.rope_scaling, positions)
        limit_length, where = own or (positions, f"the run's position limit ({positions})")
        _check_lengths(wanted, limit_length, where, own is not None, positions, config)
    out_dir = Path(out) if out is not None else default_out
    try:
        check_output_dir("--out", str(out_dir))
    except JobSpecError as exc:
        fail(str(exc))

    if address is not None:  # before the export: an unreachable cluster costs nothing
        _connect(address)
    exported = None
    about: dict[str, object] = {"source": str(path.resolve())}
    try:
        if run_options is not None:
            exported, step = _export(run_options, on_cluster=address is not None)
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
        if address is not None:
            results = _run_on_ray(plan, address=address, cluster=run_cluster,
                                  accelerator=accelerator, name=path.resolve().name)
        elif cp == 1:
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


def _export(options, *, on_cluster: bool = False) -> tuple[str, int]:
    """The run's newest checkpoint as a Hugging Face directory in a temporary directory:
    this machine's, or with ``on_cluster`` one beside the checkpoints (every node reads
    them)."""
    from ringray.harness.job import export_dir
    from ringray.train.checkpoint import CheckpointError
    from ringray.train.export import export_hf

    parent = export_dir(options) if on_cluster else Path(tempfile.mkdtemp(prefix="ringray-eval-"))
    directory = parent / "hf"
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


def _connect(address: str) -> None:
    from ringray.cluster.driver import RayUnavailable, connect

    try:
        with err.status(f"connecting to {address}..."):
            connect(address, local_cpus=1)
    except RayUnavailable as exc:
        fail(f"--address {address}: {exc}")


def _run_on_ray(plan, *, address: str, cluster, accelerator: str | None, name: str) -> dict:
    """``plan`` over Ray workers of the cluster at ``address``; rank 0's files are written
    to ``plan.out`` here, and its results returned, or the command ends in one line."""
    from ringray.cluster.evaluation import EvaluationFailed, evaluate_on_ray, evaluation_job
    from ringray.cluster.job_options import ClusterOptions
    from ringray.harness.evaluate import RESULTS

    cluster = cluster or ClusterOptions()
    if accelerator is not None and accelerator != cluster.accelerator:
        cluster = replace(cluster, accelerator=accelerator, worker_resources=None)
    try:
        job = evaluation_job(f"eval-{name}", model_dir=plan.pretrained, cp=plan.cp,
                             lengths=plan.lengths, cluster=cluster)
    except ValueError as exc:
        fail(f"--cp {plan.cp}: {' '.join(str(exc).split())}")
    with _RemoteBar() as bar:
        try:
            files = evaluate_on_ray(job, plan, on_progress=bar.update,
                                    log=lambda line: err.print(line, soft_wrap=True))
        except EvaluationFailed as exc:
            fail(str(exc))
    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    for file_name, text in files.items():
        (out / file_name).write_text(text, encoding="utf-8")
    return json.loads(files[RESULTS])


class _RemoteBar:
    """The progress bar of an evaluation that runs on a Ray worker: rank 0's
    :class:`~ringray.harness.evaluate.EvalProgress`, drawn here, with its new lines."""

    def __init__(self) -> None:
        from ringray.harness.evaluate import progress_bar

        self.progress = progress_bar(err)
        self.bar = self.progress.add_task("starting the ring", total=None, done=0, samples=0)
        self.printed = 0

    def __enter__(self) -> _RemoteBar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, progress) -> None:
        for line in progress.lines[self.printed:]:
            self.progress.console.print(line, soft_wrap=True)
        self.printed = len(progress.lines)
        self.progress.update(self.bar, description=progress.description,
                             completed=progress.completed, total=progress.total or None,
                             done=progress.done, samples=progress.samples)
