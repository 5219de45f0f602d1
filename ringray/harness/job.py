"""A job's own task evaluation: its ``eval.tasks`` after training, its workers as the ring.

    files = evaluate_job_tasks(options, step=120, timeout_s=900.0)   # every rank, collective
    # rank 0: {"results.json": ..., "samples.jsonl": ..., "lm_eval.log": ...}; others: None
    files = evaluate_plan_on_group(plan, timeout_s=900.0)   # ringray eval --address: the same

Called on every rank of a job's process group (the Ray service's workers, once the final
checkpoint is committed). The whole group is one ring (``cp`` = its size: an evaluation has
no data parallelism). Rank 0 exports checkpoint ``step`` to a temporary Hugging Face
directory on the checkpoint's storage, which every rank reads (in a child process: reading a
checkpoint is collective where there is a process group), then runs
:func:`~ringray.harness.evaluate.evaluate_plan` (lm_eval, the tasks' data made for each
length); the other ranks serve its forwards (:func:`~ringray.harness.ring.serve`). The
files it writes are returned as text, for the controller to keep in the run directory, and
the temporary directories are removed.

Two groups are made over the same ranks: the ring's (``timeout_s``: a rank that dies or
hangs in a forward fails the others within it) and rank 0's calls (as long as lm_eval may
take between two forwards). A failure on rank 0 before the ring has run a call tells the
others to stop, so they return; a failure inside a forward leaves the others in it, and
the caller (the controller's watch) tears the workers down.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ringray.harness.evaluate import (
    LOG,
    RESULTS,
    SAMPLES,
    EvalPlan,
    evaluate_plan,
    forget_progress,
)
from ringray.harness.launch import DEFAULT_IDLE_TIMEOUT_S
from ringray.harness.ring import Groups, current_groups, lead, serve, use_groups
from ringray.train import TrainOptions

EXPORT_PREFIX = ".ringray-eval-export-"
"""Name prefix of the temporary export beside the run's checkpoints."""


def job_plan(options: TrainOptions, *, pretrained: str, out: str, cp: int,
             step: int) -> EvalPlan:
    """The :class:`EvalPlan` of a job's ``eval`` section: its tasks, lengths and samples,
    over a ring of ``cp`` ranks with the job's attention backend and precision."""
    evaluation = options.eval
    gen = {"max_gen_toks": evaluation.task_max_gen_toks} if evaluation.task_max_gen_toks \
        else None
    return EvalPlan(
        pretrained=pretrained, tasks=evaluation.tasks, lengths=evaluation.task_lengths,
        out=out, cp=cp, limit=evaluation.task_samples, gen_kwargs=gen,
        model_args={"attention_backend": options.parallel.attention_backend,
                    "precision": options.train.precision},
        about={"run": options.run_dir, "step": step})


def export_dir(options: TrainOptions) -> Path:
    """A new directory beside the checkpoints when they are on a local or shared
    filesystem (every rank reads it), else in this node's temporary directory (a job on
    one node)."""
    location = options.checkpoint_location
    base = None if "://" in location else Path(location)
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=EXPORT_PREFIX, dir=base))


def _export(options: TrainOptions, out_dir: str, step: int) -> None:
    from ringray.train.export import export_hf

    export_hf(options, out_dir, step=step)


def export_alone(options: TrainOptions, out_dir: str, step: int) -> None:
    """Export checkpoint ``step`` as a Hugging Face directory in a child process: reading a
    checkpoint is collective in a process with a process group, and only rank 0 exports.
    The child's error is raised here."""
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        pool.submit(_export, options, out_dir, step).result()


def _files(out: Path) -> dict[str, str]:
    return {name: (out / name).read_text(encoding="utf-8")
            for name in (RESULTS, SAMPLES, LOG) if (out / name).is_file()}


def _lead(options: TrainOptions, step: int, groups: Groups) -> dict[str, str]:
    export = export_dir(options)
    out = Path(tempfile.mkdtemp(prefix="ringray-eval-"))
    try:
        export_alone(options, str(export / "hf"), step)
        plan = job_plan(options, pretrained=str(export / "hf"), out=str(out),
                        cp=dist.get_world_size(groups.work), step=step)
        evaluate_plan(plan)
        return _files(out)
    finally:
        shutil.rmtree(export, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def _lead_plan(plan: EvalPlan) -> dict[str, str]:
    forget_progress()
    if not (Path(plan.pretrained) / "config.json").is_file():
        raise ValueError(f"{plan.pretrained}: no config.json on {socket.gethostname()}, the "
                         f"node of the ring's rank 0; on a cluster the model directory must "
                         f"be on storage every node reads")
    out = Path(tempfile.mkdtemp(prefix="ringray-eval-"))
    try:
        evaluate_plan(replace(plan, out=str(out)))
        return _files(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _over_group(lead_work, *, timeout_s: float,
                idle_timeout_s: float) -> dict[str, str] | None:
    """Every rank of the default process group as one ring: rank 0 runs
    ``lead_work(groups)`` and returns its files, the others serve it and return ``None``."""
    ranks = list(range(dist.get_world_size()))
    work = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(ranks, timeout=timedelta(seconds=idle_timeout_s))
    groups, previous = Groups(work=work, control=control), current_groups()
    use_groups(groups)
    try:
        if dist.get_rank() == 0:
            return lead(lambda: lead_work(groups), groups)
        serve(groups)
        return None
    finally:
        use_groups(previous)
        for group in (work, control):
            dist.destroy_process_group(group)


def evaluate_job_tasks(options: TrainOptions, *, step: int, timeout_s: float,
                       idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> dict[str, str] | None:
    """Evaluate the job's ``eval.tasks`` on checkpoint ``step`` over every rank of the
    default process group (collective; see the module docstring). Rank 0 returns the
    written files' texts by name, the other ranks ``None``.

    Raises:
        ValueError: a cell cannot be built with the model's tokenizer (one line), on rank 0.
        CheckpointError: the checkpoint cannot be exported, on rank 0.
    """
    return _over_group(lambda groups: _lead(options, step, groups), timeout_s=timeout_s,
                       idle_timeout_s=idle_timeout_s)


def evaluate_plan_on_group(plan: EvalPlan, *, timeout_s: float,
                           idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
                           ) -> dict[str, str] | None:
    """``plan`` (``ringray eval --address``: a Hugging Face directory every rank reads) over
    every rank of the default process group, as :func:`evaluate_job_tasks` runs a job's
    tasks; ``plan.out`` is not written (rank 0 returns the files' texts, for the caller to
    write where it runs).

    Raises:
        ValueError: ``plan.pretrained`` is not readable on rank 0's node, or a cell cannot
            be built (one line), on rank 0.
    """
    return _over_group(lambda groups: _lead_plan(plan), timeout_s=timeout_s,
                       idle_timeout_s=idle_timeout_s)
