"""The ring's work apart from the machine (issue 38): each rank of a ring run alone, in this
process, against one process's SDPA per document, side by side.

    python benchmarks/ring_work.py                        # the table in benchmarks/RESULTS.md
    python benchmarks/ring_work.py --world 8 --layouts whole --transfers mask

``ringray bench ring`` reports work efficiency from N gloo processes computing at once, with
the one-process reference measured alone before them; on a shared machine (2 cores here, and
other tenants) how much slower N busy processes run than one is part of that figure, and it
changes from hour to hour. This script takes the machine out: every rank of the ring is run
by this one process, one thread, one rank after another, over PyTorch's ``fake`` process
group (``ringray.bench.simulate`` uses the same backend): the rank's real plan, its kernel
calls and merges, its row gathers, with nothing sent (received blocks stay zero, which changes
no kernel's time). Each repetition runs the reference and then every rank, so that what else
runs on the machine falls on both sides alike; the fastest repetition of each is kept.

Per layout and transfer mode it prints: the kernel calls of the busiest rank and of all ranks
(forward + backward, counted on the backend), the ranks' compute seconds as
:class:`~ringray.attention.RingStats` records them (the windows ``ringray bench ring`` sums),
the whole calls' CPU seconds (planning look-ups and the row gathers of row-level sends
included), and both against the reference: ``work eff.`` = the ranks' compute ÷ one process's
SDPA per document, ``call eff.`` = the ranks' whole calls ÷ the same.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringray.attention import RingStats, make_layout, ring_attention
from ringray.attention.backends.sdpa import SdpaBackend
from ringray.bench.ring import document_lengths


def reference_seconds(q, k, v, dout, documents: list[int]) -> float:
    """CPU seconds of SDPA forward + backward, one call per document (the benchmark's ideal)."""
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    bounds = [0, *itertools.accumulate(documents)]
    start = time.process_time()
    out = torch.cat([F.scaled_dot_product_attention(
        qg[:, s:e].transpose(1, 2), kg[:, s:e].transpose(1, 2), vg[:, s:e].transpose(1, 2),
        is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
        for s, e in itertools.pairwise(bounds)], dim=2)
    out.backward(dout.transpose(1, 2))
    return time.process_time() - start


def rank_call(layout, rank: int, world: int, tensors, documents: list[int],
              transfers: str, calls: Counter) -> tuple[float, float, int]:
    """One forward + backward of ``rank``'s ring call over the fake backend: the compute
    seconds its RingStats record, the CPU seconds of the whole call and its kernel calls."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        q, k, v, dout = (layout.shard(t, rank) for t in tensors)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        stats = RingStats()
        before = calls.total()
        start = time.process_time()
        out = ring_attention(qg, kg, vg, layout=layout, backend="sdpa", stats=stats,
                             documents=documents, transfers=transfers)
        out.backward(dout)
        call = time.process_time() - start
        return stats.totals().compute_seconds, call, calls.total() - before
    finally:
        dist.destroy_process_group()


def count_kernel_calls(calls: Counter) -> None:
    """Count the sdpa backend's calls (one per planned piece) into ``calls``."""
    for name in ("forward", "backward"):
        original = getattr(SdpaBackend, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        setattr(SdpaBackend, name, counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--documents", default="stdlib")
    parser.add_argument("--layouts", default="balanced,whole,zigzag")
    parser.add_argument("--transfers", default="all,mask")
    parser.add_argument("--repeats", type=int, default=3, help="kept: the fastest of each")
    args = parser.parse_args()

    torch.set_num_threads(1)  # as ringray bench ring's ranks and reference
    g = torch.Generator().manual_seed(0)
    shape_q = (1, args.seq, args.heads, args.head_dim)
    shape_kv = (1, args.seq, args.kv_heads, args.head_dim)
    tensors = (torch.randn(*shape_q, generator=g), torch.randn(*shape_kv, generator=g),
               torch.randn(*shape_kv, generator=g), torch.randn(*shape_q, generator=g))
    documents = document_lengths(args.documents, args.seq)
    calls: Counter = Counter()
    count_kernel_calls(calls)
    runs = [(name, mode) for name in args.layouts.split(",") for mode in args.transfers.split(",")]
    layouts = {name: make_layout(name, args.world, args.seq, documents=documents)
               for name, _ in runs}
    reference = float("inf")
    best: dict[tuple[str, str, int], tuple[float, float]] = {}
    kernel_calls: dict[tuple[str, str, int], int] = {}
    for repeat in range(args.repeats + 1):  # the first fills the plans' caches: not kept
        seconds = reference_seconds(*tensors, documents)
        reference = min(reference, seconds) if repeat else reference
        for name, mode in runs:
            for rank in range(args.world):
                key = (name, mode, rank)
                compute, call, kernel_calls[key] = rank_call(
                    layouts[name], rank, args.world, tensors, documents, mode, calls)
                if repeat:
                    old = best.get(key, (float("inf"), float("inf")))
                    best[key] = (min(old[0], compute), min(old[1], call))

    print(f"{args.world} ranks, one at a time in one process (fake process group, 1 thread), "
          f"seq {args.seq}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"documents {args.documents}; fastest of {args.repeats}; one process's SDPA per "
          f"document {reference:.3f} s")
    print("| layout | transfers | kernel calls (busiest rank / all) | compute s (ranks) "
          "| work eff. | call eff. |")
    print("|---|---|---|---|---|---|")
    for name, mode in runs:
        compute = [best[(name, mode, r)][0] for r in range(args.world)]
        call = [best[(name, mode, r)][1] for r in range(args.world)]
        counts = [kernel_calls[(name, mode, r)] for r in range(args.world)]
        print(f"| {name} | {mode} | {max(counts)} / {sum(counts)} | "
              f"{' '.join(f'{c:.3f}' for c in compute)} | {sum(compute) / reference:.3f} | "
              f"{sum(call) / reference:.3f} |")


if __name__ == "__main__":
    main()
