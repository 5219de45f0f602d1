"""The job spec: the one validated description of a ringray job (YAML files in ``jobs/``).

    spec = load_job_spec("jobs/quickstart.yaml", overrides=["train.steps=20"])
    options = spec.train_options()          # what the trainer runs
    cluster = spec.cluster_options()        # what the Ray controller needs (ringray train)

Every field carries a description (``ringray`` prints them); unknown fields are errors. Checks
that involve several fields (the sequence length against the layout and the ring size, heads
against kv heads, the batch against dp) name the field to change and what would be valid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ringray.attention.backends import BACKENDS
from ringray.attention.layouts import BUILTIN_LAYOUTS, seq_len_divisor
from ringray.cluster.options import ClusterOptions
from ringray.model import MODEL_PRESETS, ModelConfig, model_preset
from ringray.train.options import OptimizerOptions, PasskeyEvalOptions, TrainOptions


def _one_of(value: str, valid: list[str], what: str) -> str:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Section):
    preset: str = Field("debug", description=f"Model shape preset: {', '.join(MODEL_PRESETS)}.")
    dim: int | None = Field(None, ge=1, description="Hidden size (default: the preset's).")
    n_layers: int | None = Field(None, ge=1, description="Decoder blocks (default: the preset's).")
    n_heads: int | None = Field(None, ge=1, description="Query heads (default: the preset's).")
    n_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads; n_heads must be a multiple (GQA/MQA)."
    )
    ffn_hidden: int | None = Field(None, ge=1, description="SwiGLU hidden size.")
    rope_theta: float | None = Field(None, gt=0, description="Rotary embedding base.")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        return _one_of(value, list(MODEL_PRESETS), "preset")

    def build(self) -> ModelConfig:
        overrides = self.model_dump(exclude={"preset"}, exclude_none=True)
        return model_preset(self.preset, **overrides)


class DataSpec(_Section):
    source: Literal["stdlib", "files", "passkey"] = Field(
        "stdlib",
        description="Training text: 'stdlib' (the Python standard library's source files, "
        "no setup), 'files' (the .txt/.jsonl files under data.path) or 'passkey' "
        "(synthetic passkey-retrieval samples, one per sequence).",
    )
    path: str | None = Field(None, description="Directory of .txt/.jsonl files (source 'files').")
    seed: int = Field(0, description="Document order seed (the loader is deterministic).")


class ParallelSpec(_Section):
    dp: int | None = Field(
        1, ge=1, description="Data-parallel replicas; null: world size / cp."
    )
    cp: int | None = Field(
        None, ge=1, description="Context-parallel ring size; null: world size / dp."
    )
    layout: str = Field(
        "zigzag",
        description=f"How sequences are split over a ring: {', '.join(BUILTIN_LAYOUTS)}.",
    )
    attention_backend: str = Field(
        "auto", description="Local attention kernel: auto, or one of the registered backends."
    )

    @field_validator("layout")
    @classmethod
    def _known_layout(cls, value: str) -> str:
        return _one_of(value, list(BUILTIN_LAYOUTS), "layout")

    @field_validator("attention_backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        return _one_of(value, ["auto", *BACKENDS], "backend")


class OptimizerSpec(_Section):
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Cosine decay floor, as a fraction of lr."
    )
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay on weight matrices.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient L2 norm; 0: no clipping.")


class TrainSpec(_Section):
    steps: int = Field(100, ge=1, description="Optimizer steps (the schedule's length).")
    global_batch: int = Field(
        4, ge=1, description="Sequences per step over all data-parallel replicas."
    )
    seq_len: int = Field(
        1024, ge=2, description="Tokens per sequence (split over the ring by the layout)."
    )
    seed: int = Field(0, description="Weight initialisation seed.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="AdamW and LR.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on CPU."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each block in the backward pass to save memory."
    )
    log_every: int = Field(10, ge=1, description="Print a progress line every N steps.")
    peak_tflops_per_device: float | None = Field(
        None, gt=0,
        description="Peak TFLOP/s per device for MFU; null: a known GPU's bf16 peak, or a "
        "float32 matmul measured at start on CPU.",
    )


class CheckpointSpec(_Section):
    path: str | None = Field(
        None,
        description="Directory or fsspec URL (e.g. s3://bucket/job) for checkpoints; every node "
        "must reach it. null: <run_dir>/checkpoints.",
    )
    interval: int = Field(0, ge=0, description="Steps between checkpoints; 0: only at the end.")
    keep: int = Field(3, ge=1, description="Complete checkpoints kept (older ones are deleted).")
    resume: bool = Field(True, description="Resume from the newest complete checkpoint.")


class EvalSpec(_Section):
    passkey_lengths: list[int] = Field(
        default_factory=list, description="Context lengths for passkey retrieval after training."
    )
    passkey_depths: list[float] = Field(
        default_factory=lambda: [0.1, 0.5, 0.9], description="Needle depths, 0 (start) to 1."
    )
    passkey_samples: int = Field(4, ge=1, description="Samples per (length, depth) cell.")


class ClusterSpec(_Section):
    accelerator: Literal["cpu", "gpu"] = Field(
        "cpu", description="What each worker owns: one GPU (NCCL rings) or one CPU slot (gloo)."
    )
    worker_resources: dict[str, float] | None = Field(
        None,
        description="Ray resources of one worker, e.g. {GPU: 1, CPU: 8}; null: {GPU: 1} for "
        "accelerator gpu, {CPU: 1} for cpu. A custom resource pins workers to the nodes "
        "that offer it.",
    )
    dp_min: int | None = Field(
        None, ge=1,
        description="Elastic floor: the job runs at the largest dp from dp_min to parallel.dp "
        "that fits the live nodes and divides train.global_batch, instead of waiting; null: "
        "parallel.dp (a fixed size).",
    )
    max_failures: int = Field(
        3, ge=0, description="Faults recovered before the job fails (preemptions not counted)."
    )
    step_timeout_seconds: float = Field(
        300, gt=0, description="A step (or checkpoint) that takes longer is a hang: recover."
    )
    startup_timeout_seconds: float = Field(
        120, gt=0, description="Time for workers, process groups and trainers to come up."
    )
    capacity_wait_seconds: float = Field(
        600, ge=0,
        description="How long to wait for room for dp_min rings before the job fails "
        "(an embedded local Ray does not wait: nothing can join it).",
    )
    grow_after_seconds: float = Field(
        10, ge=0,
        description="New capacity must stay live this long before the job grows into it "
        "(at the next checkpoint boundary), so a flickering node never makes it flap.",
    )
    failure_domain: str | None = Field(
        "zone", description="Node label whose values DP replicas are spread over."
    )
    request_resources: bool = Field(
        True, description="Ask the Ray autoscaler for the full size while running smaller."
    )
    intra_node_gbps: float | None = Field(
        None, gt=0, description="Link speed inside a node (Gb/s) for the placement's costs."
    )
    inter_node_gbps: float | None = Field(
        None, gt=0, description="Link speed between nodes (Gb/s) for the placement's costs."
    )

    @field_validator("worker_resources")
    @classmethod
    def _positive_resources(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None:
            if not value:
                raise ValueError("give at least one resource, e.g. {CPU: 1}")
            bad = {k: v for k, v in value.items() if v <= 0}
            if bad:
                raise ValueError(f"amounts must be positive, got {bad}")
        return value


class MetricsSpec(_Section):
    address: str = Field(
        "127.0.0.1",
        description="Address the controller serves Prometheus metrics on: loopback by "
        "default; 0.0.0.0 lets a cluster's Prometheus scrape the head node.",
    )
    port: int | None = Field(
        9477, ge=0, le=65535,
        description="Port of the /metrics endpoint (0: any free port, shown at start; null: "
        "no endpoint).",
    )


class JobSpec(_Section):
    name: str = Field("ringray-job", min_length=1, description="Job name.")
    run_dir: str | None = Field(
        None, description="Run directory (steps.jsonl, checkpoints); null: runs/<name>."
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="The decoder's shape.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    parallel: ParallelSpec = Field(default_factory=ParallelSpec, description="DP × CP mesh.")
    train: TrainSpec = Field(default_factory=TrainSpec, description="Steps, batch, optimizer.")
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Where and how often to checkpoint."
    )
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Evaluation after training.")
    cluster: ClusterSpec = Field(
        default_factory=ClusterSpec, description="How `ringray train` runs the job on Ray."
    )
    metrics: MetricsSpec = Field(
        default_factory=MetricsSpec, description="The controller's Prometheus endpoint."
    )

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        try:
            self.model.build()
        except ValueError as exc:
            raise ValueError(f"model.{exc}") from None
        if self.data.source == "files" and not self.data.path:
            raise ValueError("data.path: required when data.source is 'files'")
        if self.data.source != "files" and self.data.path:
            raise ValueError(
                f"data.path: only read when data.source is 'files' (it is "
                f"{self.data.source!r}); remove it or set data.source: files"
            )
        dp, cp = self.parallel.dp, self.parallel.cp
        if dp is not None and self.train.global_batch % dp:
            raise ValueError(
                f"train.global_batch: {self.train.global_batch} does not split over "
                f"parallel.dp={dp} replicas; use a multiple of {dp}"
            )
        if cp is not None:
            divisor = seq_len_divisor(self.parallel.layout, cp)
            lengths = [("train.seq_len", self.train.seq_len)] + [
                ("eval.passkey_lengths", n) for n in self.eval.passkey_lengths
            ]
            for field, length in lengths:
                if length % divisor:
                    raise ValueError(
                        f"{field}: {length} cannot be split by layout "
                        f"{self.parallel.layout!r} over cp={cp} ranks; use a multiple of "
                        f"{divisor}"
                    )
        dp_min = self.cluster.dp_min
        if dp_min is not None and dp is not None:
            if dp_min > dp:
                raise ValueError(
                    f"cluster.dp_min: {dp_min} is larger than parallel.dp={dp} (the size the "
                    f"job asks for); use a value from 1 to {dp}"
                )
            if self.train.global_batch % dp_min:
                raise ValueError(
                    f"cluster.dp_min: train.global_batch={self.train.global_batch} does not "
                    f"split over dp_min={dp_min} replicas; use a divisor of it (sizes between "
                    f"dp_min and parallel.dp that do not divide it are skipped)"
                )
        return self

    def cluster_options(self) -> ClusterOptions:
        """What the Ray controller needs (``ringray train``): the mesh must be explicit."""
        for field in ("dp", "cp"):
            if getattr(self.parallel, field) is None:
                raise JobSpecError(
                    f"parallel.{field}: required by `ringray train` (there is no world size to "
                    f"infer it from); give a number"
                )
        cluster = self.cluster
        resources = cluster.worker_resources or (
            {"GPU": 1.0} if cluster.accelerator == "gpu" else {"CPU": 1.0}
        )
        return ClusterOptions(
            job_name=self.name,
            cp=self.parallel.cp,
            dp_max=self.parallel.dp,
            dp_min=cluster.dp_min or self.parallel.dp,
            accelerator=cluster.accelerator,
            worker_resources=dict(resources),
            max_failures=cluster.max_failures,
            step_timeout_seconds=cluster.step_timeout_seconds,
            startup_timeout_seconds=cluster.startup_timeout_seconds,
            capacity_wait_seconds=cluster.capacity_wait_seconds,
            grow_after_seconds=cluster.grow_after_seconds,
            failure_domain=cluster.failure_domain,
            request_resources=cluster.request_resources,
            intra_node_gbps=cluster.intra_node_gbps,
            inter_node_gbps=cluster.inter_node_gbps,
            metrics_address=self.metrics.address,
            metrics_port=self.metrics.port,
        )

    def train_options(self) -> TrainOptions:
        """The trainer's options for this job."""
        opt, train = self.train.optimizer, self.train
        peak = train.peak_tflops_per_device
        return TrainOptions(
            model=self.model.build(),
            seq_len=train.seq_len,
            global_batch=train.global_batch,
            steps=train.steps,
            dp=self.parallel.dp,
            cp=self.parallel.cp,
            layout=self.parallel.layout,
            attention_backend=self.parallel.attention_backend,
            data_source=self.data.source,
            data_path=self.data.path,
            data_seed=self.data.seed,
            seed=train.seed,
            optimizer=OptimizerOptions(**opt.model_dump()),
            precision=train.precision,
            activation_checkpointing=train.activation_checkpointing,
            peak_flops_per_device=peak * 1e12 if peak is not None else None,
            run_dir=self.run_dir or f"runs/{self.name}",
            checkpoint_path=self.checkpoint.path,
            checkpoint_interval=self.checkpoint.interval,
            checkpoint_keep=self.checkpoint.keep,
            resume=self.checkpoint.resume,
            log_every=train.log_every,
            passkey=PasskeyEvalOptions(
                lengths=tuple(self.eval.passkey_lengths),
                depths=tuple(self.eval.passkey_depths),
                samples_per_cell=self.eval.passkey_samples,
            ),
        )


