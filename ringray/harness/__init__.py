"""lm-evaluation-harness (``lm_eval``) over ringray's ring: a registered ``ringray`` model.

    pip install 'ringray[eval]'
    python -m ringray.harness --cp 2 -- --model ringray \\
        --model_args pretrained=ckpt/,max_length=8192 --tasks hellaswag --limit 20

- :mod:`ringray.harness.options`: what ``--model_args`` may say (job-file names).
- :mod:`ringray.harness.ring`: one rank's model and its exact forward over the ring, and
  rank 0's lockstep with the others.
- :mod:`ringray.harness.lm`: :class:`RingLM`, lm_eval's ``ringray`` model (importing it
  registers the name; it needs lm_eval and transformers).
- :mod:`ringray.harness.launch`: the local multi-process launcher (also under torchrun).
- :mod:`ringray.harness.ruler`: RULER's tasks that run offline, and their data per length.
- :mod:`ringray.harness.evaluate`: one evaluation of tasks x lengths on rank 0 of a ring, its
  progress and its results (``ringray eval``).

Importing this package imports nothing else: the launcher's parent process needs no torch,
and the ranks that only serve forwards never load lm_eval.
"""

__all__ = ["HarnessOptions", "RingLM"]


def __getattr__(name: str):
    if name == "HarnessOptions":
        from ringray.harness.options import HarnessOptions

        return HarnessOptions
    if name == "RingLM":  # imports lm_eval and registers the model
        from ringray.harness.lm import RingLM

        return RingLM
    raise AttributeError(f"module 'ringray.harness' has no attribute {name!r}")
