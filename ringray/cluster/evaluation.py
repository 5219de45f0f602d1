"""``ringray eval --address``: an evaluation's ring as Ray workers, placed as a job's are.

    job = evaluation_job("eval-smollm", model_dir="/shared/ckpt", cp=4, lengths=(8192,),
                         cluster=ClusterOptions(accelerator="gpu"))
    files = evaluate_on_ray(job, plan, on_progress=draw)   # {"results.json": text, ...}

The workers are the service's own (:class:`~ringray.cluster.worker.TrainWorker` in a
:class:`~ringray.cluster.worker_group.RayWorkerGroup`): one ring of ``cp`` ranks, planned by
the same topology-aware placement, their devices and interfaces set up, one process group
(gloo, or NCCL on GPUs). No training session is opened: rank 0 runs the plan with lm_eval
(:func:`~ringray.harness.job.evaluate_plan_on_group`), the others serve its forwards, and
rank 0's files come back as text for the caller to write where it runs. A worker or node
that dies, or a call that raises, ends the evaluation with one line; the workers and their
placement group are always removed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import ray

from ringray.cluster.errors import CallTimeout, JobError, StopRequested, WorkerGroupFailure
from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.placement import PlacementError
from ringray.cluster.worker_group import RayWorkerGroup, task_evaluation_timeout
from ringray.harness.evaluate import EvalPlan, EvalProgress
from ringray.harness.ruler import RULER_SAMPLES
from ringray.model import ModelOptions
from ringray.train import TrainOptions
from ringray.train.options import ParallelOptions, TrainingOptions


class EvaluationFailed(RuntimeError):
    """The evaluation on Ray did not finish (one line: what, and where)."""


def evaluation_job(name: str, *, model_dir: str, cp: int, lengths: tuple[int, ...],
                   cluster: ClusterOptions | None = None,
                   run_dir: str = "runs/ringray-eval") -> JobOptions:
    """The :class:`JobOptions` that places an evaluation's ring: one ring (dp 1) of ``cp``
    workers for the Hugging Face model in ``model_dir``, sized for the longest of
    ``lengths`` (the placement weighs its links by the K/V block a rank passes), with the
    workers' resources, timeouts and backend of ``cluster`` (a run's own section, or the
    defaults: one CPU slot each). Nothing is trained: the training fields only place it."""
    step = 2 * cp  # zigzag, the default layout, splits a sequence in 2 x cp pieces
    longest = step * math.ceil(max(lengths) / step)
    train = TrainOptions(
        model=ModelOptions(from_pretrained=model_dir).build(), pretrained=model_dir,
        parallel=ParallelOptions(dp=1, cp=cp), train=TrainingOptions(seq_len=longest,
                                                                     global_batch=1),
        run_dir=run_dir)
    return JobOptions(name=name, train=train, cluster=cluster or ClusterOptions())


def evaluate_on_ray(job: JobOptions, plan: EvalPlan, *,
                    on_progress: Callable[[EvalProgress], None] | None = None,
                    log: Callable[[str], None] = lambda line: None) -> dict[str, str]:
    """Run ``plan`` over ``job.cp`` Ray workers (the module docstring) on the cluster this
    process is connected to; returns rank 0's files by name. ``on_progress`` is called with
    rank 0's progress while it runs (about every ``job.cluster.poll_seconds``); ``log``
    gets the placement and the workers' events.

    Raises:
        EvaluationFailed: the ring cannot be placed or started, a worker or its node died,
            a call timed out, or rank 0 refused the plan (a model directory its node cannot
            read, a cell lm_eval cannot build); one line.
    """
    plan = replace(plan, cp=job.cp)
    group = RayWorkerGroup(job, _Log(log), should_stop=lambda: False,
                           name=f"ringray-eval-{job.name}")
    try:
        try:
            placement = group.plan((1,), avoid=frozenset())
        except PlacementError as exc:
            raise EvaluationFailed(f"placement: {exc}") from None
        log(f"placed a ring of {job.cp} on "
            f"{len({rank.node_id for rank in placement.ranks})} node(s)")
        group.start(placement)
        return _run(group, plan, on_progress)
    except (WorkerGroupFailure, JobError, CallTimeout, StopRequested) as exc:
        detail = exc.failure.detail if isinstance(exc, WorkerGroupFailure) else str(exc)
        raise EvaluationFailed(" ".join(detail.split())) from None
    finally:
        group.teardown()


def _run(group: RayWorkerGroup, plan: EvalPlan,
         on_progress: Callable[[EvalProgress], None] | None) -> dict[str, str]:
    cluster = group.job.cluster
    samples = len(plan.tasks) * len(plan.lengths) * (plan.limit or RULER_SAMPLES)
    timeout = task_evaluation_timeout(cluster, samples)
    calls = [w.evaluate_plan.remote(plan, timeout_seconds=cluster.collective_timeout_seconds)
             for w in group.workers]
    asked: list = []

    def poll() -> bool:  # the watch's should_stop, called between its checks
        if on_progress is None:
            return False
        if asked:
            ready, _ = ray.wait(asked, timeout=0)
            if not ready:
                return False
            try:
                progress = ray.get(asked.pop())
            except ray.exceptions.RayError:
                return False  # the watch reports a dead worker
            if progress is not None:
                on_progress(progress)
        asked.append(group.workers[0].task_progress.remote())
        return False

    files = group.watch.wait(calls, timeout=timeout, what="the evaluation",
                             should_stop=poll)[0]
    if on_progress is not None:  # the end, and the lines printed since the last poll
        final = ray.get(group.workers[0].task_progress.remote(),
                        timeout=cluster.startup_timeout_seconds)
        if final is not None:
            on_progress(final)
    return files


class _Log:
    """What :class:`RayWorkerGroup` records, for an evaluation: its events as lines."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.event = lambda message, exc=None: log(message)

    def workers(self, healths: tuple) -> None:
        pass
