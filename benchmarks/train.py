"""Training throughput, MFU, ring overlap and load imbalance of a job spec, per layout.

    python benchmarks/train.py                       # the quickstart spec, on this machine
    python benchmarks/train.py --gpu --seq 16384     # 1b preset on one CUDA device

The same benchmark as ``ringray bench train`` (flags and output are identical); the
measurement code lives in ``ringray/bench/train.py``.
"""

import sys

from ringray.cli import app

if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs the CLI
    app(["bench", "train", *sys.argv[1:]])
