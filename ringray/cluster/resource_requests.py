"""The autoscaler's standing request, shared by every job on a cluster.

    requests = resource_requests()                 # the cluster's one ledger (a named actor)
    requests.set.remote("job-a", [{"CPU": 1}] * 8)  # this job's full size
    requests.withdraw.remote("job-a")              # when it ends

Ray's ``request_resources`` is cluster-global and each call replaces the previous request, so a
job that asked for its full size and then withdrew (``request_resources([])``) would cancel
every other job's request too. Jobs therefore never call it themselves: a small detached actor,
``ringray-resource-requests`` in the ``ringray`` namespace, keeps each live job's bundles and
asks the autoscaler for their sum whenever one changes.
"""

from __future__ import annotations

import ray

from ringray.cluster.nodes import HEAD_NODE_RESOURCE

ACTOR_NAME = "ringray-resource-requests"
NAMESPACE = "ringray"
Bundle = dict[str, float]  # one worker's resources, as Ray takes them
# Ray's built-in resource on the head node: a sliver of it pins the ledger there, beside the
# controllers, so a worker node's death never takes it down.


class ResourceRequests:
    """The ledger (the actor class): each job's bundles, their sum sent to the autoscaler."""

    def __init__(self) -> None:
        self.by_job: dict[str, list[Bundle]] = {}

    def set(self, job: str, bundles: list[Bundle]) -> None:
        """``job`` wants ``bundles`` (replacing what it asked for before)."""
        self.by_job[job] = list(bundles)
        self._send()

    def withdraw(self, job: str) -> None:
        """``job`` wants nothing any more (it ended); the others' requests stand."""
        if self.by_job.pop(job, None) is not None:
            self._send()

    def current(self) -> dict[str, list[Bundle]]:
        return dict(self.by_job)

    def _send(self) -> None:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[b for bundles in self.by_job.values() for b in bundles])


def resource_requests():
    """The cluster's ledger (created on first use; every job shares it)."""
    return ray.remote(ResourceRequests).options(
        name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote()
