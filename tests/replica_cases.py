"""Replica groups as plain processes, for tests/test_replicas.py: each group is its own gloo
world (its own store) of ``ranks`` spawned processes, and groups are started, killed and
restarted one at a time, as an agent that replaces a dead group would. The rank functions
live here so that spawned processes can import them by name.

Every process reports to one queue: ``("step", record)`` per step it took, ``("died",
record)`` just before it exits on purpose, ``("done", index, rank, result)`` and ``("error",
index, rank, traceback)``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from distributed import free_loopback_port
from torch.utils._pytree import tree_map
from train_cases import gradients, snapshot

from ringray.train import Trainer, TrainOptions
from ringray.train.replicas import ReplicaMembership, ReplicaSync
from ringray.train.sharding import local_tensor

TIMEOUT_SECONDS = 10.0
"""Cross-replica collectives and heals (a dead peer fails the step sooner: its sockets
close)."""


def start_group(ctx: Any, index: int, ranks: int, events: Any, fn: Callable, *args: Any
                ) -> list[mp.Process]:
    """Start replica group ``index``: ``ranks`` processes joined by their own gloo world,
    each running ``fn(group_store_port, index, rank, events, *args)``."""
    port = free_loopback_port()
    procs = [ctx.Process(target=_entry, args=(index, rank, ranks, port, events, fn, args),
                         daemon=True)
             for rank in range(ranks)]
    for proc in procs:
        proc.start()
    return procs


def _entry(index: int, rank: int, ranks: int, port: int, events: Any, fn: Callable,
           args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # single-machine runs: keep gloo on loopback
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=ranks, timeout=timedelta(seconds=60))
        result = fn(port, index, rank, events, *args)
        events.put(("done", index, rank, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report anything, assertion errors included
        events.put(("error", index, rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def stop(procs: list[mp.Process]) -> None:
    """Kill the processes started here that still run (only these)."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)


class Events:
    """The queue's messages as they come, kept; ``wait`` reads until a predicate holds."""

    def __init__(self, events: Any) -> None:
        self.queue = events
        self.steps: list[dict] = []
        self.died: list[dict] = []
        self.done: dict[tuple[int, int], Any] = {}

    def wait(self, until: Callable[[Events], bool], *, timeout_seconds: float,
             what: str) -> None:
        deadline = time.monotonic() + timeout_seconds
        while not until(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out after {timeout_seconds:.0f}s waiting for "
                                     f"{what}; steps so far: {self.steps[-8:]}")
            try:
                message = self.queue.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            kind = message[0]
            if kind == "step":
                self.steps.append(message[1])
            elif kind == "died":
                self.died.append(message[1])
            elif kind == "done":
                self.done[(message[1], message[2])] = pickle.loads(message[3])
            else:
                raise AssertionError(f"replica {message[1]} rank {message[2]} failed:\n"
                                     f"{message[3]}")

    def of(self, index: int, *, rank: int = 0, incarnation: int = 0) -> list[dict]:
        return [s for s in self.steps if s["replica"] == index and s["rank"] == rank
                and s["incarnation"] == incarnation]


def _sync(port: int, index: int, count: int, lighthouse: str,
          heal_transport: str = "http") -> ReplicaSync:
    return ReplicaSync(ReplicaMembership(
        index=index, count=count, lighthouse=lighthouse, store=("127.0.0.1", port),
        timeout_seconds=TIMEOUT_SECONDS, quorum_timeout_seconds=120.0,
        heal_transport=heal_transport))


# ----------------------------------------------------------------- rank functions
def record_replica_steps(port: int, index: int, rank: int, events: Any,
                         options: TrainOptions, lighthouse: str, steps: int) -> dict:
    """``steps`` steps of replica ``index``: losses, gradients, participants, weights."""
    sync = _sync(port, index, options.parallel.dp_replicate, lighthouse)
    trainer = Trainer(options, replicas=sync)
    record: dict = {"losses": [], "grads": [], "participating": [], "committed": []}
    while trainer.step_count < steps:
        stats = trainer.step()
        record["losses"].append(stats.loss)
        record["grads"].append(gradients(trainer))
        record["participating"].append(stats.replicas_participating)
        record["committed"].append(stats.committed)
    record["weights"] = snapshot(trainer)
    sync.shutdown()
    return record


def train_until_stopped(port: int, index: int, rank: int, events: Any,
                        options: TrainOptions, lighthouse: str, incarnation: int,
                        stop_at: Any, die_after_joint: int | None,
                        stop_after_joint: int | None) -> dict:
    """Train replica ``index`` step after step, reporting each, until the shared
    ``stop_at`` step. ``die_after_joint``: after that many steps committed by every group,
    die (``os._exit``) inside the next step, once its quorum has formed: the others are
    then in a step with this group. ``stop_after_joint``: after that many, set ``stop_at``
    two steps ahead (every group then stops at the same step). Returns the final state."""
    count = options.parallel.dp_replicate
    sync = _sync(port, index, count, lighthouse)
    trainer = Trainer(options, replicas=sync)
    joint = 0
    while not (stop_at.value and trainer.step_count >= stop_at.value):
        if die_after_joint is not None and joint >= die_after_joint:
            _die_after_quorum(sync, events, index, rank)
        stats = trainer.step()
        events.put(("step", {
            "replica": index, "rank": rank, "incarnation": incarnation, "step": stats.step,
            "committed": stats.committed, "participating": stats.replicas_participating,
            "quorum_size": stats.quorum_size, "samples_dropped": stats.samples_dropped,
            "healed": stats.healed, "heal_seconds": stats.heal_seconds,
            "quorum_seconds": stats.quorum_seconds, "loader_index": trainer.loader.next_index,
            "wall": time.time(),
        }))
        if stats.committed and len(stats.replicas_participating) == count:
            joint += 1
            if stop_after_joint is not None and joint >= stop_after_joint and not stop_at.value:
                stop_at.value = stats.step + 2
    state = tree_map(lambda v: local_tensor(v).clone() if isinstance(v, torch.Tensor) else v,
                     trainer.state_dict())
    sync.shutdown()
    return {"state": state, "step": trainer.step_count}


