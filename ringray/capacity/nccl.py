"""NCCL's own buffers: device memory a GPU job holds outside PyTorch's caching allocator.

    buffers = comm_buffers(inputs, cluster)   # at the job's cp and ulysses
    buffers.ring_bytes, buffers.fsdp_bytes, buffers.total_bytes

NCCL allocates a connection's buffers itself (``cuMem``), the first time a communicator talks
to a peer, and keeps them for the communicator's life, so ``torch.cuda.max_memory_allocated``
(what ``ringray bench memory`` measures and :mod:`ringray.train.footprint` models) never
counts them. ``ringray plan`` shows them as lines of their own and adds them to the
per-device total that must fit (:class:`~ringray.capacity.fit.MemoryBreakdown`). What grows
with the job's choices is counted; the default group's own communicator (every job has one)
stays in :data:`~ringray.capacity.fit.MEMORY_RESERVE_RATIO` with the CUDA context:

- **The ring's point-to-point connections.** Ring attention sends each K/V block straight
  from its owner to every rank that reads it, and each dK/dV sum straight back
  (:mod:`ringray.attention.transfers`), with ``batch_isend_irecv`` on the ring's process
  group: one NCCL communicator (torch's ProcessGroupNCCL runs a batch on the group's own
  communicator; a lone ``isend`` would get a 2-rank one). NCCL connects a peer's ``C``
  channels at the first send to or receive from it (``src/enqueue.cc``) and keeps them: a
  connection per peer a rank sends to and one per peer it receives from
  (:func:`transfer_peers`: under causal zigzag every rank talks to all R − 1 others; a ring
  that only relays to its neighbours talks to 2). Per device, with ``s``/``r`` the peers it
  sends to and receives from on its node::

      ring P2P bytes = C x (r x RECEIVE_BYTES + s x SEND_BYTES)   [+ the network pools]

  ``RECEIVE_BYTES`` is the receiver's buffer of one connection and channel: NCCL's three
  protocols' buffers, LL (``8 x 512 x NCCL_STEPS x 16`` = 512 KiB), LL128
  (``120 x 640 x NCCL_STEPS x 8`` = 4.7 MiB) and Simple (``NCCL_BUFFSIZE``, 4 MiB), rounded
  up to the 2 MiB ``cuMem`` granularity: 10 MiB (NCCL ``src/init.cc`` ``computeBuffSizes``,
  ``src/transport/p2p.cc`` ``p2pRecvSetup``); ``SEND_BYTES`` is the sender's side, its
  control structure at that granularity, 2 MiB. (With P2P read, NVLink on Ampere and later,
  the Simple buffer moves to the sender: the pair's total is the same.) NCCL issue #1685
  shows exactly these two sizes, 32 channels per pair, on 8 x H100 all-to-all, and 3.28 GB
  taken by the first all-to-all, where this formula gives 2.8 GB (7 peers both ways).
  Peers on other nodes go through the network transport, whose point-to-point buffers are
  one shared pool per direction, ``p2p channels x NCCL_SHARED_STEPS (16) x
  NCCL_P2P_NET_CHUNKSIZE (128 KiB)`` (``src/transport/net.cc``), however many remote peers.
- **The FSDP communicator.** FSDP shards over the mesh flattened to ``dp_shard_cp``
  (:data:`ringray.train.mesh.FSDP_DIM`): every rank of the job, but a communicator of its
  own beside the default group's, with its own ring channels. A collective channel holds
  one receive and one send connection: ``channels x (RECEIVE_BYTES + SEND_BYTES)``.
  (Communicators split from the default one share nothing unless NCCL's ``splitShare`` is
  set, which torch does not do by default.)
- **Ulysses' all-to-all** (``parallel.ulysses`` U > 1): NCCL runs an all-to-all as grouped
  sends and receives, so the Ulysses group's communicator holds U − 1 peers' connections,
  counted as the ring's (a group stays on one node).

Channels (:func:`nccl_channels`) are NCCL's topology's choice, not a setting; the figures
here are what public NCCL logs report. Inside one node with NVLink (H100, H200, A100; a
custom device is taken as one): 32 channels per P2P peer (issue #1685, 8 x H100: NCCL's
``ncclTopoGetNchannels`` gives 2 per NVLink, rounded up to a power of two and capped at the
P2P channel count) and 32 collective channels. Across nodes a communicator takes the
smallest count over its peers, the network's: 2 per peer, 16 collective and 16 P2P channels
(issue #1453, 3 x 8 H100). A PCIe path (L40S, L4) gets 2 (``ncclTopoGetNchannels``).
``NCCL_BUFFSIZE``, ``NCCL_NCHANNELS_PER_NET_PEER`` and ``NCCL_MAX_P2P_NCHANNELS`` change
them; the plan assumes NCCL's defaults.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ringray.accelerators import ClusterShape
from ringray.attention.transfer_plan import TransferPlan
from ringray.capacity.inputs import PlanInputs
from ringray.capacity.masked import MAX_WALKED_POSITIONS

MIB = 1 << 20
NCCL_STEPS = 8  # src/include/device.h
LL_BUFFER_BYTES = 8 * 512 * NCCL_STEPS * 16  # lines/thread x threads x steps x 16-byte line
LL128_BUFFER_BYTES = 120 * 640 * NCCL_STEPS * 8  # elements/thread x threads x steps x 8 bytes
SIMPLE_BUFFER_BYTES = 4 * MIB  # NCCL_BUFFSIZE's default
CUMEM_GRANULARITY_BYTES = 2 * MIB
RECEIVE_BYTES = math.ceil((LL_BUFFER_BYTES + LL128_BUFFER_BYTES + SIMPLE_BUFFER_BYTES)
                          / CUMEM_GRANULARITY_BYTES) * CUMEM_GRANULARITY_BYTES
"""One connection's buffers on the receiving device, one channel: 10 MiB."""
SEND_BYTES = CUMEM_GRANULARITY_BYTES
"""One connection's sending side, one channel: its control structure, 2 MiB."""
SHARED_NET_STEPS = 16  # src/transport/net.cc NCCL_SHARED_STEPS
P2P_NET_CHUNK_BYTES = 128 * 1024  # NCCL_P2P_NET_CHUNKSIZE's default

