"""NCCL set up as the field does: the default group bound to the rank's device, the ring's
group on a high-priority stream.

- :func:`~ringray.attention.groups.init_kwargs` gives ``init_process_group`` the rank's CUDA
  device (``device_id``: the communicator is made eagerly and subgroups are split from it)
  for NCCL, and nothing for gloo; and the three places that make a default group (the Ray
  worker's ``join``, ``python -m ringray.train`` under torchrun, ``python -m
  ringray.harness``) pass it, with the device they made current.
- The mesh's groups (:func:`~ringray.train.mesh.mesh_options`) carry the default group's
  timeout everywhere and NCCL's high-priority stream on the ring's dimension alone; built into
  the backend's options, the flag and the timeout are there (the NCCL options need a CUDA
  build: a ``gpu`` test).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringray.attention.groups import (
    RING_DIM,
    GroupOptions,
    init_kwargs,
    mesh_group_options,
    mesh_override,
)
from ringray.train.mesh import MESH_DIMS, mesh_options

TIMEOUT = timedelta(seconds=42)


def test_nccl_gets_the_device_and_gloo_nothing() -> None:
    device = torch.device("cuda", 3)
    assert init_kwargs("nccl", device) == {"device_id": device}
    assert init_kwargs("gloo", device) == {}
    assert init_kwargs("gloo", None) == {}


@pytest.mark.parametrize("device", [None, torch.device("cpu"), torch.device("cuda")])
def test_nccl_without_an_indexed_cuda_device_is_refused(device) -> None:
    with pytest.raises(ValueError, match="^device: NCCL needs this rank's CUDA device"):
        init_kwargs("nccl", device)


class _Joined(Exception):
    pass


@pytest.fixture
def joins(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """Every ``init_process_group`` call as ``(backend, keyword arguments)``; the call
    raises :class:`_Joined` to end the caller there. CUDA's current device is not touched."""
    calls: list[tuple[str, dict]] = []

    def init_process_group(backend, **kwargs):
        calls.append((backend, kwargs))
        raise _Joined

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    return calls


@pytest.mark.parametrize("on_gpu", [True, False])
def test_torchrun_binds_the_group_to_local_rank_device(joins, monkeypatch, on_gpu) -> None:
    import ringray.train.__main__ as entry

    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(_Joined):
        entry._init_distributed(60.0)
    backend, kwargs = joins.pop()
    if on_gpu:
        assert backend == "nccl" and kwargs["device_id"] == torch.device("cuda", 1)
    else:
        assert backend == "gloo" and "device_id" not in kwargs
    assert kwargs["timeout"] == timedelta(seconds=60)


@pytest.mark.parametrize("on_gpu", [True, False])
def test_torchrun_switches_the_flight_recorder_on_before_it_joins(joins, monkeypatch, tmp_path,
                                                                  on_gpu) -> None:
    """Under torchrun the entry point sets torch's flight recorder variables before the group
    is made (torch reads them then): the recorder's size always; with NCCL its dump on a
    collective timeout, into RUN/flight-recorder/torchrun/. A variable the user set wins."""
    import os

    import ringray.train.__main__ as entry

    environ = {name: value for name, value in os.environ.items()
               if not name.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    environ.update(WORLD_SIZE="2", LOCAL_RANK="0", TORCH_NCCL_ENABLE_MONITORING="0")
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    with pytest.raises(_Joined):
        entry._init_distributed(60.0, str(tmp_path))
    assert environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    directory = tmp_path / "flight-recorder" / "torchrun"
    if on_gpu:
        assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(directory / "nccl_rank_")
        assert directory.is_dir()
    else:
        assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ and not directory.exists()
    assert environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"  # the user's own setting


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_the_harness_binds_its_ranks_to_their_devices(joins, monkeypatch, backend) -> None:
    from ringray.harness.launch import run_rank

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(_Joined):
        run_rank(3, 4, [], init_method="tcp://127.0.0.1:1", backend=backend)
    got, kwargs = joins.pop()
    assert got == backend
    if backend == "nccl":
        assert kwargs["device_id"] == torch.device("cuda", 1)  # rank 3 of 2 GPUs
    else:
        assert "device_id" not in kwargs


@pytest.mark.parametrize("backend,cuda_device", [("nccl", 2), ("gloo", None)])
def test_a_ray_worker_joins_on_its_own_device(joins, backend, cuda_device) -> None:
    from ringray.cluster.worker import TrainWorker

    worker = TrainWorker.__new__(TrainWorker)  # no actor, no process-wide allocator setting
    worker.rank, worker.world_size = 1, 4
    worker._busy_since, worker._cuda_device = None, cuda_device
    with pytest.raises(_Joined):
        worker.join(host="127.0.0.1", port=1, backend=backend, timeout_seconds=30)
    got, kwargs = joins.pop()
    assert got == backend and kwargs["timeout"] == timedelta(seconds=30)
    if cuda_device is not None:
        assert kwargs["device_id"] == torch.device("cuda", cuda_device)
    else:
        assert "device_id" not in kwargs


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_only_the_ring_dimension_gets_the_high_priority_stream(backend) -> None:
    options = mesh_options(TIMEOUT, backend)
    assert set(options) == set(MESH_DIMS)
    assert {dim: o.high_priority_stream for dim, o in options.items()} == {
        "dp": False, RING_DIM: True, "ulysses": False}
    assert all(o.timeout == TIMEOUT and o.backend == backend for o in options.values())


def test_a_simulation_has_no_options_and_unknown_dimensions_are_refused() -> None:
    assert mesh_options(None, "gloo") is None
    assert mesh_override(None) is None
    with pytest.raises(ValueError, match=r"^high_priority: \['cp'\] are not dimensions"):
        mesh_group_options(MESH_DIMS, TIMEOUT, "gloo", high_priority=("cp",))
    with pytest.raises(ValueError, match="^backend: 'mpi' is not one ringray makes groups"):
        GroupOptions(backend="mpi", timeout=TIMEOUT)


def test_gloo_options_carry_the_timeout() -> None:
    override = mesh_override(mesh_options(TIMEOUT, "gloo"))
    for dim in MESH_DIMS:
        backend, options = override[dim]
        assert backend == "gloo" and options._timeout == TIMEOUT


@pytest.mark.gpu
def test_nccl_options_carry_the_flag_and_the_timeout() -> None:
    assert dist.is_nccl_available()
    override = mesh_override(mesh_options(TIMEOUT, "nccl"))
    for dim in MESH_DIMS:
        backend, options = override[dim]
        assert backend == "nccl" and isinstance(options, dist.ProcessGroupNCCL.Options)
        assert options.is_high_priority_stream == (dim == RING_DIM)
        assert options._timeout == TIMEOUT
