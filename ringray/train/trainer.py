"""Exact context-parallel training: one :meth:`Trainer.step` is one optimizer step.

    trainer = Trainer(options)          # under torchrun, Ray, or in one plain process
    for _ in range(10):
        stats = trainer.step()          # a StepStats
    trainer.save_checkpoint(CheckpointStore(options.checkpoint_location))

Each rank of a ``dp × cp`` mesh takes its data-parallel slice of the global batch, cuts every
sequence with the layout, and keeps its share. Labels are next tokens on the *global*
sequence, sharded the same way, so the loss of a token does not depend on where it lives. The
loss is the token mean over the whole global batch: each rank backpropagates its own token
sum divided by the global count of labels that count (every token's, unless the source's
loss mask leaves some out), and summing the ranks' gradients gives exactly the gradient of a
single-device run on the same batch. Replicated weights sum them with one
all-reduce over the mesh; with ``parallel.fsdp`` FSDP2's reduce-scatter sums them into each
rank's shard (:mod:`ringray.train.sharding`).

Ulysses × ring (``parallel.ulysses`` U > 1): the cp ranks of a sequence are a grid of
cp / U ring members of U ranks (:mod:`ringray.train.mesh`), and the layout is
``make_layout(kind, cp, seq_len, ulysses=U)``, so a rank still holds its own share of each
sequence with every head and its loss covers exactly those tokens. Heads are split only
inside attention, whose all-to-alls carry the gradients back to the ranks that own the
tokens, so the sums above stay exact. The step reports the all-to-alls' seconds
(``StepStats.a2a_seconds``) beside the ring's.

Packed documents (``data.documents``): every row has its own document lengths, and the ring
takes one list per call, so a rank runs its rows one at a time and accumulates their
gradients. Under FSDP every row's backward reduce-scatters into the rank's gradient shards,
which is what the plan counts: a row left unsynced would keep every parameter's full
float32 gradient until the last row (4 bytes a parameter, 32 GB at 8B however many ranks
shard it), for the saving of one reduce-scatter of the gradients a row, which FSDP issues
block by block inside that row's backward (``tests/test_plan_comm_memory.py`` shows what
each way keeps). Each row is sharded with
its own layout (``balanced``, under ``parallel.layout: auto``, is built for the row's
documents); the row's :class:`RingContext` (layout, documents, RoPE positions on the device)
is kept in a small LRU keyed by the lengths. Labels that cross a document boundary are
``IGNORE_LABEL``, and the loss is the mean over the global batch's *counted* labels, so it
does not depend on dp, cp or how rows are split. ``StepStats.tokens`` (and tokens/s) still
counts every input token, and MFU still counts causal attention over the whole sequence, as
without documents: it overstates the attention FLOPs the document mask leaves.

Replica groups (``parallel.dp_replicate``): a trainer given a
:class:`~ringray.train.replicas.ReplicaSync` is one rank of one group. It reads its group's
slice of each global batch, joins the step's quorum first (a group behind it heals from a
live peer there), averages its reduced gradients with the other groups', and steps only when
torchft commits the step (:mod:`ringray.train.replicas`).
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ringray.accelerators import peak_flops_of
from ringray.attention import Layout, RingAgreement, RingStats, make_layout
from ringray.attention.backends import BACKENDS, resolve_backend
from ringray.attention.backends.common import upload
from ringray.attention.comm import RingComm, ring_transfer_seconds
from ringray.data import (
    IGNORE_LABEL,
    ByteTokenizer,
    HFTokenizer,
    LoaderStateMismatch,
    PackedLoader,
    Tokenizer,
    make_source,
)
from ringray.model import RingContext, Transformer, all_finite
from ringray.train.checkpoint import (
    CheckpointError,
    CheckpointRef,
    CheckpointStore,
)
from ringray.train.checkpoint_runs import check_model_config, raise_if_other_model
from ringray.train.collective import world_size
from ringray.train.materialize import build_model
from ringray.train.mesh import Mesh, MeshShape, build_mesh, resolve_mesh_shape
from ringray.train.options import TrainOptions, check_token_budget
from ringray.train.replicas import ReplicaSync, check_replicas
from ringray.train.schedule import learning_rate
from ringray.train.sharding import all_reduce_gradients, clip_gradients_, local_tensor
from ringray.train.step_stats import REPORT_FIELDS, StepStats, summarize_step


def default_device() -> torch.device:
    """This process's accelerator (the current CUDA device, as torchrun/Ray set it) or CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_peak_flops(device: torch.device) -> float | None:
    """The peak an MFU is taken against: a known GPU's dense bf16 figure; on CPU, this
    process's float32 matmul throughput, measured here (the best of five short trials, so a
    busy moment on a shared machine does not lower it)."""
    if device.type == "cuda":
        return peak_flops_of(torch.cuda.get_device_name(device))
    if device.type != "cpu":
        return None
    size, reps = 512, 10
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * reps / best


