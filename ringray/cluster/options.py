"""What the controller needs to know about a job beyond its training, as a frozen dataclass.

``ringray.config.JobSpec.cluster_options()`` builds it from the spec's ``cluster`` section;
inside ``ringray.cluster`` it is trusted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ClusterOptions:
    job_name: str
    cp: int
    dp_max: int  # the size the job asks for
    dp_min: int  # the smallest size it may shrink to instead of waiting
    accelerator: str = "cpu"  # "cpu" (gloo) or "gpu" (NCCL, one GPU per worker)
    worker_resources: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    max_failures: int = 3  # faults recovered before the job fails (preemptions not counted)
    step_timeout_seconds: float = 300.0  # no step finished for this long: a hang
    startup_timeout_seconds: float = 120.0  # placement group, process groups and trainers up
    capacity_wait_seconds: float = 600.0  # wait this long for dp_min's capacity, then fail
    grow_after_seconds: float = 10.0  # larger capacity must be live this long before growing
    failure_domain: str | None = "zone"  # node label that DP replicas are spread over
    request_resources: bool = True  # ask the autoscaler for the full size when short of it
    poll_seconds: float = 0.5  # how often node liveness and drains are checked
    intra_node_gbps: float | None = None  # link figures for the placement's cost summary
    inter_node_gbps: float | None = None
    metrics_address: str = "127.0.0.1"  # where the controller serves /metrics
    metrics_port: int | None = None  # None: no endpoint; 0: any free port

    @property
    def process_group_backend(self) -> str:
        return "nccl" if self.accelerator == "gpu" else "gloo"

    def actor_resources(self) -> dict:
        """``ray.remote`` options for one worker: its CPUs, GPUs and custom resources."""
        custom = {k: v for k, v in self.worker_resources.items() if k not in ("CPU", "GPU")}
        return {
            "num_cpus": self.worker_resources.get("CPU", 0),
            "num_gpus": self.worker_resources.get("GPU", 0),
            "resources": custom,
        }
