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