NVLINK_ACCELERATORS = ("H100", "H200", "A100")


@dataclass(frozen=True, kw_only=True)
class NcclChannels:
    """What NCCL gives one communicator (see the module docstring)."""

    collective: int  # ring channels of a collective
    per_peer: int  # channels a P2P peer's connection uses
    p2p: int  # P2P channels in all (the size of the network's shared pools)
    nodes: int  # nodes the communicator spans


def nccl_channels(cluster: ClusterShape, *, ranks: int) -> NcclChannels:
    """The channels of a communicator of ``ranks`` consecutive ranks on ``cluster``."""
    per_node = cluster.gpus_per_node
    nodes = 1 if per_node is None else math.ceil(ranks / per_node)
    if nodes > 1:
        return NcclChannels(collective=16, per_peer=2, p2p=16, nodes=nodes)
    if cluster.nodes is not None and cluster.accelerator.name not in NVLINK_ACCELERATORS:
        return NcclChannels(collective=2, per_peer=2, p2p=2, nodes=1)
    return NcclChannels(collective=32, per_peer=32, p2p=32, nodes=1)


Peers = tuple[tuple[frozenset[int], frozenset[int]], ...]
"""Per rank of a ring: (the ranks it sends to, the ranks it receives from)."""


def transfer_peers(plan: TransferPlan) -> Peers:
    """Every rank's peers over one ring call of ``plan``, forward and backward: K/V blocks
    out to readers and in from owners, dK/dV sums back to owners and in from readers."""
    peers = []
    for rank in range(plan.world_size):
        sends, receives = set(), set()
        for step in (*plan.forward_steps(rank), *plan.backward_steps(rank)):
            exchange = step.exchange
            if exchange is None:
                continue
            sends.update(p for p in (exchange.kv_to, exchange.dkv_to) if p is not None)
            receives.update(p for p in (exchange.kv_from, exchange.dkv_from) if p is not None)
        peers.append((frozenset(sends), frozenset(receives)))
    return tuple(peers)


def every_peer(ring_size: int) -> Peers:
    """Each rank sending to and receiving from every other rank (causal zigzag or striped
    over one document; the bound for packed documents, whose rows each reach some peers
    and whose connections stay open once made)."""
    return tuple((frozenset(set(range(ring_size)) - {r}),) * 2 for r in range(ring_size))


def p2p_buffer_bytes(peers: Peers, *, nodes: Sequence[int], channels: NcclChannels) -> int:
    """The most P2P buffer bytes any one rank holds: per channel, a receive buffer per peer
    it receives from and a send side per peer it sends to on its node, and the network's
    shared pools (one per direction) once it has a peer on another node. ``nodes[i]``: the
    node of ring rank ``i``."""
    pool = channels.p2p * SHARED_NET_STEPS * P2P_NET_CHUNK_BYTES
    most = 0
    for rank, (sends, receives) in enumerate(peers):
        here = nodes[rank]
        total = channels.per_peer * (
            sum(RECEIVE_BYTES for p in receives if nodes[p] == here)
            + sum(SEND_BYTES for p in sends if nodes[p] == here))
        total += pool * (any(nodes[p] != here for p in sends)
                         + any(nodes[p] != here for p in receives))
        most = max(most, total)
    return most


