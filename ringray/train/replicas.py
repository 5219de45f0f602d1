"""Replica groups (``parallel.dp_replicate``): copies of the dp × cp mesh that average their
gradients through torchft, so that one replica group's death stops no other and rolls back
no committed step.

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)   # one per job (torchft)
    member = ReplicaMembership(index=r, count=R, lighthouse=lighthouse.address(),
                               store=(master_addr, master_port))  # replica r's own store
    trainer = Trainer(options, replicas=ReplicaSync(member))      # every rank of replica r
    while trainer.step_count < options.train.steps:
        stats = trainer.step()    # stats.committed, .replicas_participating, .healed
    trainer.replicas.shutdown()

Each replica group is its own ``torch.distributed`` world (its own torchrun, or its own plain
processes), holding the whole dp × ring × ulysses mesh of today (:mod:`ringray.train.mesh`),
FSDP included: inside a replica nothing changes. Across replicas, rank *i* of every group
holds the same weights (or, under FSDP, the same shard), so each rank averages its gradients
with rank *i* of the other groups through its own torchft ``Manager`` (a quorum per step at
the Lighthouse, a process group reconfigured to the quorum's members), and the optimizer
steps only when ``should_commit()`` says every rank of the group succeeded.

**The batch.** The global batch's rows are cut into ``dp_replicate × dp`` slices in order:
replica *r*'s dp rank *d* reads slice ``r × dp + d`` (its loader is that of a dp of
``dp_replicate × dp``), so with every replica present a step reads exactly what a run of
``dp_replicate × dp`` replicas in one world reads.

**An exact average.** Every rank backpropagates its token sum divided by the *global*
batch's counted labels, as without replicas, and the replica sums its ranks' gradients as
today. Across replicas the gradients are *summed* (not torchft's default mean), with each
replica's counted labels and loss sum beside them, and the sum is scaled by
``global counted labels / counted labels of the replicas that took part``. The gradient is
then the token mean over exactly the counted labels trained on, whether every replica took
part (the factor is exactly 1: the same sums as one world of ``dp_replicate × dp``) or some
were missing; a mean of per-replica means would weigh a replica's tokens by how many its
slice happened to count.

**A replica that misses steps.** Its slices of those steps are *dropped*, not handed to the
survivors: every batch index keeps its fixed rows, so a replica's reads never depend on who
else was alive, a survivor's step keeps its shape and memory, and the samples lost are
counted (``StepStats.samples_dropped``). Every replica's loader stands at the same batch (the
committed steps' and the non-finite attempts' passed over, which every group judges alike
from the same sums): a step that is not committed (a peer died during it) is not taken, its
batch is read again by the next attempt, and the RNG is put back as it was at the step's
start; a replica that heals takes its peer's position. A checkpoint written by
any replica therefore resumes exactly.

**Healing.** A replica group behind the quorum's step (started late, or restarted after a
death) receives, at a step's start and before its forward, the full state of a live peer's
rank with its own rank number: weights, optimizer state, loader position, RNG and step
(:meth:`Trainer.state_dict <ringray.train.trainer.Trainer.state_dict>`, FSDP shards as this
rank's local tensors), through torchft's checkpoint transport (HTTP by default).

torchft gives the quorum, the reconfigurable process group, ``should_commit`` and the
transfer of a state dict from a live peer; ringray adds which rows a replica reads, the exact
average, the rewind of an uncommitted step, the state a heal carries and what each step
reports. The Lighthouse (its ``min_replicas``, ``join_timeout_ms`` and
``heartbeat_timeout_ms``: a dead replica is left out once its heartbeats stop for that long)
belongs to whoever starts the job.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlsplit

import torch
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from ringray.train.sharding import local_tensor, set_reduce_hook
from ringray.train.step_stats import StepStats


class TrainerView(Protocol):
    """What a replica group's link uses of :class:`ringray.train.trainer.Trainer` (a protocol,
    so this module, which the trainer imports, does not import it back)."""

    options: Any
    mesh: Any
    model: torch.nn.Module
    loader: Any
    device: torch.device
    step_count: int

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

HEAL_TRANSPORTS = ("http", "process_group")
"""How a heal's state travels (:attr:`ReplicaMembership.heal_transport`)."""

