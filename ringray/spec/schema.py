"""The job spec: the one validated description of a ringray job (YAML files in ``jobs/``).

    spec = load_job_spec("jobs/quickstart.yaml", ["train.steps=20"])   # ringray.spec.load
    spec.train_options()        # TrainOptions: what the trainer runs
    spec.job_options()          # JobOptions: what the Ray controller runs (train + cluster)

Every section is derived from its component's options dataclass
(:func:`~ringray.spec.sections.section_model`), so a field's type, bounds, default and
description are declared once, beside the code that reads it:

========== ===================================================
section    declared by
========== ===================================================
model      :class:`ringray.model.ModelOptions`
data       :class:`ringray.data.DataOptions`
parallel   :class:`ringray.train.ParallelOptions`
train      :class:`ringray.train.TrainingOptions`
checkpoint :class:`ringray.train.CheckpointOptions`
eval       :class:`ringray.train.EvalOptions`
cluster    :class:`ringray.cluster.job_options.ClusterOptions`
metrics    :class:`ringray.metrics.MetricsOptions`
========== ===================================================

Only the job's ``name`` and ``run_dir`` are declared here. Checks of one field's meaning run
in its dataclass; checks across sections run in :class:`~ringray.train.TrainOptions` and
:class:`~ringray.cluster.job_options.JobOptions`. Either way the message names the field
path (``train.seq_len: 1004 cannot be split ...``) and what would be valid.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from ringray.cluster.job_options import ClusterOptions, JobOptions, check_elastic_floor
from ringray.data import DataOptions
from ringray.metrics import MetricsOptions
from ringray.model import ModelOptions
from ringray.spec.sections import Section, section_model
from ringray.train import (
    CheckpointOptions,
    EvalOptions,
    ParallelOptions,
    TrainingOptions,
    TrainOptions,
)

# A name is used in Ray actor names (ringray-job-<name>) and as a directory (runs/<name>).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

ModelSection = section_model(ModelOptions)
DataSection = section_model(DataOptions)
ParallelSection = section_model(ParallelOptions)
TrainSection = section_model(TrainingOptions)
CheckpointSection = section_model(CheckpointOptions)
EvalSection = section_model(EvalOptions)
ClusterSection = section_model(ClusterOptions)
MetricsSection = section_model(MetricsOptions)


class JobSpecError(ValueError):
    """A job spec that does not validate; the message names each bad field."""


class JobSpec(Section):
    name: str = Field(
        "ringray-job",
        description="Job name, also used in Ray actor names and as runs/<name>: letters, "
        "digits, '-', '_' and '.', starting with a letter or digit, at most 63 characters.",
    )
    run_dir: str | None = Field(
        None, min_length=1,
        description="Local run directory (steps.jsonl, events, default checkpoints); null: "
        "runs/<name>.",
    )
    model: ModelSection = Field(default_factory=ModelSection,
                                description="The decoder: a preset and its overrides.")
    data: DataSection = Field(default_factory=DataSection, description="Training data.")
    parallel: ParallelSection = Field(default_factory=ParallelSection,
                                      description="DP × CP mesh and the ring's layout.")
    train: TrainSection = Field(default_factory=TrainSection,
                                description="Steps, batch, optimizer.")
    checkpoint: CheckpointSection = Field(
        default_factory=CheckpointSection, description="Where and how often to checkpoint."
    )
    eval: EvalSection = Field(default_factory=EvalSection,
                              description="Evaluation after training.")
    cluster: ClusterSection = Field(
        default_factory=ClusterSection, description="How `ringray train` runs the job on Ray."
    )
    metrics: MetricsSection = Field(
        default_factory=MetricsSection, description="The controller's Prometheus endpoint."
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                f"{value!r} is not a safe job name (it names Ray actors and directories); use "
                f"letters, digits, '-', '_' and '.', starting with a letter or digit, at most "
                f"63 characters, e.g. 'llama-1b-128k'"
            )
        return value

    @field_validator("run_dir")
    @classmethod
    def _local_run_dir(cls, value: str | None) -> str | None:
        if value is not None and "://" in value:
            raise ValueError(f"{value!r} is a URL; the run directory is local (put checkpoints "
                             f"on remote storage with checkpoint.path)")
        return value

    @model_validator(mode="after")
    def _options_hold(self) -> JobSpec:
        """Build the components' options: their own checks run (each section's alone, then
        those across sections), and a spec that passes them builds."""
        train = self.train_options()
        check_elastic_floor(self._section("cluster"), train)
        self._section("metrics")
        return self

    def _section(self, name: str) -> object:
        try:
            return getattr(self, name).options()
        except ValueError as exc:
            raise ValueError(f"{name}.{exc}") from None

    def train_options(self) -> TrainOptions:
        """The trainer's options for this job."""
        model = self._section("model")
        try:
            config = model.build()
        except ValueError as exc:
            raise ValueError(f"model.{exc}") from None
        return TrainOptions(
            model=config,
            data=self._section("data"),
            parallel=self._section("parallel"),
            train=self._section("train"),
            checkpoint=self._section("checkpoint"),
            eval=self._section("eval"),
            run_dir=self.run_dir or f"runs/{self.name}",
            pretrained=model.from_pretrained,
        )

    def collective_timeout_seconds(self) -> float:
        """How long any collective may wait for a peer before it fails
        (:attr:`ClusterOptions.collective_timeout_seconds`, from ``cluster.step_timeout_seconds``):
        the same bound under torchrun as on Ray."""
        return self._section("cluster").collective_timeout_seconds

    def replica_settings(self) -> dict:
        """A replica group's timeouts and heal transport from the ``cluster`` section
        (:meth:`ClusterOptions.replica_settings`): under torchrun as on Ray."""
        return self._section("cluster").replica_settings()

    def job_options(self) -> JobOptions:
        """What the Ray controller runs (``ringray train``): the mesh must be explicit."""
        for field in ("dp", "cp"):
            if getattr(self.parallel, field) is None:
                raise JobSpecError(
                    f"parallel.{field}: required by `ringray train` (there is no world size to "
                    f"infer it from); give a number"
                )
        return self._job_options(self.train_options())

    def _job_options(self, train: TrainOptions) -> JobOptions:
        return JobOptions(name=self.name, train=train, cluster=self._section("cluster"),
                          metrics=self._section("metrics"))
