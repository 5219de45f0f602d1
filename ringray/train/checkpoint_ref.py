"""A committed checkpoint's name: the one type the checkpoint store and its errors share.

:mod:`ringray.train.checkpoint` (the store) and :mod:`ringray.train.checkpoint_errors` (what can
go wrong) both speak of checkpoints by reference; the reference lives here so neither imports
the other's module for it.
"""

from __future__ import annotations

from dataclasses import dataclass

LEGACY_LINEAGE = "legacy"  # checkpoints committed before lineages (marker format 1)


@dataclass(frozen=True)
class CheckpointRef:
    """One committed checkpoint."""

    step: int
    location: str  # its directory (path or URL)
    lineage: str = LEGACY_LINEAGE  # the run it belongs to
    committed_unix: float = 0.0
