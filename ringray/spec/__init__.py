"""The job spec: YAML files in ``jobs/``, validated, with one-line errors and generated docs.

    from ringray.spec import load_job_spec
    spec = load_job_spec("jobs/quickstart.yaml", ["train.steps=20"])
    spec.train_options()      # what the trainer runs
    spec.job_options()        # what the Ray controller runs

- :mod:`~ringray.spec.sections`: YAML sections derived from the components' option
  dataclasses (each option is declared once, by the component that reads it).
- :mod:`~ringray.spec.schema`: :class:`JobSpec`, the sections put together.
- :mod:`~ringray.spec.load`: YAML, ``--set`` overrides, this machine's paths.
- :mod:`~ringray.spec.errors`: the strict YAML reader and one-line error messages.
- :mod:`~ringray.spec.reference`: the job file reference (``docs/job-file.md``), generated.
- :mod:`~ringray.spec.run_spec`: a run's ``job.yaml``, written once its job has started and
  read back wherever the run directory is now.

Only the command line and the entry points (``ringray``, ``python -m ringray.train``) import
this package; the trainer, the model and the attention code take plain options.
"""

from ringray.spec.load import apply_overrides, check_local_paths, load_job_spec, parse_job_spec
from ringray.spec.run_spec import load_run_spec, write_run_spec
from ringray.spec.schema import JobSpec, JobSpecError

__all__ = [
    "JobSpec",
    "JobSpecError",
    "apply_overrides",
    "check_local_paths",
    "load_job_spec",
    "load_run_spec",
    "parse_job_spec",
    "write_run_spec",
]