REPLICA_ID_PREFIX = "ringray_replica_"
"""A group's torchft replica id is this prefix and its index (torchft reads the trailing
digits as the group's number)."""


# ----------------------------------------------------------------- plain data
@dataclass(frozen=True, kw_only=True)
class ReplicaMembership:
    """Which replica group this process belongs to and how it reaches the others."""

    index: int | None
    """This group's index, 0 to count - 1: which slice of each global batch it reads.
    None: a standby group, built ahead without a place (:meth:`ReplicaSync.take_place`
    gives it one, when it replaces a lost group)."""
    count: int
    """Replica groups of the job (``parallel.dp_replicate``)."""
    lighthouse: str
    """The torchft Lighthouse's address (``LighthouseServer.address()``)."""
    store: tuple[str, int]
    """``(host, port)`` of this group's TCPStore (torchrun's MASTER_ADDR and MASTER_PORT);
    the other groups reach it, so the host must be an address they can reach."""
    timeout_seconds: float = 60.0
    """A ``should_commit`` or a heal's transfer may take this long before the step is given
    up (not committed)."""
    collective_timeout_seconds: float = 30.0
    """A cross-replica gradient average waits this long for a group that does not take part
    (one cut off by a partition: a dead one's connections close at once), then the step is
    not committed and the next one forms its quorum without that group."""
    quorum_timeout_seconds: float = 60.0
    """How long a step's start waits for the quorum to form."""
    heal_transport: str = "http"
    """How a group behind receives a live peer's state (:data:`HEAL_TRANSPORTS`): ``http``,
    torchft's checkpoint server on each rank (the state served from host memory), or
    ``process_group``, sent over the replica process group the averages use (torchft's
    ``PGTransport``: gloo on CPU, NCCL from device memory on GPUs)."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"parallel.dp_replicate: {self.count} must be >= 1")
        if self.heal_transport not in HEAL_TRANSPORTS:
            raise ValueError(f"cluster.replica_heal_transport: {self.heal_transport!r} is not "
                             f"one of {', '.join(HEAL_TRANSPORTS)}")
        if self.index is not None and not 0 <= self.index < self.count:
            raise ValueError(f"replica index: {self.index} is not one of the "
                             f"{self.count} replica groups (0 to {self.count - 1})")

    @property
    def replica_id(self) -> str:
        if self.index is None:
            raise RuntimeError("a standby replica group has no replica id until it takes a "
                               "lost group's place")
        return f"{REPLICA_ID_PREFIX}{self.index}"


@dataclass(frozen=True, kw_only=True)
class ReplicaStep:
    """What the replicas did in one step, for :class:`StepStats`."""

    committed: bool
    quorum_size: int
    participating: tuple[int, ...]  # replica indices; () when not committed
    samples_dropped: int
    quorum_seconds: float
    healed: bool
    heal_seconds: float


def replica_world_size(workers: int, dp_replicate: int) -> int:
    """Ranks per replica group when a job of ``workers`` ranks is ``dp_replicate`` groups.

    Raises:
        ValueError: showing the arithmetic when the groups cannot be equal.
    """
    if dp_replicate < 1 or workers % dp_replicate:
        raise ValueError(
            f"parallel.dp_replicate: {dp_replicate} does not divide the {workers} workers into "
            f"equal replica groups; use a divisor of {workers}")
    return workers // dp_replicate


def loader_slot(index: int, count: int, dp_rank: int, dp: int) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` a rank's loader reads as: replica ``index`` of ``count``
    takes slice ``index × dp + dp_rank`` of ``count × dp``."""
    return index * dp + dp_rank, count * dp


def replica_rows(index: int, count: int, global_batch: int) -> range:
    """The rows of each global batch that replica group ``index`` of ``count`` reads."""
    rows = global_batch // count
    return range(index * rows, (index + 1) * rows)


