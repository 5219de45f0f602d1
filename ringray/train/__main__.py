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
from datetime import timedelta

import torch
import torch.distributed as dist

from ringray.train.host_memory import release_freed_memory


def _init_distributed() -> None:
    """Join the process group torchrun describes in the environment (if any)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=10))


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
    _init_distributed()
    options = spec.train_options()

    def write_job_file() -> None:  # as `ringray train` does, once the job has started
        try:
            write_run_spec(spec, run_dir=options.run_dir)
        except OSError as exc:
            print(f"warning: cannot write {options.run_dir}/job.yaml ({exc.strerror}); "
                  f"`ringray export` and `ringray resume` need it", flush=True)

    try:
        run_training(options, log=lambda line: print(line, flush=True),
                     on_start=write_job_file)
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
