"""Exact attention over a sequence split across a ring of ranks (no Ray, no pydantic).

    from ringray.attention import ring_attention, make_layout, RingStats

    out = ring_attention(q, k, v, group, layout="balanced", documents=[5218, 227, 97, ...])

Ulysses × ring (head all-to-all inside a node, the ring across nodes):

    ring_group, ulysses_group = grid_groups(ulysses=8)
    out = ring_attention(q, k, v, ring_group, ulysses_group=ulysses_group, layout="zigzag")
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
from ringray.attention.stats import (
    AllToAllRecord,
    RingCallRecord,
    RingStats,
    RingStepRecord,
    RingTotals,
)
from ringray.attention.ulysses import check_ulysses_heads, grid_groups
from ringray.attention.validation import RingAgreement

__all__ = [
    "AllToAllRecord",
    "Documents",
    "Layout",
    "RingAgreement",
    "RingCallRecord",
    "RingStats",
    "RingStepRecord",
    "RingTotals",
    "block_work",
    "causal_work",
    "check_documents",
    "check_ulysses_heads",
    "document_work",
    "grid_groups",
    "make_layout",
    "merge",
    "ring_attention",
    "step_imbalance",
]