DOCUMENT_RINGS_CACHED = 64
"""Per-row ring contexts (layout, documents, RoPE positions) kept for reuse by rows with the
same document lengths (one document filling the row is the common repeat)."""


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# The loader's stream settings, by the job-file field that sets each.
LOADER_FIELDS = {"seed": "data.seed", "seq_len": "train.seq_len",
                 "global_batch": "train.global_batch"}


def compute_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The job's compute dtype: bf16, or ``None`` for float32 compute."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp32":
        return None
    raise ValueError(f"train.precision: {precision!r} is not one of 'auto', 'fp32', 'bf16'")


def check_world(options: TrainOptions, world: int,
                device: torch.device) -> tuple[MeshShape, Layout]:
    """What this world and device decide about the options, checked by arithmetic alone (no
    collective, no file touched), so a job that cannot run here is refused before it moves an
    earlier run aside or builds a model: the mesh degrees against the world size, the batch
    and the sequence against the mesh, the attention backend against the device and the
    compute dtype. Returns the mesh shape and the sequence layout.

    Raises:
        ValueError: naming the field and what would be valid.
    """
    shape = resolve_mesh_shape(world_size=world, dp=options.parallel.dp,
                               cp=options.parallel.cp, ulysses=options.parallel.ulysses)
    dp, train = shape.dp * options.parallel.dp_replicate, options.train
    if train.global_batch % dp:
        raise ValueError(
            f"train.global_batch: {train.global_batch} sequences do not split evenly "
            f"over dp={dp} replicas (use a multiple of {dp})"
        )
    try:
        layout = make_layout(options.layout_kind, shape.cp, train.seq_len,
                             ulysses=options.parallel.ulysses)
    except ValueError as exc:
        raise ValueError(f"train.seq_len: {str(exc).removeprefix('layout: ')}") from None
    name = options.parallel.attention_backend
    dtype = compute_dtype(train.precision, device) or torch.float32
    try:
        resolve_backend(name, device, dtype)
    except ValueError as exc:
        usable = [b for b in BACKENDS if b != name and _supports(b, device, dtype)]
        raise ValueError(
            f"parallel.attention_backend: {str(exc).removeprefix('backend: ')} (this job "
            f"computes in {str(dtype).removeprefix('torch.')} on {device.type}); use "
            f"{' or '.join(repr(b) for b in ['auto', *usable])}") from None
    return shape, layout