def _die_after_quorum(sync: ReplicaSync, events: Any, index: int, rank: int) -> None:
    join = sync.start_step

    def start_then_die(trainer: Trainer) -> None:
        join(trainer)
        events.put(("died", {"replica": index, "rank": rank, "step": trainer.step_count,
                             "wall": time.time()}))
        events.close()
        events.join_thread()  # the message is out before the process is
        os._exit(3)

    sync.start_step = start_then_die


def train_from_checkpoint(port: int, index: int, rank: int, events: Any,
                          options: TrainOptions, lighthouse: str, restore_step: int | None,
                          perturb: bool, until: int, heal_transport: str = "http") -> dict:
    """Replica ``index`` restores the checkpoint of ``restore_step`` from ``options``'s
    checkpoint location (None: starts from the seed's weights, as a replacement does),
    with ``perturb`` adds 1e-3 to one weight and falls behind (as the controller makes a
    group whose digest differs), then trains to step ``until``, a heal's state coming by
    ``heal_transport``. Returns its steps and state."""
    from ringray.train.checkpoint import CheckpointStore

    sync = _sync(port, index, options.parallel.dp_replicate, lighthouse, heal_transport)
    trainer = Trainer(options, replicas=sync)
    if restore_step is not None:
        store = CheckpointStore(options.checkpoint_location)
        trainer.load_checkpoint(store, next(ref for ref in store.committed()
                                            if ref.step == restore_step))
    if perturb:
        with torch.no_grad():
            local_tensor(next(trainer.model.parameters())).view(-1)[0] += 1e-3
        sync.fall_behind()
    steps = []
    while trainer.step_count < until:
        stats = trainer.step()
        steps.append({"step": stats.step, "committed": stats.committed, "healed": stats.healed,
                      "participating": stats.replicas_participating})
    state = tree_map(lambda v: local_tensor(v).clone() if isinstance(v, torch.Tensor) else v,
                     trainer.state_dict())
    sync.shutdown()
    return {"steps": steps, "state": state}


class Done:
    """A finished collective."""

    def wait(self) -> bool:
        return True


class FakeManager:
    """A torchft ``Manager`` for a quorum of this replica group alone (the others dead):
    sums over one member are the tensors themselves, and every step is committed."""

    def __init__(self) -> None:
        self.step = 0  # torchft's: set from the trainer's before each quorum

    def start_quorum(self) -> None:
        pass

    def allreduce(self, tensor: torch.Tensor, *, reduce_op: object) -> Done:
        return Done()

    def should_commit(self) -> bool:
        return True

    def num_participants(self) -> int:
        return 1

    def shutdown(self, wait: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": 0}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.step = state_dict["step"]


class _TwinQuorum(FakeManager):
    """A quorum of this group and a twin holding the same tensors: a sum doubles each tensor,
    in place, as a process group does; records each tensor it is handed, with whether the
    trainer was inside a backward then."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[tuple[torch.Tensor, bool]] = []

    def allreduce(self, tensor: torch.Tensor, *, reduce_op: object) -> Done:
        self.handed.append((tensor, torch._C._current_graph_task_id() != -1))
        tensor.mul_(2)
        return Done()

    def num_participants(self) -> int:
        return 2


def rank_sums_of_a_twin_quorum(rank: int, world: int, options: TrainOptions) -> dict:
    """One step of replica group 0 of 2 (this world) beside a twin group: which tensors the
    cross-replica sum was handed, in order (``"tally"``, or ``"grad"`` when the tensor is
    the storage of one of this rank's gradients after the step), whether each was handed
    inside the backward, and the full gradients after the step."""
    twin = _TwinQuorum()
    member = ReplicaMembership(index=0, count=2, lighthouse="-", store=("-", 0))
    sync = ReplicaSync(member, make_manager=lambda *args: twin)
    trainer = Trainer(options, replicas=sync)
    assert trainer.step().committed
    storages = {local_tensor(p.grad).untyped_storage().data_ptr()
                for p in trainer.model.parameters()}
    handed = [("tally" if tensor.dtype == torch.float64 else
               "grad" if tensor.untyped_storage().data_ptr() in storages else "copy",
               in_backward) for tensor, in_backward in twin.handed]
    return {"handed": handed, "grads": gradients(trainer),
            "params": sum(1 for _ in trainer.model.parameters())}
