"""The job as a run ran it: ``RUN/job.yaml``, written by the job's controller under
`ringray train` (rank 0 under torchrun), read by `ringray resume` and `ringray export`.

    write_run_spec(spec, run_dir="/home/me/runs/quickstart")   # once the run has started
    spec = load_run_spec("runs/quickstart-moved", ["train.steps=12"])   # wherever it is now

The file is written only once the job has started: its controller holds the run
directory's lock and the workers have built (and restored any checkpoint). A refused run
(a live run holds the directory, a model that does not match the checkpoints) leaves the
directory as it was. Local paths are recorded absolute (the run may be resumed from another
directory); the default checkpoint location, ``<run_dir>/checkpoints``, is not recorded.

A run directory is self-contained and can be moved: the recorded ``run_dir`` says where the
run was, but :func:`load_run_spec` reads a run from where its job.yaml is now. ``run_dir``
becomes that directory, and a ``checkpoint.path`` inside the recorded run_dir is taken at the
same place inside it; a checkpoint location elsewhere (shared storage, ``s3://``) is used as
recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ringray.spec.errors import load_yaml
from ringray.spec.load import load_job_spec
from ringray.spec.schema import JobSpec, JobSpecError
from ringray.train.run_dir import PRETRAINED_COPY, write_run_spec_file
from ringray.train.run_dir import RUN_SPEC as RUN_SPEC_NAME

_HEADER = ("# The job as run by `ringray train` (overrides applied); `ringray resume RUN` and "
           "`ringray export RUN` read it\n# from wherever RUN is now (run_dir below is where it "
           "was run).\n")


def _absolute(location: str) -> str:
    """A local path made absolute (a URL stays as it is)."""
    return location if "://" in location else str(Path(location).expanduser().resolve())


def run_spec_data(spec: JobSpec, *, run_dir: str) -> dict:
    """What job.yaml holds: the spec as plain data with ``run_dir`` and local paths
    (``checkpoint.path``, ``data.path``, ``model.from_pretrained``) absolute."""
    data = spec.model_dump(mode="json")
    data["run_dir"] = _absolute(run_dir)
    for section, field in (("checkpoint", "path"), ("data", "path"),
                           ("model", "from_pretrained")):
        value = data.get(section, {}).get(field)
        if value is not None:
            data[section][field] = _absolute(value)
    return data


def run_spec_text(spec: JobSpec, *, run_dir: str) -> str:
    """What job.yaml says: a header, then :func:`run_spec_data` as YAML. Under Ray the
    driver makes it and the job's controller writes it (``JobOptions.run_spec``), so that
    one process writes the whole run directory wherever the driver runs."""
    return _HEADER + yaml.safe_dump(run_spec_data(spec, run_dir=run_dir), sort_keys=False)


def write_run_spec(spec: JobSpec, *, run_dir: str) -> Path:
    """Write ``RUN/job.yaml`` whole (a reader never sees half of it); returns its path."""
    return write_run_spec_file(run_dir, run_spec_text(spec, run_dir=run_dir))


def relocation(data: dict, run_dir: Path) -> dict[str, str]:
    """The fields of a job.yaml's ``data`` that change when its run is read from ``run_dir``
    (absolute), by dotted name: ``run_dir``, and ``checkpoint.path`` when it lies inside the
    recorded run_dir; ``model.from_pretrained`` when the source is gone and the run kept its
    config.json and tokenizer (``RUN/pretrained``)."""
    moved = {"run_dir": str(run_dir)}
    model = data.get("model")
    source = model.get("from_pretrained") if isinstance(model, dict) else None
    kept = run_dir / PRETRAINED_COPY
    if (isinstance(source, str) and "://" not in source
            and not (Path(source) / "config.json").is_file() and (kept / "config.json").is_file()):
        moved["model.from_pretrained"] = str(kept)  # the source is gone: the run's own copy
    recorded = data.get("run_dir")
    checkpoint = data.get("checkpoint")
    location = checkpoint.get("path") if isinstance(checkpoint, dict) else None
    if isinstance(recorded, str) and isinstance(location, str) and "://" not in location:
        inside = Path(location)
        if inside.is_relative_to(recorded):
            moved["checkpoint.path"] = str(run_dir / inside.relative_to(recorded))
    return moved


def load_run_spec(run: str | Path, overrides: list[str] | None = None, *,
                  check_paths: bool = True) -> JobSpec:
    """The spec of the run in directory ``run`` (its job.yaml, read from where it is now; see
    the module's docstring), with ``overrides`` applied after the relocation.

    Raises:
        JobSpecError: no job.yaml there, or one that does not validate.
    """
    run_dir = Path(run).expanduser().resolve()
    path = run_dir / RUN_SPEC_NAME
    if not path.is_file():
        raise JobSpecError(f"{run}: no {RUN_SPEC_NAME} here (a run directory that `ringray "
                           f"train` wrote has one once its job has started)")
    try:
        data = load_yaml(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        data = None  # load_job_spec below reports it, naming the file
    else:
        if not data:
            raise JobSpecError(f"{path}: empty, so not the job file `ringray train` wrote when "
                               f"the run started; restore it, or train the run's job file "
                               f"again with run_dir: {run}")
    moved = relocation(data, run_dir) if isinstance(data, dict) else {}
    # JSON strings are YAML scalars: a path with ': ' or '#' in it stays one string.
    relocated = [f"{key}={json.dumps(value)}" for key, value in moved.items()]
    return load_job_spec(path, [*relocated, *(overrides or [])], check_paths=check_paths)
