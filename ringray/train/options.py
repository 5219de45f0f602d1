"""What a :class:`~ringray.train.Trainer` needs to know, as plain frozen dataclasses.

The service edge (``ringray.config.JobSpec``, pydantic, YAML) validates a job and builds these;
inside the trainer they are trusted. They are usable directly from Python, too:

    options = TrainOptions(model=model_preset("debug"), seq_len=1024, global_batch=4, steps=50)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringray.model import ModelConfig


@dataclass(frozen=True, kw_only=True)
class OptimizerOptions:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping


@dataclass(frozen=True, kw_only=True)
class PasskeyEvalOptions:
    """Passkey retrieval at the end of training (no lengths: no evaluation)."""

    lengths: tuple[int, ...] = ()
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    samples_per_cell: int = 4
    seed: int = 1234


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    model: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step, over all data-parallel replicas
    steps: int
    dp: int | None = 1  # None: inferred from the world size and cp
    cp: int | None = None  # None: inferred from the world size and dp
    layout: str = "zigzag"
    attention_backend: str = "auto"
    data_source: str = "stdlib"
    data_path: str | None = None
    data_seed: int = 0
    seed: int = 0  # weight initialisation and the job's RNG
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    precision: str = "auto"  # "auto" (bf16 autocast on CUDA, fp32 on CPU), "fp32", "bf16"
    activation_checkpointing: bool = False
    peak_flops_per_device: float | None = None  # None: a known GPU's peak, or measured on CPU
    run_dir: str = "runs/ringray"
    checkpoint_path: str | None = None  # None: <run_dir>/checkpoints
    checkpoint_interval: int = 0  # steps between checkpoints; 0: only at the end
    checkpoint_keep: int = 3
    log_every: int = 10  # print a progress line every this many steps (rank 0)
    resume: bool = True  # continue from the newest complete checkpoint when there is one
    passkey: PasskeyEvalOptions = field(default_factory=PasskeyEvalOptions)

    @property
    def checkpoint_location(self) -> str:
        return self.checkpoint_path or f"{self.run_dir.rstrip('/')}/checkpoints"
