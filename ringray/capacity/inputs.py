"""What ``ringray plan`` reads from a job: :class:`PlanInputs`, the training options with the
mesh (dp, cp, ulysses) and the precision resolved against a cluster."""

from __future__ import annotations

from dataclasses import dataclass

from ringray.accelerators import ClusterShape, PlanError
from ringray.model import ModelConfig
from ringray.train import TrainOptions


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What the plan reads from a job spec, with the mesh and precision resolved."""

    name: str
    model: ModelConfig
    seq_len: int
    global_batch: int
    dp: int
    cp: int
    layout: str
    bf16: bool  # bf16 compute (autocast, or FSDP's bf16 gathered weights); else fp32
    activation_checkpointing: str  # "none" | "full" | "selective"
    fsdp: bool = False  # weights, gradients and AdamW state sharded over dp x cp
    ulysses: int = 1  # ranks per Ulysses group; the ring has cp / ulysses ranks
    # The document lengths of one packed sequence, to plan the ring's steps by (``ringray
    # plan --documents SPEC``), and the spec they came from; None: one document.
    documents: tuple[int, ...] | None = None
    documents_spec: str | None = None
    packs_documents: bool = False  # the job's data.documents
    # AdamW's foreach update (torch's default on CUDA: a temporary the size of the local
    # parameters); False on CPU, where it runs a tensor at a time (ringray.train.footprint)
    foreach: bool = True

    @property
    def ring_size(self) -> int:
        """Ranks of one ring: cp / ulysses."""
        return self.cp // self.ulysses

    def shards(self, cp: int | None = None) -> int:
        """How many ways the weights are split: dp × cp with FSDP (at ring size ``cp``,
        default the job's), else 1. FSDP over one device shards nothing."""
        return self.dp * (cp or self.cp) if self.fsdp else 1

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp

    @property
    def block_tokens(self) -> int:
        """Tokens of one sequence on one rank (without Ulysses, the K/V block a ring step
        sends; with it, the ring's block is its member's chunk, ``seq_len / ring_size``)."""
        return self.seq_len // self.cp

    @property
    def activation_dtype_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @classmethod
    def from_options(cls, options: TrainOptions, cluster: ClusterShape, *,
                     name: str) -> PlanInputs:
        """Resolve dp/cp (one may be null: inferred from the cluster's size) and precision
        (``auto`` is bf16: the plan is for accelerators)."""
        dp, cp, total = options.parallel.dp, options.parallel.cp, cluster.total_devices
        if dp is None or cp is None:
            missing, known = ("cp", "dp") if cp is None else ("dp", "cp")
            known_value = dp if cp is None else cp
            if total is None or known_value is None or total % known_value:
                why = ("a custom device has no cluster size" if total is None else
                       f"parallel.{known} is null too" if known_value is None else
                       f"{total} devices do not split by parallel.{known}={known_value}")
                raise PlanError(f"parallel.{missing}: null, and it cannot be inferred ({why}); "
                                f"give a number, e.g. --set parallel.{missing}=8")
            dp, cp = (dp, total // dp) if cp is None else (total // cp, cp)
        return cls.of_mesh(options, dp=dp, cp=cp, name=name,
                           bf16=options.train.precision != "fp32")

    @classmethod
    def of_mesh(cls, options: TrainOptions, *, dp: int, cp: int, name: str,
                bf16: bool, foreach: bool = True) -> PlanInputs:
        """The inputs at a known mesh and precision (``ringray train`` knows both);
        ``foreach``: the workers run on accelerators (AdamW's foreach update)."""
        ulysses = options.parallel.ulysses
        if cp % ulysses:
            raise PlanError(f"parallel.ulysses: {ulysses} does not divide the inferred cp = "
                            f"{cp}; give parallel.cp, or a divisor of {cp}")
        train = options.train
        return cls(
            name=name, model=options.model, seq_len=train.seq_len,
            global_batch=train.global_batch, dp=dp, cp=cp, layout=options.layout_kind,
            bf16=bf16, activation_checkpointing=train.activation_checkpointing,
            fsdp=options.parallel.fsdp, ulysses=ulysses, packs_documents=options.data.documents,
            foreach=foreach,
        )
