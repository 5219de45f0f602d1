"""The job spec: the one validated description of a ringray job (YAML files in ``jobs/``).

    spec = load_job_spec("jobs/quickstart.yaml", overrides=["train.steps=20"])
    options = spec.train_options()          # what the trainer runs
    cluster = spec.cluster_options()        # what the Ray controller needs (ringray train)

Every field carries a description (the README's job file reference is generated from them by
:mod:`ringray.config_reference`); unknown fields are errors, and so are values of the wrong
type (no silent coercion: ``steps: "10"`` or ``steps: true`` is not an integer). Checks that
involve several fields (the sequence length against the layout and the ring size, heads
against kv heads, the batch against dp, the workers' resources against the accelerator) name
the field to change, the value and what would be valid. Checks that look at this machine
(``data.path`` exists, output directories can be created) run in :func:`load_job_spec`, not
in the schema, so a spec meant for another machine still parses.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import fsspec
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ringray.attention.backends import BACKENDS
from ringray.attention.layouts import BUILTIN_LAYOUTS, seq_len_divisor
from ringray.cluster.options import ClusterOptions
from ringray.config_errors import describe_yaml_error, format_validation_error, load_yaml
from ringray.data import ByteTokenizer, passkey_min_seq_len
from ringray.model import MODEL_PRESETS, ModelConfig, model_preset
from ringray.train.options import OptimizerOptions, PasskeyEvalOptions, TrainOptions

# 16M tokens: sixteen times the longest context in jobs/ (1M). Longer is almost surely a typo
# (an extra zero), and RoPE positions in float32 lose integer precision past 2**24.
MAX_SEQ_LEN = 1 << 24
# The passkey evaluation's key length (evaluate_passkey's default), which sets the shortest
# context that holds the needle, the question and some filler.
PASSKEY_DIGITS = 5
# A name is used in Ray actor names (ringray-job-<name>) and as a directory (runs/<name>).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
# Ray's built-in resources that a worker may ask for by name; others are custom resources.
_RAY_RESERVED = ("memory", "object_store_memory")


def _one_of(value: str, valid: list[str], what: str) -> str:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}")
    return value


def _is_url(location: str) -> bool:
    return "://" in location


def _check_url(location: str) -> str:
    """An fsspec URL whose scheme fsspec knows (``s3://``, ``gs://``, ``file://`` ...)."""
    scheme = location.split("://", 1)[0]
    known = fsspec.available_protocols()
    if scheme not in known:
        raise ValueError(
            f"{location!r} has a URL scheme {scheme!r} that fsspec does not know; use a local "
            f"path or one of fsspec's, e.g. s3://, gs://, abfs://, file://"
        )
    return location


class _Section(BaseModel):
    # strict: YAML already gives typed values, so a quoted number or a yes/no where a number
    # belongs is a mistake to report, not to coerce.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ModelSpec(_Section):
    preset: str = Field("debug", description=f"Model shape preset: {', '.join(MODEL_PRESETS)}.")
    dim: int | None = Field(None, ge=1, description="Hidden size (default: the preset's); "
                            "a multiple of n_heads with an even head size.")
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
    path: str | None = Field(
        None, min_length=1,
        description="Local directory of .txt/.jsonl files, read recursively (source 'files' "
        "only); must exist where the job is loaded.",
    )
    seed: int = Field(0, description="Document order seed (the loader is deterministic).")

    @field_validator("path")
    @classmethod
    def _local_path(cls, value: str | None) -> str | None:
        if value is not None and _is_url(value):
            raise ValueError(f"{value!r} is a URL; the data loader reads a local directory")
        return value


class ParallelSpec(_Section):
    dp: int | None = Field(
        1, ge=1, description="Data-parallel replicas; null: world size / cp (torchrun only)."
    )
    cp: int | None = Field(
        None, ge=1,
        description="Context-parallel ring size; null: world size / dp (torchrun only).",
    )
    layout: str = Field(
        "zigzag",
        description=f"How sequences are split over a ring: {', '.join(BUILTIN_LAYOUTS)}; "
        "train.seq_len and eval.passkey_lengths must split evenly (zigzag: multiples of 2 × cp).",
    )
    attention_backend: str = Field(
        "auto",
        description=f"Local attention kernel: auto, or one of {', '.join(BACKENDS)}.",
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
    warmup_steps: int = Field(
        10, ge=0,
        description="Linear warmup steps. More than train.steps is allowed (a short smoke run "
        "such as --steps 4 then ends inside the warmup, below the peak lr).",
    )
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay on weight matrices.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient L2 norm; 0: no clipping.")


class TrainSpec(_Section):
    steps: int = Field(100, ge=1, description="Optimizer steps (the schedule's length).")
    global_batch: int = Field(
        4, ge=1,
        description="Sequences per step over all data-parallel replicas; a multiple of "
        "parallel.dp.",
    )
    seq_len: int = Field(
        1024, ge=2, le=MAX_SEQ_LEN,
        description="Tokens per sequence (split over the ring by the layout).",
    )
    seed: int = Field(0, description="Weight initialisation seed.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="AdamW and LR.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on CPU."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each block in the backward pass to save memory."
    )
    log_every: int = Field(
        10, ge=1,
        description="Print a progress line every N steps; the first and the last step are "
        "always printed, so N > steps prints only those.",
    )
    peak_tflops_per_device: float | None = Field(
        None, gt=0,
        description="Peak TFLOP/s per device for MFU; null: a known GPU's bf16 peak, or a "
        "float32 matmul measured at start on CPU.",
    )


class CheckpointSpec(_Section):
    path: str | None = Field(
        None, min_length=1,
        description="Directory or fsspec URL (e.g. s3://bucket/job) for checkpoints; every node "
        "must reach it. null: <run_dir>/checkpoints.",
    )
    interval: int = Field(
        0, ge=0,
        description="Steps between checkpoints; 0, or more than train.steps: only the final "
        "checkpoint.",
    )
    keep: int = Field(3, ge=1, description="Complete checkpoints kept (older ones are deleted).")
    resume: bool = Field(True, description="Resume from the newest complete checkpoint.")

    @field_validator("path")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        return _check_url(value) if value is not None and _is_url(value) else value


Depth = Annotated[float, Field(ge=0, le=1)]
PasskeyLength = Annotated[int, Field(ge=2, le=MAX_SEQ_LEN)]


class EvalSpec(_Section):
    passkey_lengths: list[PasskeyLength] = Field(
        default_factory=list,
        description="Context lengths for passkey retrieval after training (none: no "
        "evaluation); distinct, each split evenly by the layout and long enough for the "
        f"needle and question ({passkey_min_seq_len(ByteTokenizer(), PASSKEY_DIGITS)} tokens).",
    )
    passkey_depths: list[Depth] = Field(
        default_factory=lambda: [0.1, 0.5, 0.9],
        description="Needle depths, 0 (start) to 1 (end); distinct.",
    )
    passkey_samples: int = Field(4, ge=1, description="Samples per (length, depth) cell.")

    @model_validator(mode="after")
    def _grid(self) -> EvalSpec:
        for field, values in (("passkey_lengths", self.passkey_lengths),
                              ("passkey_depths", self.passkey_depths)):
            repeats = sorted({v for v in values if values.count(v) > 1})
            if repeats:
                raise ValueError(f"{field}: {values} repeats {repeats}; give each value once")
        minimum = passkey_min_seq_len(ByteTokenizer(), PASSKEY_DIGITS)
        short = [n for n in self.passkey_lengths if n < minimum]
        if short:
            raise ValueError(
                f"passkey_lengths: {short} cannot hold the needle and the question; use "
                f"lengths of at least {minimum}"
            )
        if self.passkey_lengths and not self.passkey_depths:
            raise ValueError("passkey_depths: [] gives no cells to evaluate; e.g. [0.1, 0.5, 0.9]")
        return self


class ClusterSpec(_Section):
    accelerator: Literal["cpu", "gpu"] = Field(
        "cpu", description="What each worker owns: one GPU (NCCL rings) or one CPU slot (gloo)."
    )
    worker_resources: dict[str, float] | None = Field(
        None,
        description="Ray resources of one worker, e.g. {GPU: 1, CPU: 8}; null: {GPU: 1} for "
        "accelerator gpu, {CPU: 1} for cpu. With gpu, GPU must be 1 (one NCCL rank per "
        "device); with cpu, no GPU. A custom resource pins workers to the nodes that offer it.",
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
        "zone", min_length=1,
        description="Node label whose values DP replicas are spread over; null: none.",
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
        if value is None:
            return value
        if not value:
            raise ValueError("{} asks for nothing; give at least one resource, e.g. {CPU: 1}")
        for name, amount in value.items():
            if name.upper() in ("CPU", "GPU") and name not in ("CPU", "GPU"):
                raise ValueError(
                    f"{name}: Ray's resource names are case-sensitive; write {name.upper()}"
                )
            if name in _RAY_RESERVED:
                raise ValueError(f"{name}: not a worker resource ringray can ask Ray for; "
                                 f"use CPU, GPU or a custom resource")
            if amount <= 0:
                raise ValueError(f"{name}: {amount:g} is not positive; give an "
                                 f"amount > 0, or leave {name} out")
        return value

    @model_validator(mode="after")
    def _resources_fit_the_accelerator(self) -> ClusterSpec:
        if self.worker_resources is None:
            return self
        gpus = self.worker_resources.get("GPU")
        if self.accelerator == "gpu" and gpus != 1:
            got = "no GPU" if gpus is None else f"GPU: {gpus:g}"
            raise ValueError(
                f"worker_resources: {got} with accelerator gpu; each worker drives exactly one "
                f"GPU (one NCCL rank per device), so give GPU: 1"
            )
        if self.accelerator == "cpu" and gpus is not None:
            raise ValueError(
                f"worker_resources: GPU: {gpus:g} with accelerator cpu (gloo rings that never "
                f"use it); set cluster.accelerator: gpu, or leave GPU out"
            )
        return self


class MetricsSpec(_Section):
    address: str = Field(
        "127.0.0.1",
        description="IP address or host name the controller serves Prometheus metrics on: "
        "loopback by default; 0.0.0.0 lets a cluster's Prometheus scrape the head node.",
    )
    port: int | None = Field(
        9477, ge=0, le=65535,
        description="Port of the /metrics endpoint (0: any free port, shown at start; null: "
        "no endpoint).",
    )

    @field_validator("address")
    @classmethod
    def _host(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            pass
        labels = value.rstrip(".").split(".")
        if len(value) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
            raise ValueError(f"{value!r} is not an IP address or a host name; e.g. 127.0.0.1, "
                             f"0.0.0.0 or head.example.com")
        return value


class JobSpec(_Section):
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
        if value is not None and _is_url(value):
            raise ValueError(f"{value!r} is a URL; the run directory is local (put checkpoints "
                             f"on remote storage with checkpoint.path)")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        try:
            self.model.build()
        except ValueError as exc:
            raise ValueError(f"model.{exc}") from None
        self._check_data()
        self._check_mesh()
        return self

    def _check_data(self) -> None:
        if self.data.source == "files" and not self.data.path:
            raise ValueError("data.path: required when data.source is 'files'; give a "
                             "directory of .txt/.jsonl files")
        if self.data.source != "files" and self.data.path:
            raise ValueError(
                f"data.path: only read when data.source is 'files' (it is "
                f"{self.data.source!r}); remove it or set data.source: files"
            )
        minimum = passkey_min_seq_len(ByteTokenizer(), PASSKEY_DIGITS) + 1
        if self.data.source == "passkey" and self.train.seq_len < minimum:
            raise ValueError(
                f"train.seq_len: {self.train.seq_len} is too short for passkey training "
                f"samples; use at least {minimum} with data.source 'passkey'"
            )

    def _check_mesh(self) -> None:
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

    def check_capacity(self, available: Mapping[str, float], *, where: str) -> None:
        """Raise :class:`JobSpecError` if the smallest job this spec allows (``dp_min × cp``
        workers) needs more of a resource than ``available`` holds in total.

        For a cluster that cannot grow (an embedded local Ray; a cluster without an
        autoscaler); ``where`` names it in the message, e.g. ``"this machine"``.
        """
        options = self.cluster_options()
        workers = options.dp_min * options.cp
        for resource, amount in options.worker_resources.items():
            need, have = workers * amount, available.get(resource, 0.0)
            if need > have:
                fits = int(have // amount) // options.dp_min if amount else 0
                raise JobSpecError(
                    f"parallel.cp: dp × cp = {options.dp_min} × {options.cp} = {workers} workers "
                    f"× {resource}: {amount:g} need {need:g} {resource}, but {where} has "
                    f"{have:g}; use parallel.cp ≤ {fits} (with dp {options.dp_min}) or a "
                    f"larger cluster"
                    if fits < options.cp else
                    f"cluster.dp_min: {options.dp_min} rings × cp {options.cp} need {need:g} "
                    f"{resource}, but {where} has {have:g}; use a smaller dp"
                )

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
        try:
            value = load_yaml(raw)
        except yaml.YAMLError as exc:
            raise JobSpecError(f"--set {item!r}: the value is not valid YAML "
                               f"({describe_yaml_error(exc)})") from None
        _set_dotted(data, key.strip(), value)
    return data


def parse_job_spec(data: dict) -> JobSpec:
    """Validate a spec given as plain data (no look at this machine's files)."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise JobSpecError(format_validation_error(exc, JobSpec)) from None


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_output_dir(field: str, location: str) -> None:
    """A local directory that exists, or whose nearest existing ancestor is a writable one."""
    path = Path(location).absolute()
    if path.exists():
        if not path.is_dir():
            raise JobSpecError(f"{field}: {location!r} is a file; give a directory")
        return
    ancestor = _nearest_existing(path.parent)
    if not ancestor.is_dir():
        raise JobSpecError(f"{field}: {location!r} cannot be created: {ancestor} is a file; "
                           f"give a path under a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise JobSpecError(f"{field}: {location!r} cannot be created: {ancestor} is not "
                           f"writable; give a path under a directory you can write to")


def check_local_paths(spec: JobSpec) -> None:
    """Raise :class:`JobSpecError` unless this machine has ``data.path`` (a directory) and can
    create the run and local checkpoint directories. Relative paths are from the current
    directory, as the trainer reads them."""
    if spec.data.source == "files" and spec.data.path:
        path = Path(spec.data.path)
        if not path.exists():
            raise JobSpecError(f"data.path: {spec.data.path!r} does not exist (from "
                               f"{Path.cwd()}); give a directory of .txt/.jsonl files")
        if not path.is_dir():
            raise JobSpecError(f"data.path: {spec.data.path!r} is a file; give the directory "
                               f"that holds the .txt/.jsonl files")
    options = spec.train_options()
    _check_output_dir("run_dir", options.run_dir)
    if not _is_url(options.checkpoint_location):
        field = "checkpoint.path" if spec.checkpoint.path else "run_dir"
        _check_output_dir(field, options.checkpoint_location)


def load_job_spec(
    path: str | Path, overrides: list[str] | None = None, *, check_paths: bool = True
) -> JobSpec:
    """Read, override and validate a YAML job spec.

    ``check_paths``: also check this machine's paths (:func:`check_local_paths`); leave it
    off for a spec that will run elsewhere (``ringray submit`` to a remote cluster).

    Raises:
        JobSpecError: naming the file, or each invalid field and what would be valid.
    """
    path = Path(path)
    try:
        data = load_yaml(path.read_text()) or {}
    except OSError as exc:
        raise JobSpecError(f"{path}: cannot read the job spec ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise JobSpecError(f"{path}: not valid YAML ({describe_yaml_error(exc)})") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise JobSpecError(f"{path}: a job spec is a mapping of sections, got {kind}")
    spec = parse_job_spec(apply_overrides(data, overrides or []))
    if check_paths:
        check_local_paths(spec)
    return spec
