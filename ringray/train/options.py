"""What a :class:`~ringray.train.Trainer` needs to know, as plain frozen dataclasses.

Each class is one section of the job spec and the one declaration of its options: type,
bounds (``Annotated`` markers), default, and the docstring under each field, which the job
file reference prints. ``ringray.spec`` derives its YAML sections from these classes; inside
the trainer they are trusted. :class:`TrainOptions` holds one of each, under the section's
name, so ``options.train.seq_len`` in code is ``train.seq_len`` in a job file::

    options = TrainOptions(
        model=model_preset("debug"),
        parallel=ParallelOptions(cp=4),
        train=TrainingOptions(seq_len=4096, global_batch=2, steps=50),
    )

A check of one field's meaning sits in its class's ``__post_init__``; checks across sections
(a sequence length the layout cannot split over the ring) sit in :class:`TrainOptions`. Both
raise ``ValueError`` naming the field, so Python callers get the same messages as job files.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Annotated, Literal

import fsspec
from annotated_types import Ge, Gt, Le, Lt, MinLen

from ringray.attention.backends import BACKENDS
from ringray.attention.layouts import BUILTIN_LAYOUTS, DOCUMENT_LAYOUTS, seq_len_divisor
from ringray.attention.ulysses import check_ulysses_heads
from ringray.data import (
    PASSKEY_DIGITS,
    ByteTokenizer,
    DataOptions,
    Tokenizer,
    passkey_min_seq_len,
)
from ringray.data.passkey import check_passkey_tokenizer
from ringray.model import ModelConfig
from ringray.model.llama import ActivationCheckpointing

MAX_SEQ_LEN = 1 << 24
"""16M tokens: sixteen times the longest context in jobs/ (1M). Longer is almost surely a typo
(an extra zero), and RoPE positions in float32 lose integer precision past 2**24."""

LayoutName = Literal[(*BUILTIN_LAYOUTS, *DOCUMENT_LAYOUTS, "auto")]
BackendName = Literal[("auto", *BACKENDS)]
SeqLen = Annotated[int, Ge(2), Le(MAX_SEQ_LEN)]


@dataclass(frozen=True, kw_only=True)
class OptimizerOptions:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``."""

    lr: Annotated[float, Gt(0)] = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: Annotated[float, Ge(0), Le(1)] = 0.1
    """Cosine decay floor, as a fraction of lr."""
    warmup_steps: Annotated[int, Ge(0)] = 10
    """Linear warmup steps. More than train.steps is allowed (a short smoke run such as
    --steps 4 then ends inside the warmup, below the peak lr)."""
    weight_decay: Annotated[float, Ge(0)] = 0.1
    """AdamW decay on weight matrices."""
    beta1: Annotated[float, Ge(0), Lt(1)] = 0.9
    """AdamW beta1."""
    beta2: Annotated[float, Ge(0), Lt(1)] = 0.95
    """AdamW beta2."""
    eps: Annotated[float, Gt(0)] = 1e-8
    """AdamW epsilon."""
    grad_clip: Annotated[float, Ge(0)] = 1.0
    """Max global gradient L2 norm; 0: no clipping."""


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """How the ranks split the work (the job spec's ``parallel`` section)."""

    dp: Annotated[int, Ge(1)] | None = 1
    """Data-parallel replicas; null: world size / cp (torchrun only)."""
    dp_replicate: Annotated[int, Ge(1)] = 1
    """Replica groups, each a whole dp × cp mesh, so that a replica's death stops no other
    (torchft). Each takes its own slice of train.global_batch by replica index; gradients
    are averaged over the replicas in each step's quorum (the token mean over their counted
    labels), and a replica that misses steps drops its slices of them, so the loader's
    position stays the step's. A replica that joins late heals from a live peer (weights,
    optimizer state, loader position, RNG, step). 1: none (a fault restarts the job from
    its checkpoint). More needs torchft; `ringray train` starts the groups and the torchft
    Lighthouse and replaces a lost group alone while the others train
    (ringray.cluster.replica_groups); under torchrun, run one `python -m ringray.train
    --replica-group I` per group against a Lighthouse started on its own (each group its own
    run directory, RUN/replica-I). train.global_batch must split over dp_replicate × dp."""
    cp: Annotated[int, Ge(1)] | None = None
    """Context-parallel ranks per sequence, ring × ulysses; null: world size / dp (torchrun
    only)."""
    ulysses: Annotated[int, Ge(1)] = 1
    """Ranks per Ulysses group: the cp ranks form cp / ulysses ring members of ulysses
    consecutive ranks (kept on one node) that swap sequence shards for heads with an
    all-to-all around the ring; 1: ring only. Divides cp; model.n_heads must split over it,
    and model.n_kv_heads split over it or divide it (K/V heads are then repeated)."""
    layout: LayoutName = "auto"
    """How sequences are split over a ring. auto: balanced with data.documents, else zigzag;
    balanced (data.documents only): each sequence laid out by its own documents, with equal
    tokens and near-equal attention work per rank, heavy documents spread over every rank;
    whole (data.documents only): the same work equality with every document kept on as few
    ranks as the shares allow, so that fewer keys travel. train.seq_len and
    eval.passkey_lengths must split evenly (zigzag: multiples of 2 × cp; contiguous,
    striped, balanced, whole: of cp); passkey evaluation (one document per sequence) runs
    zigzag where training runs balanced or whole."""
    attention_backend: BackendName = "auto"
    """Local attention kernel (auto: on CUDA in half precision, each piece to the fastest
    kernel measured on the device, cuDNN, flash, flash-attn or Triton, masked pieces to
    Triton (routed); else triton on CUDA when installed; sdpa on CPU)."""
    fsdp: bool = False
    """Shard weights, gradients and AdamW state over all dp × cp ranks (FSDP2 over the
    flattened mesh: each block's weights are all-gathered for its forward and backward, and
    gradients are summed by one reduce-scatter); false: replicated on every rank. With bf16
    precision the gathered weights are bf16 and gradients are reduced in fp32."""

    def __post_init__(self) -> None:
        if self.dp_replicate > 1 and importlib.util.find_spec("torchft") is None:
            raise ValueError(
                f"dp_replicate: {self.dp_replicate} replica groups need torchft, which is not "
                f"installed; pip install torchft, or use 1")
        if self.cp is not None and self.cp % self.ulysses:
            raise ValueError(
                f"ulysses: {self.ulysses} does not divide cp={self.cp} (cp = ring × ulysses: "
                f"cp / ulysses ring members of ulysses ranks each); use a divisor of {self.cp}"
            )

    @property
    def ring(self) -> int | None:
        """Ranks of each ring, cp / ulysses (``None`` while cp is inferred)."""
        return None if self.cp is None else self.cp // self.ulysses


