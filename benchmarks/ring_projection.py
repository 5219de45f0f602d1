"""A projection of masked ring attention to 8 × H100 (one node, NVLink) and 64 × H100 (8 nodes,
400 Gb/s InfiniBand per GPU) from the step plans the ring runs (issue 27). Not a measurement.

    python benchmarks/ring_projection.py                  # the table in benchmarks/RESULTS.md
    python benchmarks/ring_projection.py --efficiency 0.5 --tokens-per-gpu 16384

For each cluster, mask (a document mix, or a sliding window over one document) and layout,
one attention layer's ring (forward + backward) is walked rank by rank with
:func:`ringray.capacity.masked.masked_ring`: each planned step takes the larger of its
compute (visible query-key pairs × 4 e h FLOPs, 2.5× backward, at ``--efficiency`` × the
accelerator table's dense bf16 peak) and its transfer (the rows it sends or receives, the
busier way, at the ring link's rate from the same table); the layer takes its slowest
rank's sum. "plain ring" relays whole blocks N − 1 times (:func:`~ringray.capacity.masked.
plain_ring`), computing only visible pairs, as the varlen ring kernels of our peers do: over
zigzag, and over ``balanced``, which spreads the heavy documents over every rank as
ring-flash-attention's varlen zigzag spreads every document. Useful TFLOP/s per GPU = the
mask's visible pairs' FLOPs ÷ GPUs ÷ the layer's time. Attention shape: 32 query and 8 kv
heads of 128 (Llama 3 8B), bf16 K/V, one sequence per ring.
"""

from __future__ import annotations

import argparse

from ringray.accelerators import parse_cluster
from ringray.attention import make_layout
from ringray.capacity.masked import RingShape, masked_ring, plain_ring
from ringray.data.mixes import document_lengths

CLUSTERS = (("1x8xH100", 8), ("8x8xH100", 64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-gpu", type=int, default=8192)
    parser.add_argument("--efficiency", type=float, default=1.0,
                        help="attention kernel's share of the dense bf16 peak (1: peak)")
    parser.add_argument("--documents", default="stdlib,lognormal:512,lognormal:1024:2")
    parser.add_argument("--windows", default="4096")
    args = parser.parse_args()
    print("| cluster | link | S | mask | transfers | layout | ms per layer | exposed ms "
          "| bytes / plain ring | useful TFLOP/s per GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, world in CLUSTERS:
        cluster = parse_cluster(name)
        link, rate = cluster.ring_link(world)
        shape = RingShape(q_heads=32, kv_heads=8, head_dim=128,
                          peak_flops=cluster.accelerator.peak_flops * args.efficiency,
                          link_bytes_per_second=rate)
        seq = args.tokens_per_gpu * world
        masks = [(f"documents {spec}", document_lengths(spec, seq), None)
                 for spec in args.documents.split(",") if spec]
        masks += [(f"window {w}", None, int(w)) for w in args.windows.split(",") if w]
        for label, documents, window in masks:
            runs = [("plain ring", "zigzag", plain_ring), ("ringray", "zigzag", masked_ring)]
            if documents is not None:
                runs += [("plain ring", "balanced", plain_ring),
                         ("ringray", "balanced", masked_ring), ("ringray", "whole", masked_ring)]
            else:
                runs += [("ringray", "contiguous", masked_ring)]
            for transfers, layout_name, walk in runs:
                layout = make_layout(layout_name, world, seq, documents=documents)
                ring = walk(layout, documents, window, shape)
                print(f"| {name} | {link} | {seq} | {label} | {transfers} | {layout_name} "
                      f"| {ring.seconds * 1e3:.2f} | {ring.exposed_seconds * 1e3:.2f} "
                      f"| {ring.bytes_fraction:.1%} "
                      f"| {ring.flops_per_device(world) / 1e12 * 1:.0f} |")


if __name__ == "__main__":
    main()
