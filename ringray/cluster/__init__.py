"""The Ray service: the only package that imports Ray.

    from ringray.cluster import JobOptions, connect, start_controller, follow

    connect(None, local_cpus=4)                       # an embedded local Ray
    controller, reattached = start_controller(job)    # job: a JobOptions
    final = follow(controller, on_status=print)       # a JobStatus once the job has ended

- :mod:`~ringray.cluster.job_options`: what a job asks of the service (no Ray).
- :mod:`~ringray.cluster.placement`: where ranks go (pure).
- :mod:`~ringray.cluster.policy`: what to do on failures, drains and capacity changes (pure).
- :mod:`~ringray.cluster.status`: what a controller reports (plain dataclasses, no Ray).
- :mod:`~ringray.cluster.worker`: the actor that owns one accelerator and wraps a Trainer.
- :mod:`~ringray.cluster.watch`: waits on the workers and classifies what goes wrong.
- :mod:`~ringray.cluster.controller`: the per-job state machine that carries decisions out.
- :mod:`~ringray.cluster.driver`: the driver side: connect, start or reattach, follow.
- :mod:`~ringray.cluster.jobs`: jobs on a remote cluster through the Ray Jobs API.

The names below are loaded on first use, so that importing the Ray-free modules
(``job_options``, ``placement``, ``policy``, ``status``) does not import Ray.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ClusterOptions": "ringray.cluster.job_options",
    "JobOptions": "ringray.cluster.job_options",
    "JobState": "ringray.cluster.status",
    "JobStatus": "ringray.cluster.status",
    "connect": "ringray.cluster.driver",
    "follow": "ringray.cluster.driver",
    "job_status": "ringray.cluster.driver",
    "release": "ringray.cluster.driver",
    "request_stop": "ringray.cluster.driver",
    "start_controller": "ringray.cluster.driver",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ringray.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