def participation_scale(counted_labels: int, counted_participating: int) -> float:
    """What the summed gradients are multiplied by: each replica's gradients are divided by
    the global batch's counted labels, the step's mean is over the participants' only.
    Exactly 1.0 when every replica took part."""
    if counted_participating == counted_labels:
        return 1.0
    return counted_labels / max(counted_participating, 1)


def check_replicas(replicas: ReplicaSync | None, dp_replicate: int) -> None:
    """Raise ``ValueError`` in one line unless a trainer of a job with ``dp_replicate``
    groups is given its group's sync (and one of a job without them is given none)."""
    if replicas is not None:
        if dp_replicate != replicas.group.count:
            raise ValueError(
                f"parallel.dp_replicate: {dp_replicate}, but this replica group was started "
                f"as one of {replicas.group.count}; start dp_replicate groups")
    elif dp_replicate > 1:
        raise ValueError(
            f"parallel.dp_replicate: {dp_replicate} replica groups need a ReplicaSync per "
            f"trainer (ringray.train.replicas): `ringray train` starts them, and `python -m "
            f"ringray.train --replica-group I` under one torchrun per group")


def require_torchft() -> Any:
    """The torchft module, or ``ValueError`` in one line if it cannot be imported."""
    try:
        return importlib.import_module("torchft")
    except ImportError as exc:
        raise ValueError(f"parallel.dp_replicate: replica groups need torchft, which cannot be "
                         f"imported ({exc}); pip install torchft") from None


# ----------------------------------------------------------------- torchft's side
class ReplicaManager(Protocol):
    """The part of ``torchft.Manager`` a :class:`ReplicaSync` uses (a fake in unit tests)."""

    def start_quorum(self) -> None: ...
    def allreduce(self, tensor: torch.Tensor, *, reduce_op: Any) -> Any: ...  # .wait()
    def should_commit(self) -> bool: ...
    def num_participants(self) -> int: ...
    def shutdown(self, wait: bool = True) -> None: ...
    def state_dict(self) -> dict[str, int]: ...  # {"step", "batches_committed"}
    def load_state_dict(self, state_dict: dict[str, int]) -> None: ...


ManagerFactory = Callable[[ReplicaMembership, int, int, Callable[[], dict],
                           Callable[[dict], None]], ReplicaManager]
"""``(group, rank, world_size, state_dict, load_state_dict) -> manager``."""


