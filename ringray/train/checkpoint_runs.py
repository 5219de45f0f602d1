"""How a run meets a checkpoint location: what it restores, whether a new run may start
there, moving an earlier run aside, and whether a checkpoint is this model's.

    plan = plan_run(store, resume=True, move_aside=False)   # lineage + restore candidates
    check_new_run(store, move_aside=False)                  # LocationInUse, one line
    check_model_config(store, ref, model.to_dict(), remedy="...")
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import fsspec

from ringray.train.checkpoint import CheckpointStore
from ringray.train.checkpoint_catalog import UNKNOWN_LINEAGE, new_lineage
from ringray.train.checkpoint_errors import CheckpointError
from ringray.train.checkpoint_ref import CheckpointRef
from ringray.train.policy import model_config_differences


class LocationInUse(ValueError):
    """``checkpoint.resume`` is off but the location already holds another run's checkpoints."""


def move_run_aside(store: CheckpointStore) -> str:
    """Move everything at the store's location to ``<location>.previous-<unix time>`` (rank
    0; a rename on a local disk, a copy and a delete on object stores); returns the new
    place."""
    target = f"{store.location}.previous-{int(time.time())}"
    _, target_root = fsspec.core.url_to_fs(target)
    store._fs.mv(store._root, target_root, recursive=True)
    return target


def check_model_config(store: CheckpointStore, ref: CheckpointRef, current: dict, *,
                       remedy: str) -> None:
    """Raise :class:`CheckpointError` (one line naming each field that differs and both
    values, then ``remedy``) unless ``ref``'s marker records the model config ``current``
    (``ModelOptions.to_dict()``): before any tensor is read, so another model's checkpoint is
    reported as such, not as a tensor that does not fit, or, for a model with fewer layers,
    not at all. A marker from before configs were recorded passes."""
    saved = store.marker(ref).get("model_config")
    if saved is None:
        return
    raise_if_other_model(ref, saved, current, remedy=remedy)


def raise_if_other_model(ref: CheckpointRef, saved: dict, current: dict, *,
                         remedy: str) -> None:
    """The model-config check, in its one wording (:func:`model_config_differences`):
    :class:`CheckpointError` naming each field that differs and both values, then
    ``remedy``."""
    detail = model_config_differences(saved, current)
    if detail:
        raise CheckpointError(f"model: checkpoint {ref.location} was trained with a different "
                              f"model ({detail}); {remedy}")


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """How a run starts on a checkpoint location (:func:`plan_run`)."""

    lineage: str  # the lineage this run's checkpoints belong to
    restore: tuple[CheckpointRef, ...]  # checkpoints to try, newest first (empty: fresh)
    moved_aside_to: str | None = None  # where an earlier run's checkpoints went


def plan_run(store: CheckpointStore, *, resume: bool, move_aside: bool) -> RunPlan:
    """Decide a run's lineage and what it restores (rank 0, before any training).

    - ``resume``: continue the newest lineage at the location (its checkpoints, newest first,
      with any damaged one in its place by step, to be refused with its reason), or start a
      new one when there is none.
    - not ``resume`` and the location is empty: a new lineage.
    - not ``resume`` with checkpoints present (damaged ones too): refused
      (:class:`LocationInUse`, one line naming the location), unless ``move_aside``: they are
      moved to ``<location>.previous-<time>`` first. Two runs' checkpoints never mix.
    """
    if resume:
        lineage = store.newest_lineage()
        restore = tuple(store.restore_order(lineage or UNKNOWN_LINEAGE))
        return RunPlan(lineage=lineage or new_lineage(), restore=restore)
    if not check_new_run(store, move_aside=move_aside):
        return RunPlan(lineage=new_lineage(), restore=())
    return RunPlan(lineage=new_lineage(), restore=(), moved_aside_to=move_run_aside(store))


def check_new_run(store: CheckpointStore, *, move_aside: bool) -> bool:
    """Whether a new run (``resume`` off) finds another run's checkpoints at the location
    (then ``move_aside`` must be on); raises :class:`LocationInUse` when they are there and
    it is not. Reads only: :func:`plan_run` does the moving."""
    present = store.committed() + store.damaged()
    if present and not move_aside:
        newest = max(present, key=lambda r: r.step)
        raise LocationInUse(
            f"checkpoint.resume: false, but {store.location} holds checkpoints of an earlier "
            f"run (up to step {newest.step}); resume it (checkpoint.resume: true), give "
            f"checkpoint.path a new place, or set checkpoint.move_aside: true"
        )
    return bool(present)
