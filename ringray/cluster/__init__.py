"""The Ray service: the only package that imports Ray.

    from ringray.cluster import ClusterOptions, connect, start_controller, follow

- :mod:`~ringray.cluster.placement`: where ranks go (pure).
- :mod:`~ringray.cluster.policy`: what to do on failures, drains and capacity changes (pure).
- :mod:`~ringray.cluster.worker`: the actor that owns one accelerator and wraps a Trainer.
- :mod:`~ringray.cluster.controller`: the per-job state machine that carries decisions out.
- :mod:`~ringray.cluster.launch`: the driver side: start or reattach, follow progress.
"""