def advertised_host(lighthouse: str) -> str:
    """The address other hosts reach this process at: the local address of the route to the
    Lighthouse (``http://host:port``), in URL form (an IPv6 one in brackets).

    torchft advertises ``socket.gethostname()`` by default, for its manager (to the
    Lighthouse) and for its checkpoint server (to a healing peer). Where host names do not
    resolve across hosts (KubeRay pods, many clouds, hosts of their own UTS namespace) every
    group then waits for an address nobody can reach. The route to the Lighthouse is one the
    other groups' processes share (they reach the same Lighthouse), and on a host with two
    interfaces it is the one that reaches them. No packet is sent: connecting a UDP socket
    only chooses the route.

    Raises:
        ValueError: ``lighthouse`` names no host, or no route leads to it (one line).
    """
    parts = urlsplit(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    if not parts.hostname:
        raise ValueError(f"replica groups: the Lighthouse address {lighthouse!r} names no host")
    try:
        family, _, _, _, where = socket.getaddrinfo(parts.hostname, parts.port or 29510,
                                                    type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(where)
            host = probe.getsockname()[0]
    except OSError as exc:
        raise ValueError(f"replica groups: no route from this host to the Lighthouse at "
                         f"{lighthouse} ({exc})") from None
    return f"[{host}]" if ":" in host else host


def _advertising_transport(torchft: Any, host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``host`` instead of the host name
    (its ``address()`` has no parameter for it: the one method replaced)."""

    class AdvertisedHTTPTransport(torchft.checkpointing.HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)


def torchft_manager(group: ReplicaMembership, rank: int, world_size: int,
                    state_dict: Callable[[], dict],
                    load_state_dict: Callable[[dict], None]) -> ReplicaManager:
    """A torchft ``Manager`` for ``rank`` of ``group``: gloo across replicas on CPU, NCCL on
    CUDA; a synchronous quorum (a heal finishes before the step's forward); no sync at step
    0 (every replica builds the same weights from ``train.seed``). The manager and the
    checkpoint server advertise this host's address (:func:`advertised_host`), never its
    name."""
    torchft = require_torchft()
    importlib.import_module("torchft.checkpointing")
    timeout = timedelta(seconds=group.timeout_seconds)
    # The process group's own timeout bounds each average; the manager's (longer) bounds
    # should_commit and a heal's transfer, which moves the whole state.
    collective = timedelta(seconds=group.collective_timeout_seconds)
    cuda = torch.cuda.is_available()
    pg = (torchft.ProcessGroupNCCL(timeout=collective) if cuda
          else torchft.ProcessGroupGloo(timeout=collective))
    host, port = group.store
    me = advertised_host(group.lighthouse)
    if group.heal_transport == "process_group":
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        pg_transport = importlib.import_module("torchft.checkpointing.pg_transport")
        transport = pg_transport.PGTransport(pg, timeout=timeout, device=device)
    else:
        transport = _advertising_transport(torchft, me, timeout)
    return torchft.Manager(
        pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        use_async_quorum=False, init_sync=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=group.quorum_timeout_seconds),
        connect_timeout=timeout, rank=rank, world_size=world_size, store_addr=host,
        store_port=port, lighthouse_addr=group.lighthouse, replica_id=group.replica_id,
        hostname=me, checkpoint_transport=transport,
    )


AVERAGE_BUCKET_BYTES = 25 * 2**20
"""With replicated weights (under FSDP each unit's reduced shards are summed where they are,
in the backward), the cross-replica sum packs gradients smaller than this into buffers of at
most this many bytes, and sums a gradient this large or larger where it is; at most two
buffers are in flight. (It used to copy every gradient into one flat buffer first: one more
gradient set per rank, 32 GB for an 8B model in float32.)"""


def gradient_buckets(sizes: list[int], limit: int = AVERAGE_BUCKET_BYTES) -> list[list[int]]:
    """Consecutive indices of gradients of ``sizes`` bytes, in buckets of at most ``limit``
    bytes; a gradient of ``limit`` bytes or more is a bucket of its own."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index, size in enumerate(sizes):
        if current and (size >= limit or held + size > limit):
            buckets.append(current)
            current, held = [], 0
        current.append(index)
        held += size
        if size >= limit:
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets


def sum_in_place(manager: ReplicaManager, grads: list[torch.Tensor], *,
                 limit: int = AVERAGE_BUCKET_BYTES) -> None:
    """Sum ``grads`` with the same rank of the other replica groups, in place: a bucket of
    one contiguous gradient is summed where it is, the others through a buffer of at most
    ``limit`` bytes, and a bucket's sum is copied back while the next one's is in flight."""
    in_flight: list[tuple[Any, torch.Tensor | None, list[int]]] = []

    def land(work: Any, buffer: torch.Tensor | None, indices: list[int]) -> None:
        work.wait()
        if buffer is None:
            return
        offset = 0
        for index in indices:
            grad = grads[index]
            grad.copy_(buffer[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    sizes = [grad.numel() * grad.element_size() for grad in grads]
    for indices in gradient_buckets(sizes, limit):
        alone = len(indices) == 1 and grads[indices[0]].is_contiguous()
        buffer = None if alone else torch.cat([grads[i].reshape(-1) for i in indices])
        target = grads[indices[0]] if alone else buffer
        in_flight.append((manager.allreduce(target, reduce_op=ReduceOp.SUM), buffer, indices))
        if len(in_flight) > 1:
            land(*in_flight.pop(0))
    for item in in_flight:
        land(*item)


def _set_manager_step(manager: ReplicaManager, step: int) -> None:
    """Make torchft's step ``step``. torchft heals a group whose manager's step is behind the
    quorum's and compares nothing else, while its manager counts from 0 at every start: a
    group that restored step N (or a fresh replacement, at 0, joining groups that restored N)
    would otherwise be at 0 like every other, never healed, and gradients of different weights
    averaged every step. The trainer's step is the truth; torchft's is set from it before
    every quorum (equal anyway after a committed step or a heal, which set both)."""
    state = manager.state_dict()
    if state["step"] != step:
        manager.load_state_dict({**state, "step": step})


# ----------------------------------------------------------------- the trainer's hook
class ReplicaSync:
    """One rank's link to the other replica groups; the trainer
    (:class:`ringray.train.trainer.Trainer`) calls it at the start of each step
    (:meth:`start_step`) and after its own gradient reduction (:meth:`sync_gradients`).
    ``make_manager`` replaces torchft's ``Manager`` (tests)."""

    def __init__(self, group: ReplicaMembership, *,
                 make_manager: ManagerFactory | None = None) -> None:
        if make_manager is None:
            require_torchft()  # before anything connects
        self.group = group
        self._make_manager = make_manager or torchft_manager
        self._manager: ReplicaManager | None = None
        self._trainer: TrainerView | None = None
        self._rng: dict[str, torch.Tensor] = {}
        self._quorum_seconds = 0.0
        self._summing: list[tuple[Any, torch.Tensor]] = []
        self._healed = False
        self._behind = False
        self.last: ReplicaStep | None = None
        """What the replicas did in the last step."""

    # ------------------------------------------------------------- setup
    def loader_slot(self, dp_rank: int, dp: int) -> tuple[int, int]:
        """``(dp_rank, dp_size)`` this rank's loader reads as (:func:`loader_slot`); a
        standby's, as group 0's until it takes its place."""
        return loader_slot(self.group.index or 0, self.group.count, dp_rank, dp)

    @property
    def standing_by(self) -> bool:
        """Built ahead as a standby group, with no place yet (no torchft manager)."""
        return self.group.index is None

    def take_place(self, group: ReplicaMembership) -> None:
        """A standby takes a lost group's place: its loader reads that group's slice, and
        its torchft manager starts heartbeating (its step is behind the others', so it heals
        from a live peer at its first step, as any replacement does). The trainer, the
        process group and the probes were built while it stood by."""
        if not self.standing_by:
            raise RuntimeError(f"replica group {self.group.index} already has a place")
        if group.index is None or group.count != self.group.count:
            raise ValueError(f"a standby takes one of the {self.group.count} groups' places, "
                             f"not {group.index} of {group.count}")
        self.group = group
        trainer = self._trainer
        trainer.loader.dp_rank = self.loader_slot(trainer.mesh.dp_rank, trainer.mesh.shape.dp)[0]
        self._manager_for(trainer)

    def attach(self, trainer: TrainerView) -> None:
        """Create this rank's torchft ``Manager`` now (the trainer calls it when built), so
        that the group heartbeats at the Lighthouse before any group asks for its first
        quorum. Without it, a group whose build finished first could ask while another
        group's managers did not exist yet, and the Lighthouse (``min_replicas=1``, no group
        known to wait for) would give it a quorum of one: the first steps would run without
        the other groups, which then wait out their quorum timeout. With every group known,
        the first quorum waits for a majority of them, then for the rest up to the join
        timeout; later quorums form at once from the previous quorum's members. A standby
        (no index) has no manager until :meth:`take_place`."""
        self._trainer = trainer
        set_reduce_hook(trainer.model, self._sum_in_backward)
        if not self.standing_by:
            self._manager_for(trainer)

    def _manager_for(self, trainer: TrainerView) -> ReplicaManager:
        if self.standing_by:
            raise RuntimeError("a standby replica group takes a place before it trains")
        if self._manager is None:
            self._trainer = trainer
            self._manager = self._make_manager(
                self.group, trainer.mesh.rank, trainer.mesh.shape.world_size,
                self._heal_state, self._heal_from)
        return self._manager

    # ------------------------------------------------------------- a step
    def start_step(self, trainer: TrainerView) -> None:
        """Join this step's quorum; a group behind it loads a live peer's state here (before
        the step's forward, so it trains the same step as its peers)."""
        manager = self._manager_for(trainer)
        self._healed = False
        behind, self._behind = self._behind, False
        _set_manager_step(manager, 0 if behind else trainer.step_count)
        start = time.perf_counter()
        manager.start_quorum()
        self._quorum_seconds = time.perf_counter() - start
        self._rng = _rng_state(trainer.device)
        self._batch = trainer.loader.next_index  # the batch this attempt reads
        self._summing = []

    def _sum_in_backward(self, reduced: torch.Tensor) -> None:
        """FSDP's hook (:func:`~ringray.train.sharding.set_reduce_hook`): start summing one
        unit's gradient shards with the other groups' as soon as its reduce-scatter is done,
        in place, while the backward goes on to the units before it; :meth:`sync_gradients`
        waits for them."""
        manager = self._manager_for(self._trainer)
        self._summing.append((manager.allreduce(reduced, reduce_op=ReduceOp.SUM), reduced))

    def fall_behind(self) -> None:
        """Heal from a live peer at the next step's start, whatever step this group is at:
        its state was found to differ from the others' at the same step (a checkpoint's
        digest comparison). torchft heals a group whose step is behind the quorum's, so this
        group asks for its next quorum at step 0; alone in that quorum it trains on, and its
        step is the trainer's again from the step after."""
        self._behind = True

    def sync_gradients(self, trainer: TrainerView, loss_sum: torch.Tensor,
                       counted_labels: int) -> tuple[torch.Tensor, int, bool]:
        """Sum this rank's gradients, loss sum, counted labels and replica index with the
        same rank of the other groups in the quorum, scale the gradients to the mean over
        the participants' counted labels (:func:`participation_scale`), and ask torchft
        whether the step may be taken. Returns ``(loss_sum, counted_labels, committed)``:
        the participants' loss sum (this rank's share) and counted labels. A step that is
        not committed is rewound: the loader reads its batch again, the RNG is restored.

        Under FSDP the gradients' sums were started inside the backward, one per unit (each
        unit's summed shards, where they are: :meth:`_sum_in_backward`); this waits for
        them. Gradients not summed there (replicated weights) are summed here, in place, in
        buckets (:func:`sum_in_place`). Every group issues its sums in the same order (the
        same units in the same backward, then the tally, then the rest)."""
        manager = self._manager_for(trainer)
        group, batch = self.group, self._batch
        summing, self._summing = self._summing, []
        summed = {reduced.untyped_storage().data_ptr() for _, reduced in summing}
        grads = [local_tensor(p.grad) for p in trainer.model.parameters()]
        rest = [grad for grad in grads if grad.untyped_storage().data_ptr() not in summed]
        mine = trainer.loader.counted_labels(
            batch, documents=trainer.options.data.documents,
            rows=replica_rows(group.index, group.count, trainer.options.train.global_batch))
        # float64: counts and loss sums stay exact; one slot per replica says who took part
        tally = torch.zeros(2 + group.count, dtype=torch.float64, device=trainer.device)
        tally[0], tally[1], tally[2 + group.index] = loss_sum.double(), mine, 1.0
        tallied = manager.allreduce(tally, reduce_op=ReduceOp.SUM)
        sum_in_place(manager, rest)
        for work, _ in summing:
            work.wait()
        tallied.wait()
        committed = manager.should_commit()
        quorum_size = manager.num_participants()
        if not committed:
            trainer.loader.next_index = batch  # the next attempt reads this batch again
            _set_rng_state(self._rng, trainer.device)
            self._record(committed=False, quorum_size=quorum_size, participating=())
            return loss_sum, counted_labels, False
        counted_participating = round(tally[1].item())
        scale = participation_scale(counted_labels, counted_participating)
        if scale != 1.0:
            torch._foreach_mul_(grads, scale)
        participating = tuple(i for i in range(group.count) if tally[2 + i].item() > 0.5)
        self._record(committed=True, quorum_size=quorum_size, participating=participating)
        return tally[0].to(loss_sum.dtype), counted_participating, True

    def _record(self, *, committed: bool, quorum_size: int,
                participating: tuple[int, ...]) -> None:
        trainer = self._trainer
        rows = trainer.options.train.global_batch // self.group.count
        missing = self.group.count - len(participating) if committed else 0
        self.last = ReplicaStep(
            committed=committed, quorum_size=quorum_size, participating=participating,
            samples_dropped=missing * rows, quorum_seconds=self._quorum_seconds,
            healed=self._healed, heal_seconds=self._quorum_seconds if self._healed else 0.0)

    def step_stats(self, stats: StepStats) -> StepStats:
        """``stats`` with what the replicas did in this step. Tokens, tokens/s and the MFU
        count what was trained: the participants' slices of the global batch (a missing
        group's slices are dropped), and the MFU is the job's (over every group's devices,
        not this group's alone). A step not committed trained nothing and keeps the batch's
        figures (it is taken again)."""
        last = self.last
        if last is None:
            return stats
        count = self.group.count
        share = len(last.participating) / count if last.committed else 1.0
        return replace(
            stats, tokens=round(stats.tokens * share),
            tokens_per_second=stats.tokens_per_second * share,
            mfu=None if stats.mfu is None else stats.mfu * share / count,
            committed=last.committed, quorum_size=last.quorum_size,
            replicas_participating=list(last.participating),
            samples_dropped=last.samples_dropped, quorum_seconds=last.quorum_seconds,
            healed=last.healed, heal_seconds=last.heal_seconds)

    def shutdown(self) -> None:
        """Stop this rank's torchft servers (the others see this group leave)."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None

    # ------------------------------------------------------------- healing
    def _heal_state(self) -> dict:
        """What a peer behind us receives: the trainer's full state, FSDP shards as this
        rank's local tensors (the same rank of the peer holds the same shards)."""
        fault_pause("sending")
        return tree_map(local_tensor, self._trainer.state_dict())

    def _heal_from(self, state: dict) -> None:
        """Load a live peer's state (torchft calls this inside :meth:`start_step`)."""
        trainer = self._trainer
        own = trainer.state_dict()
        trainer.load_state_dict(_like(state, own))
        self._healed = True


FAULT_PAUSE_ENV = "RINGRAY_FAULT_PAUSE_DIR"
"""Fault injection for the replica fault tests, unset in real runs (then nothing pauses)."""


def fault_pause(point: str, *, limit_seconds: float = 120.0) -> None:
    """With :data:`FAULT_PAUSE_ENV` = DIR in this process's environment, write
    ``DIR/<point>-<pid>`` and wait until ``DIR/go`` exists (at most ``limit_seconds``), so that
    a test can kill a process while it stands at ``point`` (``sending``: a peer about to send
    its state to a healing group, which waits for it meanwhile)."""
    folder = os.environ.get(FAULT_PAUSE_ENV)
    if not folder:
        return
    with open(os.path.join(folder, f"{point}-{os.getpid()}"), "w"):
        pass
    deadline = time.monotonic() + limit_seconds
    while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)


def _like(received: Any, own: Any) -> Any:
    """``received`` with each tensor that is a DTensor in ``own`` made one again, with its
    placements (the tensors travel as local shards)."""
    if isinstance(own, dict):
        return {key: _like(received[key], own[key]) if key in own else received[key]
                for key in received}
    if isinstance(own, (list, tuple)) and isinstance(received, (list, tuple)):
        return type(received)(_like(r, o) for r, o in zip(received, own, strict=True))
    if isinstance(own, DTensor):
        return DTensor.from_local(received.to(own.device), own.device_mesh, own.placements,
                                  shape=own.shape, stride=own.stride(), run_check=False)
    return received


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