def _supports(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    try:
        resolve_backend(name, device, dtype)
    except ValueError:
        return False
    return True


class Trainer:
    """Model, optimizer, data and ring of one rank; every rank of the mesh runs one, in step.

    Raises:
        ValueError: when the options do not fit the world (mesh degrees, sequence length vs.
            the layout, batch vs. dp), naming the field. Raised before any training.
    """

    def __init__(self, options: TrainOptions, *, device: torch.device | None = None,
                 replicas: ReplicaSync | None = None) -> None:
        self.options = options
        check_replicas(replicas, options.parallel.dp_replicate)
        # This rank's link to the other replica groups (parallel.dp_replicate), or None.
        self.replicas = replicas
        self.device = device or default_device()
        shape, self.layout = check_world(options, world_size(), self.device)
        self.mesh: Mesh = build_mesh(shape, device_type=self.device.type)
        self.ring_stats = RingStats()
        # One backend for every ring call, resolved once: auto's measured choices of kernel
        # (ringray.attention.backends.routed) are kept in it for the whole run.
        self.attention_backend = resolve_backend(
            options.parallel.attention_backend, self.device,
            compute_dtype(options.train.precision, self.device) or torch.float32)
        self.ring = RingContext(
            layout=self.layout, rank=self.mesh.cp_rank, group=self.mesh.ring_group,
            ulysses_group=self.mesh.ulysses_group,
            backend=self.attention_backend, stats=self.ring_stats,
            agreement=RingAgreement(),
        )
        self._document_rings: OrderedDict[tuple[int, ...], RingContext] = OrderedDict()
        self.tokenizer: Tokenizer = (HFTokenizer.from_pretrained(options.pretrained)
                                     if options.pretrained else ByteTokenizer())
        if options.model.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(
                f"model.vocab_size: {options.model.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size}"
            )
        if options.pretrained:
            check_token_budget(options, self.tokenizer)
        # A replica group reads its own slice of each global batch (ringray.train.replicas).
        data_rank, data_size = ((self.mesh.dp_rank, shape.dp) if replicas is None
                                else replicas.loader_slot(self.mesh.dp_rank, shape.dp))
        try:
            source = make_source(options.data.source, options.data.path,
                                 seq_len=options.train.seq_len, seed=options.data.seed)
        except ValueError as exc:  # "FILE:LINE: not valid JSON ...": name the job's field
            if options.data.source != "files" or str(exc).startswith("data."):
                raise
            raise ValueError(f"data.path: {exc}") from None
        self.loader = PackedLoader(
            source,
            tokenizer=self.tokenizer,
            seq_len=options.train.seq_len, global_batch=options.train.global_batch,
            dp_rank=data_rank, dp_size=data_size, seed=options.data.seed,
        )
        # The job's RNG state (checkpointed with it); the weights have their own streams.
        torch.manual_seed(options.train.seed)
        self.compute_dtype = compute_dtype(options.train.precision, self.device)
        # With FSDP over more than one rank, FSDP's mixed precision gathers bf16 weights, so
        # there is nothing for autocast to cast; with one rank there is nothing to shard.
        self.sharded = options.parallel.fsdp and self.mesh.distributed
        built = time.perf_counter()
        self.model = self._make_model()
        # Seconds to build the model and give this rank its weights (fresh or read).
        self.model_seconds = time.perf_counter() - built
        self.autocast_dtype = None if self.sharded else self.compute_dtype
        self.optimizer = self._make_optimizer()
        self.step_count = 0
        self.flops_per_token = options.model.flops_per_token(options.train.seq_len, causal=True)
        # Measured by calibrate(), once, before the first step (not here: building a trainer
        # runs no benchmark).
        self.peak_flops_per_device: float | None = options.peak_flops_per_device
        self._transfer_seconds_per_byte: float | None = None
        if replicas is not None:
            # Heartbeating at the Lighthouse from here on, so that no group's first quorum
            # forms before every group that was built is known to it.
            replicas.attach(self)

    def calibrate(self) -> None:
        """Measure, once, what steps are reported against (collective): the device peak for
        MFU (unless ``peak_flops_per_device`` is given) and the ring's standalone transfer
        rate for the overlap split. :class:`~ringray.train.session.TrainingSession` calls it
        after building; a bare trainer calibrates at its first step."""
        if self._transfer_seconds_per_byte is not None:
            return
        if self.peak_flops_per_device is None:
            self.peak_flops_per_device = self._agreed_peak()
        self._transfer_seconds_per_byte = self._measure_transfer_rate()

    # ----------------------------------------------------------------- setup
    def _make_model(self) -> Transformer:
        """The model on this device, built on ``meta``, sharded (FSDP) or whole, and only
        then given this rank's weights: fresh from ``train.seed`` or read from the pretrained
        checkpoint, this rank's rows only (:mod:`ringray.train.materialize`). Every sharding
        starts from the same weights as a replicated run. A resumed run's checkpoint then
        overwrites them."""
        options = self.options
        model = build_model(
            options.model, device=self.device, seed=options.train.seed,
            activation_checkpointing=options.train.activation_checkpointing,
            fsdp_mesh=self.mesh.fsdp_mesh if self.sharded else None,
            param_dtype=self.compute_dtype, pretrained=options.pretrained,
        )
        model.pretrained_source = options.pretrained
        return model

    def _make_optimizer(self) -> torch.optim.AdamW:
        opt = self.options.train.optimizer
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]  # norms' gains
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": opt.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
        )

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _agreed_peak(self) -> float | None:
        """The device peak, measured per rank and agreed (the highest) so that every rank
        reports the same MFU."""
        peak = device_peak_flops(self.device)
        if peak is None or not self.mesh.distributed:
            return peak
        agreed = torch.tensor([peak], dtype=torch.float64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return agreed.item()

    def _measure_transfer_rate(self) -> float:
        """Seconds per byte of this ring's exchanges with nothing else running (median of
        three), the baseline for the overlap ratio, timed on the clock the ring's waits are
        (CUDA events on CUDA, the wall clock on CPU). Collective over the ring group. With
        Ulysses the ring's K block is its member's chunk (``layout.ring.local_len`` tokens)
        for this rank's share of the kv heads (repeated first when ulysses > kv heads)."""
        cfg = self.options.model
        dtype = self.compute_dtype or torch.float32
        # documents: one row per ring pass
        rows = 1 if self.options.data.documents else self.loader.local_batch
        ulysses = self.mesh.shape.ulysses
        k_block = torch.zeros(
            rows, self.layout.ring.local_len,
            max(cfg.n_kv_heads // ulysses, 1), cfg.head_dim, dtype=dtype, device=self.device,
        )
        comm = RingComm(self.mesh.ring_group)
        rates = []
        for _ in range(3):
            seconds, nbytes = ring_transfer_seconds(comm, k_block)
            rates.append(seconds / nbytes if nbytes else 0.0)
        return statistics.median(rates)

    # ----------------------------------------------------------------- training
    def _local_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = self.loader.next_batch()  # global order, this DP replica's rows
        rank = self.mesh.cp_rank
        return (  # pinned, non-blocking on CUDA: the upload does not wait for the stream
            upload(self.layout.shard(inputs, rank), self.device),
            upload(self.layout.shard(labels, rank), self.device),
        )

    def _document_ring(self, documents: tuple[int, ...]) -> RingContext:
        """The ring context of a row packed from ``documents``: its own layout (``balanced``
        is built for them), the documents, and RoPE positions on the device (restarting in
        each document with ``data.document_positions``), from an LRU keyed by the lengths."""
        ring = self._document_rings.get(documents)
        if ring is not None:
            self._document_rings.move_to_end(documents)
            return ring
        layout = make_layout(self.options.layout_kind, self.mesh.shape.cp,
                             self.options.train.seq_len, documents=documents,
                             ulysses=self.mesh.shape.ulysses)
        ring = RingContext.for_documents(
            documents, layout=layout, rank=self.mesh.cp_rank,
            restart_positions=self.options.data.document_positions, device=self.device,
            group=self.mesh.ring_group, ulysses_group=self.mesh.ulysses_group,
            backend=self.attention_backend, stats=self.ring_stats,
            agreement=RingAgreement(),
        )
        self._document_rings[documents] = ring
        if len(self._document_rings) > DOCUMENT_RINGS_CACHED:
            self._document_rings.popitem(last=False)
        return ring

    def _batch_backward(self) -> tuple[torch.Tensor, int]:
        """Forward and backward of this rank's share of the next batch, every row at once;
        returns its loss sum and the global batch's counted labels (the loss's divisor: all
        tokens, unless the source's loss mask leaves some out)."""
        counted = self.loader.counted_labels(self.loader.next_index, documents=False)
        inputs, labels = self._local_batch()
        # with FSDP, the reduce-scatter sums the gradients in this backward
        return self._loss_sum_backward(inputs, labels, self.ring, counted), counted

    def _loss_sum_backward(self, inputs: torch.Tensor, labels: torch.Tensor, ring: RingContext,
                           divisor: int) -> torch.Tensor:
        """Forward over ``ring``, then backward of the cross-entropy sum (labels
        ``IGNORE_LABEL`` left out) divided by ``divisor`` (at least 1: a batch with no
        counted label gives zero gradients); returns the detached sum. The model computes
        the loss chunk by chunk, never holding the full logits
        (:mod:`ringray.model.loss`)."""
        with self._autocast():
            loss_sum = self.model(inputs, ring, labels=labels, ignore_index=IGNORE_LABEL)
        (loss_sum / max(divisor, 1)).backward()
        return loss_sum.detach()

    def _documents_backward(self) -> tuple[torch.Tensor, int]:
        """Forward and backward of this rank's share of the next packed batch, one row at a
        time (each row's documents need their own ring context), accumulating gradients;
        returns its loss sum and the global batch's counted labels (the loss's divisor)."""
        batch = self.loader.next_packed()
        rank = self.mesh.cp_rank
        loss_sum = torch.zeros((), device=self.device)
        # Under FSDP each row's backward reduce-scatters into the gradient shards (FSDP2's
        # default): with sync off until the last row, every parameter's unsharded float32
        # gradient would stay allocated across the rows (see the module docstring).
        for row, documents in enumerate(batch.documents):
            ring = self._document_ring(documents)
            inputs = upload(ring.layout.shard(batch.inputs[row : row + 1], rank), self.device)
            labels = upload(ring.layout.shard(batch.labels[row : row + 1], rank), self.device)
            loss_sum += self._loss_sum_backward(inputs, labels, ring, batch.counted_labels)
        return loss_sum, batch.counted_labels

    def _gather_reports(self, report: list[float]) -> list[list[float]]:
        local = torch.tensor(report, dtype=torch.float64, device=self.device)
        if not self.mesh.distributed:
            return [local.tolist()]
        rows = [torch.empty_like(local) for _ in range(self.mesh.shape.world_size)]
        dist.all_gather(rows, local)
        return [row.tolist() for row in rows]

    def step(self) -> StepStats:
        """One optimizer step over the next global batch; returns what it measured."""
        self.calibrate()
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.replicas is not None:  # this step's quorum; a group behind it heals here
            self.replicas.start_step(self)
        train = self.options.train
        opt = train.optimizer
        lr = learning_rate(
            self.step_count, lr=opt.lr, warmup_steps=opt.warmup_steps,
            total_steps=train.steps, min_lr_ratio=opt.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        self.ring_stats.clear()
        global_tokens = train.global_batch * train.seq_len

        self.optimizer.zero_grad(set_to_none=True)
        if self.options.data.documents:
            loss_sum, counted_labels = self._documents_backward()
        else:
            loss_sum, counted_labels = self._batch_backward()
        if not self.sharded:
            all_reduce_gradients(self.model)
        committed = True
        if self.replicas is not None:  # the mean over the replica groups of this step
            loss_sum, counted_labels, committed = self.replicas.sync_gradients(
                self, loss_sum, counted_labels)
        clip = opt.grad_clip if opt.grad_clip > 0 else float("inf")
        grad_norm = clip_gradients_(self.model.parameters(), clip)
        finite = self._finite_everywhere(loss_sum, grad_norm)
        if committed and finite:
            self.optimizer.step()
            self.step_count += 1

        # Resolves CUDA events (once per step, here) and splits exposed waits into transfer
        # not hidden and peer wait against the standalone rate, timed on the same clock.
        totals = self.ring_stats.totals(
            transfer_seconds_per_byte=self._transfer_seconds_per_byte)
        report = {
            "loss_sum": loss_sum.item(),
            "attention_compute_seconds": totals.compute_seconds,
            "exposed_comm_seconds": totals.exposed_comm_seconds,
            "ring_bytes_sent": float(totals.bytes_sent),
            "a2a_seconds": totals.a2a_seconds,
            "ring_transfer_seconds": totals.transfer_seconds,
            "transfer_exposed_seconds": totals.transfer_exposed_seconds,
            "peer_wait_seconds": totals.peer_wait_seconds,
            "peak_memory_bytes": float(_peak_memory_bytes(self.device)),
            "ring_transfers_skipped": float(totals.transfers_skipped),
            "ring_bytes_skipped": float(totals.bytes_skipped),
        }
        reports = self._gather_reports([report[name] for name in REPORT_FIELDS])
        stats = summarize_step(
            reports, shape=self.mesh.shape, step=self.step_count, grad_norm=grad_norm.item(),
            learning_rate=lr, step_seconds=time.perf_counter() - start, tokens=global_tokens,
            flops_per_token=self.flops_per_token,
            peak_flops_per_device=self.peak_flops_per_device, counted_labels=counted_labels,
        )
        if not finite:
            stats = replace(stats, finite=False)
        return stats if self.replicas is None else self.replicas.step_stats(stats)

    def _finite_everywhere(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether every rank's loss sum and the gradient norm are finite: the same answer
        on every rank (one small all-reduce), so a non-finite step is skipped by all alike.
        The norm is already global (the gradients were summed), the loss sums are not."""
        flag = (torch.isfinite(loss_sum.detach()) & torch.isfinite(grad_norm)).to(torch.int32)
        if self.mesh.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    # ----------------------------------------------------------------- evaluation
    @torch.no_grad()
    def predict_next_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Greedy next-token ids ``(batch, seq)`` for global sequences ``(batch, seq)`` that
        every rank of this CP group passes identically (collective over the CP group)."""
        self.model.eval()
        seq_len, cp = tokens.shape[1], self.mesh.shape.cp
        layout = make_layout(self.options.eval_layout_kind, cp, seq_len,
                             ulysses=self.mesh.shape.ulysses)
        ring = RingContext(
            layout=layout, rank=self.mesh.cp_rank, group=self.mesh.ring_group,
            ulysses_group=self.mesh.ulysses_group,
            backend=self.attention_backend, agreement=RingAgreement(),
        )
        with self._autocast():
            logits = self.model(layout.shard(tokens, self.mesh.cp_rank).to(self.device), ring)
        local = logits.argmax(dim=-1)
        if cp == 1:
            return local.cpu()
        shards = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(shards, local, group=self.mesh.cp_group)
        return layout.unshard(shards).cpu()

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Everything a resumed run needs, as a DCP state dict. Replicated weights and
        optimizer state are written once; FSDP's are DTensor shards, each rank writing its
        own, under the same names and global shapes, so DCP reshards either kind into the
        other or into any other degree on load. The loader position and the RNG state are
        the job's (identical on every rank), so a checkpoint loads at any dp or cp degree."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "loader": self.loader.state_dict(),
            "rng": rng,
            "step": self.step_count,
            "model_config": json.dumps(self.options.model.to_dict(), sort_keys=True),
        }

    def nonfinite_weight(self) -> str | None:
        """The name of a parameter holding a NaN or an infinity on any rank (the first in
        rank order, then model order), else ``None``; the same answer on every rank."""
        bad = next((name for name, param in self.model.named_parameters()
                    if not all_finite(local_tensor(param.detach()))), None)
        if not self.mesh.distributed:
            return bad
        found: list[str | None] = [None] * self.mesh.shape.world_size
        dist.all_gather_object(found, bad)
        return next((name for name in found if name is not None), None)

    def save_checkpoint(self, store: CheckpointStore) -> CheckpointRef:
        """Write and commit a checkpoint of the current step (collective). The model's config
        goes into the commit marker, so a resume can compare it before loading a tensor."""
        return store.save(self.step_count, self.state_dict(), keep=self.options.checkpoint.keep,
                          extra={"model_config": self.options.model.to_dict()})

    _OTHER_MODEL_REMEDY = ("start a new run (another checkpoint.path) or restore the "
                           "model's settings")

    def check_model_config(self, store: CheckpointStore, ref: CheckpointRef) -> None:
        """Raise :class:`CheckpointError` (one line naming the fields and both values) if
        ``ref`` was trained with another model: before any tensor is read, so a changed shape
        is reported as such rather than as a tensor that does not fit."""
        check_model_config(store, ref, self.options.model.to_dict(),
                           remedy=self._OTHER_MODEL_REMEDY)

    def load_checkpoint(self, store: CheckpointStore, ref: CheckpointRef) -> None:
        """Restore weights, optimizer, schedule position, loader position and RNG state.

        Raises:
            CheckpointError: another model's checkpoint (see :meth:`check_model_config`).
            CheckpointCorrupt: files missing, truncated or unreadable (the caller may fall
                back to an earlier checkpoint).
        """
        self.check_model_config(store, ref)
        state = self.state_dict()
        store.load(ref, state)
        # A marker without the config (older checkpoints): the same check on the state's copy
        raise_if_other_model(ref, json.loads(state["model_config"]),
                             self.options.model.to_dict(), remedy=self._OTHER_MODEL_REMEDY)
        self.load_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        """Restore weights, optimizer, loader position, step and RNG from a state shaped as
        :meth:`state_dict`'s: a checkpoint's, or a live peer's when a replica group heals
        (:mod:`ringray.train.replicas`). The loader's settings are compared first: a
        checkpoint taken with another ``data.seed``, ``train.seq_len`` or
        ``train.global_batch`` raises :class:`CheckpointError` naming the job field."""
        try:
            self.loader.check_state(state["loader"])
        except LoaderStateMismatch as exc:
            field = LOADER_FIELDS[exc.name]
            raise CheckpointError(
                f"{field}: the checkpoint was trained with {exc.saved}, this run has "
                f"{exc.current}, so its next step would read other data; set {field}: "
                f"{exc.saved} to resume it, or start a new run (another checkpoint.path, or "
                f"checkpoint.resume: false with checkpoint.move_aside: true)") from None
        set_state_dict(
            self.model, self.optimizer,
            model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        )
        self.loader.load_state_dict(state["loader"])
        self.step_count = int(state["step"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
