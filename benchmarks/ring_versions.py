"""One ``ringray bench ring --documents stdlib`` measurement as JSON lines, for comparing code
versions side by side (issue 27): run it once per version with that version first on the
path, interleaving the versions, on a quiet machine.

    git archive a099feb | tar -x -C /tmp/a099feb
    PYTHONPATH=/tmp/a099feb python benchmarks/ring_versions.py 4 16384 balanced
    PYTHONPATH=$PWD python benchmarks/ring_versions.py 4 16384 balanced,whole

Arguments: ranks, sequence length, comma-separated layouts. Prints one JSON object per
layout (:class:`ringray.bench.ring.LayoutResult` without its per-rank rows) and the elapsed
seconds on stderr. Uses only ``run_ring_bench`` and ``RingBenchConfig``, which every version
since the ring benchmark has, so older commits run it unchanged.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict


def main() -> None:
    from ringray.bench.ring import RingBenchConfig, run_ring_bench

    world, seq, layouts = int(sys.argv[1]), int(sys.argv[2]), tuple(sys.argv[3].split(","))
    start = time.time()
    results = run_ring_bench(RingBenchConfig(world=world, seq=seq, heads=8, kv_heads=2,
                                             head_dim=64, layouts=layouts, documents="stdlib",
                                             iters=2))
    for result in results:
        row = asdict(result)
        row.pop("ranks", None)
        print(json.dumps(row))
    print("elapsed", time.time() - start, file=sys.stderr)


if __name__ == "__main__":
    main()
