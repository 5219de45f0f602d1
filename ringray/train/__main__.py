"""``python -m ringray.train --config FILE [--set section.key=value ...]``

Runs one training job from a job spec, in this process or, under
``torchrun --nproc-per-node N``, on N ranks (gloo on CPU, NCCL on CUDA). Once the job has
started, rank 0 writes the run's ``job.yaml`` as ``ringray train`` does, so that ``ringray
export RUN`` and ``ringray resume RUN`` read a run trained this way too. This entry point is
the edge where the validated spec (``ringray.spec``) meets the trainer: the one import of
the spec inside ``ringray.train``, allowed by name in the layer contracts of pyproject.toml.
The trainer itself takes plain options.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ringray.attention.groups import init_kwargs
from ringray.train.flight_recorder import switch_on_recorder
from ringray.train.host_memory import release_freed_memory
from ringray.train.options import TrainOptions
from ringray.train.replicas import ReplicaMembership
from ringray.train.run_dir import keep_pretrained_files


def _init_distributed(timeout_seconds: float, run_dir: str | None = None) -> None:
    """Join the process group torchrun describes in the environment (if any); every
    collective fails after ``timeout_seconds`` (the job file's, as on Ray). On CUDA the
    group is bound to this rank's device (:func:`~ringray.attention.groups.init_kwargs`).
    With ``run_dir``, torch's flight recorder is on first, and NCCL dumps it into the run
    directory when a collective times out (:func:`~ringray.train.flight_recorder.
    switch_on_recorder`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    device = None
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if run_dir is not None:
        switch_on_recorder(backend, run_dir)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_seconds),
                            **init_kwargs(backend, device))


LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
"""torchft's own variable for the Lighthouse's address (torchtitan's replica groups read it)."""


def replica_membership(count: int, index: int | None, lighthouse: str | None,
                       environ: Mapping[str, str], **settings: object
                       ) -> ReplicaMembership | None:
    """This torchrun's replica group, from ``--replica-group`` and ``--lighthouse``, its
    store being torchrun's (MASTER_ADDR, MASTER_PORT), with the job file's ``settings``
    (timeouts, heal transport); None without replica groups.

    Raises:
        ValueError: one line naming what is missing or does not fit.
    """
    if count < 2:
        if index is not None:
            raise ValueError(f"--replica-group {index}: parallel.dp_replicate is {count} (no "
                             f"replica groups); set parallel.dp_replicate >= 2 or leave "
                             f"--replica-group out")
        return None
    if index is None:
        raise ValueError(f"parallel.dp_replicate: {count} replica groups run as one torchrun "
                         f"each: give each --replica-group I (0 to {count - 1}) and the "
                         f"Lighthouse (--lighthouse or ${LIGHTHOUSE_VARIABLE}); see "
                         f"docs/operations.md")
    if not lighthouse:
        raise ValueError(f"--replica-group {index}: no Lighthouse; give --lighthouse "
                         f"http://HOST:PORT or set ${LIGHTHOUSE_VARIABLE} (start one with "
                         f"torchft_lighthouse --min_replicas 1)")
    if "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
        raise ValueError(f"--replica-group {index}: run under torchrun (its store, "
                         f"MASTER_ADDR:MASTER_PORT, is the group's), e.g. torchrun "
                         f"--nproc-per-node 1 --master-port 29601 -m ringray.train ...")
    return ReplicaMembership(index=index, count=count, lighthouse=lighthouse,
                             store=(environ["MASTER_ADDR"], int(environ["MASTER_PORT"])),
                             **settings)


def group_run(options: TrainOptions, index: int) -> TrainOptions:
    """Replica group ``index``'s own run directory (``RUN/replica-<index>``) and checkpoint
    location (``checkpoint.path/replica-<index>`` when set): each group logs and checkpoints
    its own copy, and a restart of any of them resumes from its newest checkpoint (a group
    behind heals from a live peer at its first step)."""
    suffix = f"replica-{index}"
    path = options.checkpoint.path
    return replace(options, run_dir=f"{options.run_dir.rstrip('/')}/{suffix}",
                   checkpoint=replace(options.checkpoint, path=(
                       f"{path.rstrip('/')}/{suffix}" if path else None)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ringray.train", description="Train one job from a job spec."
    )
    parser.add_argument(
        "--config", required=True, help="job spec (YAML), e.g. jobs/quickstart.yaml"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one field of the spec (repeatable), e.g. --set train.steps=20",
    )
    parser.add_argument(
        "--replica-group", type=int, default=None, metavar="I",
        help="with parallel.dp_replicate R > 1: this torchrun is replica group I (0 to R - 1); "
             "start one torchrun per group, each with its own --master-port",
    )
    parser.add_argument(
        "--lighthouse", default=os.environ.get(LIGHTHOUSE_VARIABLE),
        help=f"with --replica-group: the torchft Lighthouse's address, http://HOST:PORT "
             f"(default: ${LIGHTHOUSE_VARIABLE}); start it on its own: torchft_lighthouse "
             f"--min_replicas 1 --join_timeout_ms 10000",
    )
    args = parser.parse_args(argv)
    is_rank0 = int(os.environ.get("RANK", "0")) == 0
    release_freed_memory()

    from ringray.spec import JobSpecError, load_job_spec, write_run_spec
    from ringray.train.loop import run_training

    try:
        spec = load_job_spec(args.config, args.overrides)
    except JobSpecError as exc:
        if is_rank0:  # one line, naming the file once (as `ringray train` does)
            text = str(exc).replace("\n", "; ")
            where = "" if text.startswith(str(args.config)) else f"{args.config}: "
            print(f"error: {where}{text}", file=sys.stderr)
        return 2
    options = spec.train_options()
    try:
        replica = replica_membership(options.parallel.dp_replicate, args.replica_group,
                                     args.lighthouse, os.environ, **spec.replica_settings())
    except ValueError as exc:
        if is_rank0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    if replica is not None:
        options = group_run(options, replica.index)
    _init_distributed(spec.collective_timeout_seconds(), options.run_dir)

    def write_job_file() -> None:  # as `ringray train` does, once the job has started
        try:
            write_run_spec(spec, run_dir=options.run_dir)
        except OSError as exc:
            print(f"warning: cannot write {options.run_dir}/job.yaml ({exc.strerror}); "
                  f"`ringray export` and `ringray resume` need it", flush=True)
        if options.pretrained is not None:
            try:
                keep_pretrained_files(options.run_dir, options.pretrained)
            except OSError as exc:
                print(f"warning: cannot keep {options.pretrained}'s config.json and tokenizer "
                      f"in {options.run_dir}/pretrained ({exc}); `ringray export` needs them "
                      f"once {options.pretrained} is gone", flush=True)

    try:
        run_training(options, log=lambda line: print(line, flush=True),
                     on_start=write_job_file, replica=replica)
    except ValueError as exc:  # options that do not fit the world, found before training
        if is_rank0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
