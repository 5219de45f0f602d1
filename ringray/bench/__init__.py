"""Library code behind the thin ``ringray bench ...`` commands (and ``benchmarks/`` scripts).

- :mod:`~ringray.bench.ring`: ``ringray bench ring``, overlap, balance and work efficiency of
  ring attention on local gloo ranks.
- :mod:`~ringray.bench.kernel`: ``ringray bench kernel``, Triton kernels against SDPA.
- :mod:`~ringray.bench.train`: ``ringray bench train``, tokens/s, MFU, overlap per layout.
- :mod:`~ringray.bench.gloo_ranks`: start N local processes in one gloo group (the tests use
  it too).
- :mod:`~ringray.bench.parity`: ringray against transformers on a real checkpoint's weights,
  in one process and over rings (``benchmarks/real_model_parity.py``; the tests use it too).

No Ray here: the recovery benchmark, which needs a multi-node Ray cluster and Ray Train as
its baseline, is a script in ``benchmarks/`` (``benchmarks/recovery.py``).
"""
