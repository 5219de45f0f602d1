"""Torch's flight recorder switched on for a training process: the environment it reads.

    os.environ.update(recorder_environment("nccl", directory=run / "flight-recorder" / "x",
                                           dump_seconds=30))   # before init_process_group

torch keeps each process's recent collectives (which one, on which group, its sequence
number, whether it finished) only when ``TORCH_FR_BUFFER_SIZE`` says how many; NCCL writes
them out by itself on a collective's timeout or error only when told to, and where. Both are
read once, when the process group is made, so they are set before it. Under Ray the service
gives them to every worker and also asks hung workers for their recorders before it kills
them (:mod:`ringray.cluster.flight_recorder`); under torchrun the entry point sets them
(``python -m ringray.train``), so a hung NCCL collective leaves its dump in the run
directory when the job's collective timeout fires.
"""

from __future__ import annotations

from pathlib import Path

FLIGHT_RECORDER_DIR = "flight-recorder"
"""Under the run directory: one directory per start of a group of workers."""
RECORDER_ENTRIES = 2000
"""Collectives each process remembers (torch's default, set explicitly)."""
NCCL_DUMP_PREFIX = "nccl_rank_"
"""NCCL's own dumps on a collective timeout or error: ``nccl_rank_<r>``."""
TORCHRUN_RECORDERS = "torchrun"
"""Under torchrun, the directory of ``RUN/flight-recorder/`` the ranks' NCCL dumps go to."""
TORCHRUN_DUMP_SECONDS = 30.0
"""Under torchrun, how long NCCL's watchdog gives a timed-out rank to write its dump."""


def recorder_environment(backend: str, *, directory: str | Path,
                         dump_seconds: float) -> dict[str, str]:
    """The environment a worker starts with (before torch forms a process group): the
    recorder's size for every backend (``TORCH_FR_BUFFER_SIZE``); for NCCL also its dump on
    a collective timeout or error (``TORCH_NCCL_DUMP_ON_TIMEOUT``, which needs the heartbeat
    monitor, ``TORCH_NCCL_ENABLE_MONITORING``), into ``directory``
    (``TORCH_FR_DUMP_TEMP_FILE`` + rank), given ``dump_seconds`` to write it before the
    process is torn down (``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``). torch 2.13's names: it
    reads ``TORCH_NCCL_TRACE_BUFFER_SIZE`` and ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` only as
    deprecated aliases of the first two (and warns when one is set), so they are not."""
    environment = {"TORCH_FR_BUFFER_SIZE": str(RECORDER_ENTRIES)}
    if backend != "nccl":
        return environment
    return {
        **environment,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(Path(directory) / NCCL_DUMP_PREFIX),
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(int(dump_seconds * 1000)),
    }


def switch_on_recorder(backend: str, run_dir: str | Path,
                       environ: dict[str, str] | None = None) -> Path:
    """Under torchrun: set this process's recorder variables (those not already set, so a
    user's own win) before it joins its process group, dumps into
    ``RUN/flight-recorder/torchrun/``; returns that directory (made here: torch makes none).
    ``environ`` defaults to ``os.environ``."""
    import os

    environ = os.environ if environ is None else environ
    directory = Path(run_dir) / FLIGHT_RECORDER_DIR / TORCHRUN_RECORDERS
    for name, value in recorder_environment(backend, directory=directory,
                                            dump_seconds=TORCHRUN_DUMP_SECONDS).items():
        environ.setdefault(name, value)
    if backend == "nccl":
        directory.mkdir(parents=True, exist_ok=True)
    return directory