def collective_buffer_bytes(channels: NcclChannels) -> int:
    """A collective communicator's ring channels, each a receive and a send connection."""
    return channels.collective * (RECEIVE_BYTES + SEND_BYTES)


def most_peers(peers: Peers) -> int:
    """The most peers one rank sends to or receives from."""
    return max((max(len(s), len(r)) for s, r in peers), default=0)


@dataclass(frozen=True, kw_only=True)
class CommBuffers:
    """NCCL's buffers on one device (see the module docstring); 0 where a part is absent."""

    ring_peers: int  # the most peers one ring rank sends to or receives from
    ring_channels: int  # channels per peer of the ring's communicator
    ring_bytes: int
    fsdp_channels: int = 0  # collective channels of the dp_shard_cp communicator
    fsdp_bytes: int = 0
    ulysses_peers: int = 0
    ulysses_channels: int = 0
    ulysses_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.ring_bytes + self.fsdp_bytes + self.ulysses_bytes


def ring_nodes(cluster: ClusterShape, *, ring_size: int, ulysses: int) -> tuple[int, ...]:
    """The node of each ring member (member i is global rank i x ulysses of the first ring:
    the mesh is ``arange(world).view(dp, ring, ulysses)``, packed onto consecutive nodes)."""
    per_node = cluster.gpus_per_node
    return tuple(0 if per_node is None else i * ulysses // per_node for i in range(ring_size))


def ring_peers(inputs: PlanInputs, ring_size: int, *, walk: bool) -> Peers:
    """The ring's peers for ``inputs`` on a ring of ``ring_size``: with sliding windows and
    ``walk`` (the job's own ring, small enough to walk: the step plan's bound), the transfer
    plans of its windows together; otherwise every peer (one causal document: every rank
    reads every block, or at least one rank does; packed documents: see :func:`every_peer`)."""
    cfg = inputs.model
    windows = set(cfg.layer_window(layer) for layer in range(cfg.n_layers))
    if (ring_size == 1 or not walk or windows == {None} or inputs.packs_documents
            or inputs.documents is not None
            or inputs.seq_len * ring_size > MAX_WALKED_POSITIONS):
        return every_peer(ring_size)
    from ringray.attention.layouts import make_layout
    from ringray.attention.transfers import plan_transfers

    layout = make_layout(inputs.layout, ring_size, inputs.seq_len)
    found = [transfer_peers(plan_transfers(layout, True, None, window)) for window in windows]
    return tuple((frozenset().union(*(f[r][0] for f in found)),
                  frozenset().union(*(f[r][1] for f in found))) for r in range(ring_size))


def comm_buffers(inputs: PlanInputs, cluster: ClusterShape, *, cp: int | None = None,
                 ulysses: int | None = None) -> CommBuffers:
    """NCCL's buffers on one device of ``inputs`` at ``cp`` ranks per sequence as ring ×
    ``ulysses`` (default the job's, and its ulysses at its own cp, else 1)."""
    own = cp is None or cp == inputs.cp
    if ulysses is None:
        ulysses = inputs.ulysses if own else 1
    cp = cp or inputs.cp
    ring_size = cp // ulysses
    ring = nccl_channels(cluster, ranks=cp)
    peers = ring_peers(inputs, ring_size, walk=own and ulysses == inputs.ulysses)
    ring_bytes = p2p_buffer_bytes(
        peers, nodes=ring_nodes(cluster, ring_size=ring_size, ulysses=ulysses), channels=ring)
    fsdp = {}
    if inputs.fsdp and inputs.dp * cp > 1:
        world = nccl_channels(cluster, ranks=inputs.dp * cp)
        fsdp = dict(fsdp_channels=world.collective, fsdp_bytes=collective_buffer_bytes(world))
    group = {}
    if ulysses > 1:
        a2a = nccl_channels(cluster, ranks=ulysses)
        group = dict(ulysses_peers=ulysses - 1, ulysses_channels=a2a.per_peer,
                     ulysses_bytes=p2p_buffer_bytes(every_peer(ulysses), nodes=[0] * ulysses,
                                                    channels=a2a))
    return CommBuffers(ring_peers=most_peers(peers), ring_channels=ring.per_peer,
                       ring_bytes=ring_bytes, **fsdp, **group)