class JobSpecError(ValueError):
    """A job spec that does not validate; the message names each bad field."""


def _section_fields(loc: tuple) -> list[str]:
    """The field names of the section at ``loc`` (a path of field names from JobSpec)."""
    model: type[BaseModel] = JobSpec
    for part in loc:
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field.path: message`` (an unknown field lists the valid ones)."""
    lines = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            valid = _section_fields(tuple(error["loc"][:-1]))
            message = f"unknown field; valid: {', '.join(valid)}"
        lines.append(f"{location}: {message}" if location else message)
    return "\n".join(lines)


def _set_dotted(data: dict, dotted: str, value: object) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise JobSpecError(f"{dotted}: {part!r} is not a section")
        node = child
    node[leaf] = value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` overrides (values parsed as YAML: ``4``, ``true``, ``null``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise JobSpecError(f"--set {item!r}: expected section.key=value")
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    return data


def parse_job_spec(data: dict) -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise JobSpecError(format_validation_error(exc)) from None


def load_job_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read, override and validate a YAML job spec.

    Raises:
        JobSpecError: naming the file, or each invalid field and what would be valid.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise JobSpecError(f"{path}: cannot read the job spec ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise JobSpecError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise JobSpecError(f"{path}: a job spec is a mapping of sections, got {kind}")
    return parse_job_spec(apply_overrides(data, overrides or []))
