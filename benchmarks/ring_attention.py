"""Ring attention overlap, balance and work efficiency on local gloo ranks.

    python benchmarks/ring_attention.py --world 4 --seq 16384 --heads 8 --kv-heads 2

The same benchmark as ``ringray bench ring`` (flags and output are identical); the
measurement code lives in ``ringray/bench/ring.py``.
"""

import sys

from ringray.cli import app

if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs the CLI
    app(["bench", "ring", *sys.argv[1:]])
