"""Bytes a ring call sends under a mask, against the plain ring (issue 27): from the plans.

    python benchmarks/ring_transfers.py                    # the table in benchmarks/RESULTS.md
    python benchmarks/ring_transfers.py --seqs 16384 --worlds 4

For each document mix (``ringray bench ring --documents`` specs), sliding window, ring size,
sequence length and layout, the transfer plan (:mod:`ringray.attention.transfers`) gives
what every rank sends in one forward + backward: K/V blocks (bf16 unless ``--kv-bytes 4``)
and float32 dK/dV sums. The plain ring sends N - 1 K/V blocks forward and N - 1 K/V blocks
and N - 1 dK/dV sums backward per rank. No process is started: the figures are the plan's,
which is what the ring sends (``tests/test_ring_documents.py`` and
``tests/test_ring_window.py`` check each rank's ``RingStats`` against the plan). A block's
size cancels out of the ratio; only the K/V element's size against the float32 dK/dV's
matters (``--kv-bytes``).
"""

from __future__ import annotations

import argparse

from ringray.attention import make_layout
from ringray.attention.documents import check_documents
from ringray.attention.transfers import plan_transfers
from ringray.bench.ring import document_lengths

DKV_BYTES = 4  # per element: dK/dV sums travel in float32


def sent_ratio(layout_name: str, world: int, seq: int, documents: list[int] | None,
               window: int | None, kv_bytes: int = 2) -> tuple[float, float, int]:
    """(bytes sent ÷ the plain ring's, largest rank's bytes ÷ the plain ring's per rank,
    rounds) for one configuration."""
    layout = make_layout(layout_name, world, seq, documents=documents)
    plan = plan_transfers(layout, True, check_documents(documents, seq), window)
    per_rank = []
    for rank in range(world):
        counts = plan.counts(rank)
        per_rank.append((counts.forward_kv + counts.backward_kv) * kv_bytes
                        + counts.backward_dkv * DKV_BYTES)
    ring = (world - 1) * (2 * kv_bytes + DKV_BYTES)
    return sum(per_rank) / (ring * world), max(per_rank) / ring, len(plan.rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--seqs", default="16384,65536")
    parser.add_argument("--documents", default="stdlib,lognormal:512")
    parser.add_argument("--layouts", default="contiguous,zigzag,balanced")
    parser.add_argument("--windows", default="1024,4096", help="windows, on one sequence")
    parser.add_argument("--kv-bytes", type=int, default=2,
                        help="bytes per K/V element: 2 (bf16, the default) or 4 (float32)")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    seqs = [int(s) for s in args.seqs.split(",")]
    print("| mask | N | S | layout | bytes sent / plain ring | worst rank | rounds |")
    print("|---|---|---|---|---|---|---|")
    masks = [(spec, None) for spec in args.documents.split(",")]
    masks += [(None, int(w)) for w in args.windows.split(",")]
    for spec, window in masks:
        for seq in seqs:
            documents = document_lengths(spec, seq) if spec else None
            for world in worlds:
                for name in args.layouts.split(","):
                    if name == "balanced" and documents is None:
                        continue  # without documents balanced is zigzag
                    total, worst, rounds = sent_ratio(name, world, seq, documents, window,
                                                      args.kv_bytes)
                    mask = f"documents {spec}" if spec else f"window {window}"
                    print(f"| {mask} | {world} | {seq} | {name} | {total:.1%} | {worst:.1%} "
                          f"| {rounds} |")


if __name__ == "__main__":
    main()
