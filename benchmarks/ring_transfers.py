"""Bytes a ring call sends under a mask, against the plain ring (issue 27): from the plans.

    python benchmarks/ring_transfers.py                    # the table in benchmarks/RESULTS.md
    python benchmarks/ring_transfers.py --seqs 16384 --worlds 4

For each document mix (``ringray bench ring --documents`` specs), sliding window, ring size,
sequence length and layout, the transfer plan (:mod:`ringray.attention.transfers`) gives
what every rank sends in one forward + backward: the rows of its K/V block that each reader
reads (bf16 unless ``--kv-bytes 4``) and those rows of the float32 dK/dV sums it returns.
The plain ring sends N - 1 whole K/V blocks forward and N - 1 whole K/V blocks and N - 1
whole dK/dV sums backward per rank. "blocks only" is what the plan would send if every
message carried its whole block (the plan before row-level sends). Each layout's work
imbalance under the mask (max ÷ mean of its ranks' visible query-key pairs) is beside it.
No process is started: the figures are the plan's, which is what the ring sends
(``tests/test_ring_documents.py`` and ``tests/test_ring_window.py`` check each rank's
``RingStats`` against the plan). Only the K/V element's size against the float32 dK/dV's
matters (``--kv-bytes``).
"""

from __future__ import annotations

import argparse

from ringray.attention import block_work, make_layout
from ringray.attention.documents import check_documents
from ringray.attention.transfers import plan_transfers
from ringray.bench.ring import document_lengths

DKV_BYTES = 4  # per element: dK/dV sums travel in float32


def sent_ratio(layout_name: str, world: int, seq: int, documents: list[int] | None,
               window: int | None, kv_bytes: int = 2) -> dict[str, float]:
    """Bytes sent ÷ the plain ring's (``total``; ``worst``: the rank that sends most, against
    its plain-ring bytes; ``blocks``: whole blocks per message), rounds and the layout's work
    imbalance, for one configuration."""
    layout = make_layout(layout_name, world, seq, documents=documents)
    docs = check_documents(documents, seq)
    plan = plan_transfers(layout, True, docs, window)
    per_rank, blocks = [], 0
    for rank in range(world):
        counts = plan.counts(rank)
        per_rank.append(counts.bytes_sent(kv_bytes, DKV_BYTES))
        blocks += counts.block_rows * ((counts.forward_kv + counts.backward_kv) * kv_bytes
                                       + counts.backward_dkv * DKV_BYTES)
    ring = plan.counts(0).ring_bytes(kv_bytes, DKV_BYTES)
    work = [sum(row) for row in block_work(layout, docs, causal=True, window=window)]
    return {"total": sum(per_rank) / (ring * world), "worst": max(per_rank) / ring,
            "blocks": blocks / (ring * world), "rounds": len(plan.rounds),
            "imbalance": max(work) / (sum(work) / world)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--seqs", default="16384,65536")
    parser.add_argument("--documents", default="stdlib,lognormal:512,lognormal:1024:2")
    parser.add_argument("--layouts", default="contiguous,zigzag,balanced,whole")
    parser.add_argument("--windows", default="1024,4096", help="windows, on one sequence")
    parser.add_argument("--kv-bytes", type=int, default=2,
                        help="bytes per K/V element: 2 (bf16, the default) or 4 (float32)")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    seqs = [int(s) for s in args.seqs.split(",")]
    print("| mask | N | S | layout | bytes sent / plain ring | worst rank | blocks only "
          "| rounds | work imbalance |")
    print("|---|---|---|---|---|---|---|---|---|")
    masks = [(spec, None) for spec in args.documents.split(",") if spec]
    masks += [(None, int(w)) for w in args.windows.split(",") if w]
    for spec, window in masks:
        for seq in seqs:
            documents = document_lengths(spec, seq) if spec else None
            for world in worlds:
                for name in args.layouts.split(","):
                    if name in ("balanced", "whole") and documents is None:
                        continue  # without documents they are zigzag
                    r = sent_ratio(name, world, seq, documents, window, args.kv_bytes)
                    mask = f"documents {spec}" if spec else f"window {window}"
                    print(f"| {mask} | {world} | {seq} | {name} | {r['total']:.1%} "
                          f"| {r['worst']:.1%} | {r['blocks']:.1%} | {r['rounds']} "
                          f"| {r['imbalance']:.3f} |")

if __name__ == "__main__":
    main()