@dataclass(frozen=True, kw_only=True)
class TrainingOptions:
    """Steps, batch and optimizer (the job spec's ``train`` section)."""

    steps: Annotated[int, Ge(1)] = 100
    """Optimizer steps (the schedule's length)."""
    global_batch: Annotated[int, Ge(1)] = 4
    """Sequences per step over all data-parallel replicas; a multiple of parallel.dp (times
    parallel.dp_replicate)."""
    seq_len: SeqLen = 1024
    """Tokens per sequence (split over the ring by the layout)."""
    seed: int = 0
    """Weight initialisation seed."""
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    """AdamW and LR."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 autocast on CUDA, fp32 on CPU."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """What the backward recomputes to save memory: 'none'; 'full' (each block, ring pass
    included; keeps only block inputs); 'selective' (each block but its ring pass: keeps
    block inputs and ring attention's q, output, LSE and K/V blocks (its own and the last
    one received), so no K/V block is sent twice)."""
    nonfinite_skips: Annotated[int, Ge(0)] = 3
    """A step whose loss or gradient norm is not finite (NaN or inf) is not taken: its batch
    is skipped, the weights, optimizer and schedule stay as they were, and the skip is
    counted (steps.jsonl, the live line). After this many such steps in a row the run stops
    with an error naming the step; 0 stops at the first. No checkpoint of non-finite weights
    is ever committed."""
    log_every: Annotated[int, Ge(1)] = 10
    """Print a progress line every N steps; the first and the last step are always printed,
    so N > steps prints only those."""
    peak_tflops_per_device: Annotated[float, Gt(0)] | None = None
    """Peak TFLOP/s per device for MFU; null: a known GPU's bf16 peak, or a float32 matmul
    measured at start on CPU."""
    memory_check: bool = True
    """Refuse, in one line with the figures, a job whose worker's planned peak memory (what
    `ringray plan` counts) exceeds its share of its node: the node's available memory (or
    RINGRAY_NODE_MEMORY_BYTES in its environment) shared by the job's workers there, or a
    GPU's memory. `ringray train` checks before an embedded Ray starts, and every worker
    on its node before its session is built (jobs on a cluster and submissions too); a
    refused job fails without retries. false (what --force sets) starts it anyway."""

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, bool):  # the spelling before 'selective'
            raise ValueError(
                f"activation_checkpointing: {str(self.activation_checkpointing).lower()} is no "
                f"longer a value; write 'full' for true (recompute each block), 'none' for "
                f"false, or 'selective' (recompute all but the ring pass)")


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Where and how often to checkpoint (the job spec's ``checkpoint`` section)."""

    path: Annotated[str, MinLen(1)] | None = None
    """Directory or fsspec URL (e.g. s3://bucket/job) for checkpoints; every node must reach
    it. null: <run_dir>/checkpoints."""
    interval: Annotated[int, Ge(0)] = 0
    """Steps between checkpoints; 0, or more than train.steps: only the final checkpoint."""
    keep: Annotated[int, Ge(1)] = 3
    """Committed checkpoints of this run kept (its older ones are deleted; other runs' never)."""
    resume: bool = True
    """Resume from the newest complete checkpoint of the newest run at checkpoint.path; false
    starts a new run, and is refused if checkpoints of an earlier run are there (see
    move_aside)."""
    move_aside: bool = False
    """With resume false: move an earlier run's checkpoints (and the run directory's
    steps.jsonl and events.jsonl) aside to <name>.previous-<unix time> instead of refusing."""

    def __post_init__(self) -> None:
        if self.move_aside and self.resume:
            raise ValueError("move_aside: only used with resume: false (a resumed run keeps "
                             "its checkpoints); set resume: false, or drop move_aside")
        if self.path is not None and "://" in self.path:
            scheme = self.path.split("://", 1)[0]
            # fsspec's known protocols, and any a program registered itself (its registry)
            if scheme not in fsspec.available_protocols() and scheme not in fsspec.registry:
                raise ValueError(
                    f"path: {self.path!r} has a URL scheme {scheme!r} that fsspec does not "
                    f"know; use a local path or one of fsspec's, e.g. s3://, gs://, abfs://, "
                    f"file://"
                )


