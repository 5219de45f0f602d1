"""Triton ring-step kernels vs PyTorch SDPA (flash, cuDNN) on one CUDA GPU.

    python benchmarks/attention_kernels.py --seqs 4096,8192,16384 --heads 16 --kv-heads 8

The same benchmark as ``ringray bench kernel`` (flags and output are identical); the
measurement code lives in ``ringray/bench/kernel.py``. Forward and backward TFLOP/s
(causal FLOPs counted as half) and a single-GPU virtual ring against one SDPA call; with
``--sweep``, every candidate tile shape of each kernel. Without a GPU it runs the kernels'
correctness smoke in Triton's interpreter and says that speed needs a GPU.
"""

import sys

from ringray.cli import app

if __name__ == "__main__":
    app(["bench", "kernel", *sys.argv[1:]])
