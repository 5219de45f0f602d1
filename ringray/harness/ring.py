"""One rank's model and its forward over the ring, and how rank 0 drives the other ranks.

    engine = RingEngine(options)                          # cp = 1: one process, no group
    sums = engine.score(tokens, rows, targets)            # (requests, 2): log p, greedy misses
    next_ids = engine.argmax(tokens, positions)           # (rows,): greedy next token
    next_ids = engine.prefill(tokens, lengths)            # the same at lengths - 1, cached
    next_ids = engine.decode(next_ids)                    # one token a row, from the cache

Every rank of a ring of ``cp`` ranks holds the same model and is given the same global token
batch; each keeps its layout share (``layout.shard``), runs the decoder with ring attention,
and computes what it can from its own positions alone: the log-probabilities of the target
tokens it holds, whether each is the argmax, or the argmax at a position it holds. One
all-reduce over the ring combines them. The forward is exact: the ring is exact attention,
a batch is padded on the right (a causal model's earlier positions never see the padding)
up to a length the layout splits, and padded positions are never read.

The decoder's output projection runs only on the positions asked about, not on the whole
shard, so a long context with a short continuation never holds ``seq × vocab`` logits: the
engine keeps the checkpoint's output layer aside and runs the decoder with an identity in
its place (``Transformer.forward`` ends with ``self.output(hidden)``).

Greedy generation can keep a KV cache (:mod:`ringray.harness.kv_cache`): ``prefill`` runs
the prompts' forward once and keeps each rank's share of every layer's K/V; each ``decode``
then runs the new tokens alone, attending to every rank's cached share and merging the
partial results over the ring. The engine holds one cache, that of the last ``prefill``;
any other forward (``score``, ``argmax``, a new ``prefill``) frees it first.

Rank 0 runs lm_eval; the other ranks run :func:`serve`. Each call rank 0 makes through
:class:`Lockstep` is broadcast first (its name and arguments, pickled, over the control
group), then every rank runs it. The control group waits as long as lm_eval may take between
two forwards (building a task's data can take minutes); the work group (the ring and the
all-reduces) has the job's collective timeout, so a rank that dies or hangs in a forward
fails the others within it. A rank that raises leaves its process, and the launcher
(:mod:`ringray.harness.launch`) then stops the others.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringray.attention import RingAgreement, make_layout
from ringray.attention.backends import resolve_backend
from ringray.attention.layouts import Layout, seq_len_divisor
from ringray.harness import kv_cache
from ringray.harness.options import HarnessOptions
from ringray.model import ModelOptions, RingContext, Transformer, load_hf_weights
from ringray.train.trainer import compute_dtype

log = logging.getLogger(__name__)

RINGS_CACHED = 16
"""Ring contexts (layout, agreement) kept, one per padded sequence length."""

T = TypeVar("T")

LOGIT_ROWS = 1024
"""Positions whose logits are computed at once (each ``vocab`` floats)."""


def rank_device(requested: str | None, rank: int, cp: int) -> torch.device:
    """The device a rank runs on. Unset or CUDA (lm_eval's command line says ``cuda:0``
    unless told otherwise): this rank's GPU (rank modulo the GPUs visible) in a ring of
    several ranks, the requested one in a ring of one, and the CPU where there is no CUDA
    (as lm_eval's hf model falls back). Anything else (``cpu``) as given."""
    if requested is not None and not requested.startswith("cuda"):
        return torch.device(requested)
    if not torch.cuda.is_available():
        if requested is not None:
            log.warning("ringray.harness: device %s requested but CUDA is not available; "
                        "using the CPU", requested)
        return torch.device("cpu")
    if cp > 1 or requested is None:
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(requested)


def load_model(options: HarnessOptions, device: torch.device) -> Transformer:
    """The checkpoint as a ringray :class:`Transformer` in float32 on ``device``, with the
    ``rope.*`` overrides applied to its config.json (RoPE has no weights, so the
    checkpoint's tensors fit either way)."""
    config = ModelOptions(from_pretrained=options.pretrained, rope=options.rope).build()
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the two names separate tensors
    load_hf_weights(model, options.pretrained)
    model.pretrained_source = options.pretrained
    return model.to(device).eval().requires_grad_(False)


@dataclass(frozen=True)
class Groups:
    """The process groups of a ring: ``work`` for the ring and its all-reduces (the
    collective timeout), ``control`` for rank 0's broadcasts (waits as long as lm_eval
    does). ``None``: the default group."""

    work: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None


_groups = Groups()


def use_groups(groups: Groups) -> None:
    """Set the groups that engines and :class:`Lockstep` built from now on in this process
    use (the launcher sets them; by default both are the default group)."""
    global _groups
    _groups = groups


def current_groups() -> Groups:
    return _groups


def group_size(groups: Groups | None = None) -> int:
    """Ranks of the work group (1 outside torch.distributed): the ring's default size."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size((groups or current_groups()).work)


def check_group(cp: int, groups: Groups) -> None:
    """``ValueError`` (one line, saying how to launch) unless a ring of ``cp`` ranks is the
    whole work group: no process group, or one of one rank, for ``cp == 1``."""
    world = group_size(groups)
    if cp > 1 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"cp: {cp} ranks need a process group of {cp}; start them with "
                         f"python -m ringray.harness --cp {cp} -- <lm_eval arguments>")
    if world != cp:
        raise ValueError(f"cp: {cp}, but the process group has {world} ranks; the ring is "
                         f"the whole group (use cp={world})")


class RingEngine:
    """One rank's model, on its device, and the forward over its ring (see the module
    docstring). With ``cp > 1`` every method is a collective over the work group, and every
    rank must call it with the same arguments, in the same order.

    Raises:
        ValueError: ``cp`` does not match the process group (one line saying how to launch).
    """

    def __init__(self, options: HarnessOptions, groups: Groups | None = None) -> None:
        self.options = options
        self.groups = groups or current_groups()
        self.cp = options.cp
        check_group(self.cp, self.groups)
        self.rank = dist.get_rank(self.groups.work) if self.cp > 1 else 0
        self.device = rank_device(options.device, self.rank, self.cp)
        self.autocast_dtype = compute_dtype(options.precision, self.device)
        model = load_model(options, self.device)
        # One backend for every ring call, resolved once (as the trainer does): auto's
        # measured kernel choices (ringray.attention.backends.routed) last the evaluation.
        self.attention_backend = resolve_backend(
            options.attention_backend, self.device,
            self.autocast_dtype or next(model.parameters()).dtype)
        self.config = model.config
        # The output projection runs on the positions asked about only (see the module
        # docstring); with tied embeddings it still shares the embedding table.
        self.head: nn.Module = model.output
        model.output = nn.Identity()
        self.model = model
        self.layout_kind = options.layout_kind
        self.divisor = seq_len_divisor(self.layout_kind, self.cp)
        self._rings: OrderedDict[int, RingContext] = OrderedDict()
        self._cache: kv_cache.KVCache | None = None

    # ------------------------------------------------------------------ helpers
    def padded_length(self, length: int) -> int:
        """The shortest length ``>= length`` that the layout splits over the ring."""
        return max(1, math.ceil(length / self.divisor)) * self.divisor

    def _ring(self, seq_len: int) -> RingContext:
        ring = self._rings.get(seq_len)
        if ring is not None:
            self._rings.move_to_end(seq_len)
            return ring
        layout = make_layout(self.layout_kind, self.cp, seq_len)
        ring = RingContext(layout=layout, rank=self.rank,
                           group=self.groups.work if self.cp > 1 else None,
                           backend=self.attention_backend, agreement=RingAgreement())
        self._rings[seq_len] = ring
        if len(self._rings) > RINGS_CACHED:
            self._rings.popitem(last=False)
        return ring

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _local(self, tokens: torch.Tensor) -> tuple[torch.Tensor, RingContext]:
        """This rank's share of ``tokens`` (padded on the right to the layout's length), on
        its device, and the ring. Frees the KV cache: a new forward starts."""
        self._cache = None
        seq_len = self.padded_length(tokens.shape[1])
        padded = F.pad(tokens, (0, seq_len - tokens.shape[1]), value=0)
        ring = self._ring(seq_len)
        return ring.layout.shard(padded, self.rank).to(self.device), ring

    def _hidden(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Layout]:
        """The final norm's output for this rank's share of ``tokens`` (padded on the right
        to the layout's length), and the layout."""
        local, ring = self._local(tokens)
        with self._autocast():
            hidden = self.model(local, ring)
        return hidden, ring.layout

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return self.head(hidden).float()

    def _all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.cp > 1:
            dist.all_reduce(tensor, op=op, group=self.groups.work)
        return tensor

    # ------------------------------------------------------------------ collectives
    @torch.no_grad()
    def score(self, tokens: torch.Tensor, rows: torch.Tensor,
              targets: torch.Tensor) -> torch.Tensor:
        """Sums of target log-probabilities and counts of non-greedy targets.

        ``tokens`` ``(B, L)``: the batch's inputs, right-padded (any id). ``rows`` ``(R,)``:
        the batch row of each of R requests. ``targets`` ``(R, L)``: at position ``p`` the
        token that position ``p`` should predict (the input's ``p + 1``), or -1 where
        nothing is scored. Returns ``(R, 2)`` float64 on the CPU: the sum of ``log p``
        (float32 log-softmax, summed in float64) and how many targets were not the argmax
        of the log-softmax (lm_eval's greedy check: zero means greedy).
        """
        hidden, layout = self._hidden(tokens)
        width = layout.seq_len
        targets = F.pad(targets, (0, width - targets.shape[1]), value=-1)
        local_targets = layout.shard(targets, self.rank).to(self.device)
        rows = rows.to(self.device)
        request, position = (local_targets >= 0).nonzero(as_tuple=True)
        out = torch.zeros(targets.shape[0], 2, dtype=torch.float64, device=self.device)
        for start in range(0, request.numel(), LOGIT_ROWS):
            req = request[start:start + LOGIT_ROWS]
            pos = position[start:start + LOGIT_ROWS]
            logprobs = F.log_softmax(self._logits(hidden[rows[req], pos]), dim=-1)
            wanted = local_targets[req, pos]
            picked = logprobs.gather(1, wanted[:, None])[:, 0]
            missed = logprobs.argmax(dim=-1) != wanted
            out[:, 0].index_add_(0, req, picked.double())
            out[:, 1].index_add_(0, req, missed.double())
        return self._all_reduce(out).cpu()

    @torch.no_grad()
    def argmax(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The argmax of the float32 logits at ``positions[b]`` of each row ``b`` of
        ``tokens`` ``(B, L)`` (greedy decoding's next token), ``(B,)`` long on the CPU."""
        hidden, layout = self._hidden(tokens)
        return self._argmax_at(hidden, layout, positions)

    def _argmax_at(self, hidden: torch.Tensor, layout: Layout,
                   positions: torch.Tensor) -> torch.Tensor:
        """:meth:`argmax` from this rank's final hidden states."""
        local_index = torch.full((layout.seq_len,), -1, dtype=torch.long)
        held = layout.positions(self.rank)
        local_index[held] = torch.arange(held.numel())
        where = local_index[positions]
        out = torch.full((hidden.shape[0],), -1, dtype=torch.long, device=self.device)
        mine = (where >= 0).nonzero(as_tuple=True)[0]
        if mine.numel():
            index = mine.to(self.device)
            logits = self._logits(hidden[index, where[mine].to(self.device)])
            out[index] = logits.argmax(dim=-1)
        return self._all_reduce(out, dist.ReduceOp.MAX).cpu()

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """:meth:`argmax` at ``lengths - 1`` of the prompts ``tokens`` ``(B, L)`` (row ``b``'s
        first ``lengths[b]`` tokens, right-padded), keeping this rank's share of their K/V
        for :meth:`decode` (in place of any cache before)."""
        local, ring = self._local(tokens)
        with self._autocast():
            hidden, cache = kv_cache.prefill(self.model, local, ring, lengths)
        self._cache = cache
        return self._argmax_at(hidden, ring.layout, lengths - 1)

    @torch.no_grad()
    def decode_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The float32 logits ``(B, vocab)`` on the CPU after appending ``tokens`` ``(B,)``,
        one to each cached row (at position ``length + tokens decoded before``), on every
        rank."""
        return self._next_logits(tokens).cpu()

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Greedy decoding's next token ``(B,)`` long on the CPU after appending ``tokens``
        (see :meth:`decode_logits`), agreed by every rank."""
        out = self._next_logits(tokens).argmax(dim=-1)
        return self._all_reduce(out, dist.ReduceOp.MAX).cpu()

    def _next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._cache is None:
            raise RuntimeError("decode: no KV cache; call prefill first (any other forward "
                               "frees the cache)")
        if tokens.shape != (self._cache.rows,):
            raise ValueError(f"decode: {self._cache.rows} rows are cached, got tokens of "
                             f"shape {tuple(tokens.shape)}")
        with self._autocast():
            hidden = kv_cache.decode(self.model, self._cache, tokens)
        return self._logits(hidden)


# ---------------------------------------------------------------------- lockstep

_INIT, _STOP = "init", "stop"
_CALLS = ("score", "argmax", "prefill", "decode")


class _RingState:
    """Rank 0's view of its followers in this process: whether they were told to stop,
    and whether a call failed (then they may be inside a collective, and a stop broadcast
    could pair with nothing: the launcher ends them instead)."""

    stopped = False
    broken = False


_state = _RingState()


def _broadcast(message: list, groups: Groups) -> list:
    dist.broadcast_object_list(message, src=0, group=groups.control)
    return message


def _agree_built(error: str | None, groups: Groups) -> None:
    """Every rank's engine was built, or every rank raises the first error."""
    errors: list[str | None] = [None] * dist.get_world_size(groups.control)
    dist.all_gather_object(errors, error, group=groups.control)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, first = failed[0]
        raise ValueError(first if rank == dist.get_rank(groups.control)
                         else f"rank {rank}: {first}")


def _build(options: HarnessOptions, groups: Groups) -> tuple[RingEngine | None, str | None]:
    try:
        return RingEngine(options, groups), None
    except ValueError as exc:  # one line naming the field: reported as it is
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
        return None, f"{type(exc).__name__}: {exc}"


class Lockstep:
    """Rank 0's engine: each call is broadcast to the other ranks (running :func:`serve`)
    before rank 0 runs it, so every rank runs the same forward. With ``cp == 1`` it is the
    engine itself, with no process group.

    Raises:
        ValueError: an engine could not be built on some rank (the same on every rank).
    """

    def __init__(self, options: HarnessOptions, groups: Groups | None = None) -> None:
        self.groups = groups or current_groups()
        self.distributed = options.cp > 1
        if not self.distributed:
            self.engine = RingEngine(options, self.groups)
            self.closed = False
            return
        check_group(options.cp, self.groups)
        if dist.get_rank(self.groups.control) != 0:
            raise ValueError("Lockstep: only rank 0 drives the ring; the other ranks run "
                             "ringray.harness.serve()")
        _broadcast([_INIT, options], self.groups)
        _state.stopped = False
        engine, error = _build(options, self.groups)
        _agree_built(error, self.groups)
        self.engine: RingEngine = engine
        self.closed = False

    def _call(self, name: str, *args: torch.Tensor) -> torch.Tensor:
        if self.closed:
            raise RuntimeError("Lockstep: the ring was stopped")
        if self.distributed:
            _broadcast([name, args], self.groups)
        try:
            return getattr(self.engine, name)(*args)
        except BaseException:
            # The others may still be inside the collective: a stop broadcast now could
            # pair with nothing. The launcher stops them when this process exits.
            self.closed = True
            _state.broken = self.distributed
            raise

    def score(self, tokens: torch.Tensor, rows: torch.Tensor,
              targets: torch.Tensor) -> torch.Tensor:
        """:meth:`RingEngine.score` on every rank."""
        return self._call("score", tokens, rows, targets)

    def argmax(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`RingEngine.argmax` on every rank."""
        return self._call("argmax", tokens, positions)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """:meth:`RingEngine.prefill` on every rank."""
        return self._call("prefill", tokens, lengths)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`RingEngine.decode` on every rank."""
        return self._call("decode", tokens)

    def padded_length(self, length: int) -> int:
        return self.engine.padded_length(length)

    def close(self) -> None:
        """Tell the other ranks to leave :func:`serve` (nothing after a failed call)."""
        if not self.closed and self.distributed:
            stop_followers(self.groups)
        self.closed = True


def stop_followers(groups: Groups | None = None) -> None:
    """Rank 0: tell the other ranks to leave :func:`serve`, whether or not a model was
    ever built (the launcher's rank 0 does this when lm_eval returns). Once only; nothing
    after a failed call (see :class:`_RingState`)."""
    if _state.stopped or _state.broken:
        return
    _broadcast([_STOP, None], groups or current_groups())
    _state.stopped = True


def lead(work: Callable[[], T], groups: Groups | None = None) -> T:
    """Rank 0 of a ring whose other ranks run :func:`serve`: ``work()`` (which drives them
    through :class:`Lockstep`), then tell them to stop, whether ``work`` returned or raised
    (nothing after a failed call: see :func:`stop_followers`)."""
    _state.stopped = _state.broken = False
    try:
        return work()
    finally:
        stop_followers(groups)


def serve(groups: Groups | None = None) -> int:
    """A rank other than 0: run rank 0's calls until it says stop; returns how many forward
    calls it ran. A call that raises leaves here (and the process: the launcher and rank 0
    then see the ring fail)."""
    groups = groups or current_groups()
    engine: RingEngine | None = None
    calls = 0
    while True:
        name, payload = _broadcast([None, None], groups)
        if name == _STOP:
            return calls
        if name == _INIT:
            engine, error = _build(payload, groups)
            try:
                _agree_built(error, groups)
            except ValueError as exc:  # rank 0 raises it; wait for its next engine or stop
                log.warning("ringray.harness: no engine on this rank: %s", exc)
                engine = None
            continue
        if name not in _CALLS or engine is None:
            raise RuntimeError(f"serve: rank 0 sent {name!r} with no engine built")
        getattr(engine, name)(*payload)
        calls += 1