Depth = Annotated[float, Ge(0), Le(1)]


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """What the job evaluates after training (the job spec's ``eval`` section): passkey
    retrieval at ``passkey_lengths``, and lm-evaluation-harness tasks (RULER's offline ones,
    ``ringray eval``'s) at ``task_lengths``; neither given: no evaluation."""

    passkey_lengths: tuple[SeqLen, ...] = ()
    """Context lengths for passkey retrieval after training (none: no evaluation); distinct,
    each split evenly by the layout and long enough for the needle and question."""
    passkey_depths: tuple[Depth, ...] = (0.1, 0.5, 0.9)
    """Needle depths, 0 (start) to 1 (end); distinct."""
    passkey_samples: Annotated[int, Ge(1)] = 4
    """Samples per (length, depth) cell."""
    passkey_seed: int = 1234
    """Seed of the evaluation's samples (the same seed scores the same prompts)."""
    tasks: tuple[str, ...] = ()
    """lm-evaluation-harness tasks run after training over the job's workers as one ring
    (the Ray service; under torchrun, run ``ringray eval RUN`` afterwards): RULER's offline
    tasks (niah_single_1, niah_multikey_2, niah_multikey_3, ringray_niah_multivalue,
    ringray_niah_multiquery, ruler_vt, ruler_cwe, ruler_fwe) and ringray_passkey. Results:
    ``eval/results.json`` in the run directory, Prometheus and ``ringray report``."""
    task_lengths: tuple[Annotated[int, Ge(1024), Le(MAX_SEQ_LEN)], ...] = ()
    """Context lengths in tokens for ``tasks`` (each at least 1024, RULER's shortest), up to
    the model's position limit (its RoPE scaling's reach)."""
    task_samples: Annotated[int, Ge(1)] = 20
    """Samples per (task, length) cell (lm_eval's ``limit``; RULER makes 500)."""
    task_max_gen_toks: Annotated[int, Ge(1)] | None = None
    """Cap on the tokens a sample generates (RULER's tasks allow 30-128; each token re-runs
    the prompt); None: each task's own."""
    tasks_at_checkpoints: bool = False
    """Also evaluate ``tasks`` after each interval checkpoint (training waits for it; the
    results go to ``eval/step_<N>/`` and Prometheus), not only after training."""

    def __post_init__(self) -> None:
        for name in ("passkey_lengths", "passkey_depths", "tasks", "task_lengths"):
            values = getattr(self, name)
            repeats = sorted({v for v in values if values.count(v) > 1})
            if repeats:
                raise ValueError(f"{name}: {list(values)} repeats {repeats}; give each value "
                                 f"once")
        if self.passkey_lengths and not self.passkey_depths:
            raise ValueError("passkey_depths: [] gives no cells to evaluate; e.g. "
                             "[0.1, 0.5, 0.9]")
        if self.tasks and not self.task_lengths:
            raise ValueError(f"task_lengths: [] gives tasks {list(self.tasks)} no length to "
                             f"run at; e.g. [4096]")
        if self.tasks_at_checkpoints and not self.tasks:
            raise ValueError("tasks_at_checkpoints: true with tasks: [] evaluates nothing; "
                             "name tasks, e.g. [niah_single_1]")
        if self.task_lengths and not self.tasks:
            raise ValueError("tasks: [] gives task_lengths nothing to run; name tasks, e.g. "
                             "[niah_single_1, ruler_vt]")

    @property
    def due(self) -> bool:
        """Whether the job evaluates after its final checkpoint."""
        return bool(self.passkey_lengths or self.tasks)


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """Everything one training run needs: one options object per job-spec section."""

    model: ModelConfig
    data: DataOptions = field(default_factory=DataOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    train: TrainingOptions = field(default_factory=TrainingOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)
    run_dir: str = "runs/ringray"
    pretrained: str | None = None  # model.from_pretrained: its weights and its tokenizer

    def __post_init__(self) -> None:
        train, parallel = self.train, self.parallel
        replicas = parallel.dp_replicate
        slices = replicas * (parallel.dp or 1)  # an inferred dp is checked by the Trainer
        if train.global_batch % slices:
            over = (f"parallel.dp={parallel.dp} replicas" if replicas == 1 else
                    f"parallel.dp_replicate={replicas} replica groups" if parallel.dp is None
                    else f"parallel.dp_replicate={replicas} × dp={parallel.dp} = {slices} slices")
            raise ValueError(f"train.global_batch: {train.global_batch} does not split over "
                             f"{over}; use a multiple of {slices}")
        if parallel.layout in DOCUMENT_LAYOUTS and not self.data.documents:
            raise ValueError(
                f"parallel.layout: {parallel.layout!r} lays each sequence out by its documents "
                f"and needs data.documents: true; use 'auto' (zigzag without documents) or "
                f"another layout"
            )
        if parallel.cp is not None:
            lengths = [("train.seq_len", train.seq_len, self.layout_kind)] + [
                ("eval.passkey_lengths", n, self.eval_layout_kind)
                for n in self.eval.passkey_lengths
            ]
            for name, length, kind in lengths:
                divisor = seq_len_divisor(kind, parallel.cp, parallel.ulysses)
                if length % divisor:
                    raise ValueError(
                        f"{name}: {length} cannot be split by layout {kind!r} over "
                        f"cp={parallel.cp} ranks{_grid_note(parallel)}; use a multiple of "
                        f"{divisor}"
                    )
        check_ulysses_model(self.model, parallel)
        if self.pretrained is None:  # a pretrained model's tokenizer is checked by the Trainer
            check_token_budget(self, ByteTokenizer())

    @property
    def layout_kind(self) -> str:
        """The layout training runs: ``parallel.layout`` with ``auto`` resolved (``balanced``
        with ``data.documents``, else ``zigzag``). ``balanced`` is built per sequence, for
        its documents."""
        if self.parallel.layout == "auto":
            return "balanced" if self.data.documents else "zigzag"
        return self.parallel.layout

    @property
    def eval_layout_kind(self) -> str:
        """The layout of whole-sequence evaluation (passkey retrieval, next-token
        prediction), whose sequences are one document each: the training layout, or zigzag
        in place of ``balanced`` and ``whole`` (these sequences have no document lengths to
        balance)."""
        kind = self.layout_kind
        return "zigzag" if kind in DOCUMENT_LAYOUTS else kind

    @property
    def checkpoint_location(self) -> str:
        """Where this run's checkpoints go: ``checkpoint.path``, else under the run dir."""
        return self.checkpoint.path or f"{self.run_dir.rstrip('/')}/checkpoints"

    @property
    def peak_flops_per_device(self) -> float | None:
        """``train.peak_tflops_per_device`` in FLOP/s (``None``: measure or look it up)."""
        peak = self.train.peak_tflops_per_device
        return peak * 1e12 if peak is not None else None


def _grid_note(parallel: ParallelOptions) -> str:
    """`` (ring 2 × ulysses 2)`` when the cp ranks form a ring × Ulysses grid, else ``""``."""
    if parallel.ulysses == 1 or parallel.ring is None:
        return ""
    return f" (ring {parallel.ring} × ulysses {parallel.ulysses})"


def check_ulysses_model(model: ModelConfig, parallel: ParallelOptions) -> None:
    """Raise ``ValueError`` naming ``parallel.ulysses`` and the model's head counts unless
    the heads can be shared over a Ulysses group (:func:`check_ulysses_heads`): query heads
    split over it, and kv heads split over it or divide it (then repeated)."""
    ulysses = parallel.ulysses
    if ulysses == 1:
        return
    try:
        check_ulysses_heads(model.n_heads, model.n_kv_heads, ulysses)
    except ValueError:
        if model.n_heads % ulysses:
            raise ValueError(
                f"parallel.ulysses: {ulysses} does not divide model.n_heads={model.n_heads} "
                f"(each rank of a Ulysses group attends with n_heads / ulysses query heads); "
                f"use a divisor of {model.n_heads}"
            ) from None
        raise ValueError(
            f"parallel.ulysses: {ulysses} neither divides nor is a multiple of "
            f"model.n_kv_heads={model.n_kv_heads} (kv heads are split over the group, or "
            f"repeated onto it); use a divisor or a multiple of {model.n_kv_heads}"
        ) from None


def check_token_budget(options: TrainOptions, tokenizer: Tokenizer) -> None:
    """Raise ``ValueError`` naming the field unless ``tokenizer`` writes pass keys the way the
    passkey task reads them (:func:`~ringray.data.passkey.check_passkey_tokenizer`), where the
    job evaluates or trains on pass keys, and every passkey length (and, with passkey training
    data, the sequence length) holds a passkey prompt in its tokens."""
    users = ([(f"eval.passkey_lengths: {list(options.eval.passkey_lengths)} score",
               "eval.passkey_lengths: []")] if options.eval.passkey_lengths else [])
    if options.data.source in ("passkey", "passkey_retrieval"):
        users.append((f"data.source: {options.data.source!r} trains on", "another data.source"))
    if users:
        try:
            check_passkey_tokenizer(tokenizer, PASSKEY_DIGITS)
        except ValueError as exc:
            field, instead = users[0]
            raise ValueError(
                f"{field} {PASSKEY_DIGITS}-digit pass keys, which needs a tokenizer that "
                f"writes a key as tokens of its digits alone (one or several digits a token, "
                f"at most one token per digit, decoding back to the key), but {exc}; use a "
                f"model.from_pretrained whose tokenizer does, or {instead}"
            ) from None
    minimum = passkey_min_seq_len(tokenizer, PASSKEY_DIGITS)
    short = [n for n in options.eval.passkey_lengths if n < minimum]
    if short:
        raise ValueError(f"eval.passkey_lengths: {short} cannot hold the needle and the "
                         f"question; use lengths of at least {minimum}")
    if options.data.source == "passkey" and options.train.seq_len < minimum + 1:
        raise ValueError(
            f"train.seq_len: {options.train.seq_len} is too short for passkey training "
            f"samples; use at least {minimum + 1} with data.source 'passkey'"
        )
