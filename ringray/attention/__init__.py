"""Exact attention over a sequence split across a ring of ranks (no Ray, no pydantic).

    from ringray.attention import ring_attention, make_layout, RingStats

    out = ring_attention(q, k, v, group, layout="balanced", documents=[5218, 227, 97, ...])
"""

from ringray.attention.documents import Documents, check_documents
from ringray.attention.layouts import (
    Layout,
    block_work,
    causal_work,
    document_work,
    make_layout,
    step_imbalance,
)
from ringray.attention.merge import merge
from ringray.attention.ring import ring_attention
from ringray.attention.stats import RingStats, RingStepRecord, RingTotals

__all__ = [
    "Documents",
    "Layout",
    "RingStats",
    "RingStepRecord",
    "RingTotals",
    "block_work",
    "causal_work",
    "check_documents",
    "document_work",
    "make_layout",
    "merge",
    "ring_attention",
    "step_imbalance",
]
