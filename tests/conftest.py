import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (on CPU tensors). It must be
# chosen before any kernel is decorated, so here, before test modules import them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

# Ray test clusters (facts found with Ray 2.60): without this, loopback addresses are rewritten
# and connections hang; and token authentication writes a token file that later clusters
# reject. Both must be set before Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="module")
def local_cluster():
    """A local multi-node Ray cluster (:class:`ray_cluster.LocalCluster`) for one test module,
    shut down after it; tests add and remove nodes on it."""
    from ray_cluster import LocalCluster  # Ray is imported only by the modules that use it

    cluster = LocalCluster()
    try:
        yield cluster
    finally:
        cluster.shutdown()
