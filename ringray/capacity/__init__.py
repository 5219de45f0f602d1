"""Will a job fit its cluster, and can its ring hide communication? (``ringray plan``)

    cluster = parse_cluster("4x8xH100")              # ringray.accelerators; or custom_cluster
    spec = load_job_spec("jobs/llama-8b-1m-64xh100.yaml")
    report = plan_job(spec.train_options(), cluster, name=spec.name)
    print(report.format())                           # report.to_dict() for --json
    report.fits                                      # the verdict

Pure arithmetic over a job's training options (no devices, no tensors), one module per
question (:mod:`.inputs`, :mod:`.fit`, :mod:`.ulysses`, :mod:`.report`); everything is
imported from here:

- **Memory**: what one rank of this project's trainer holds, term by term, is
  :mod:`ringray.train.footprint` (weights, gradients and AdamW state, replicated or sharded
  by FSDP; activations per checkpointing mode; ring buffers; FSDP's gathered blocks; the
  peak over the step); :func:`memory_breakdown` puts it against a device, with NCCL's own
  buffers beside it (:mod:`.nccl`: the ring's point-to-point connections, the FSDP
  communicator, Ulysses' all-to-all), which PyTorch's allocator never sees.
- **Overlap**: :func:`overlap_threshold_tokens` (the ``c >= F/B`` rule, derived there).
- **Ulysses × ring** (``parallel.ulysses``): the all-to-alls' traffic
  (:func:`a2a_bytes_per_layer`) on a node's links against the ring's on its slowest link,
  the time each leaves exposed per step, and the Ulysses degree to use
  (:func:`ulysses_options`, :func:`recommend_ulysses`: the rule is there).
- **Before a start**: :func:`check_worker_memory` (:mod:`.workers`), whether one worker of a
  job fits its node's memory, which `ringray train` asks before it starts anything.

A planning margin (:data:`MEMORY_RESERVE_RATIO` of device memory) is kept for the CUDA
context, the default process group's NCCL communicator, kernel workspaces and allocator
fragmentation, which the terms above do not count. It is a judgement, not a measurement.
"""

from ringray.accelerators import (
    ACCELERATORS,
    GIB,
    Accelerator,
    ClusterShape,
    PlanError,
    custom_cluster,
    parse_cluster,
)
from ringray.capacity.fit import (
    MEMORY_RESERVE_RATIO,
    MemoryBreakdown,
    OverlapCheck,
    memory_breakdown,
    overlap_check,
    overlap_threshold_tokens,
    plan_footprint,
)
from ringray.capacity.inputs import PlanInputs
from ringray.capacity.nccl import (
    CommBuffers,
    NcclChannels,
    comm_buffers,
    nccl_channels,
    transfer_peers,
)
from ringray.capacity.report import PlanReport, plan, plan_job, recommend_cp
from ringray.capacity.ulysses import (
    ULYSSES_RULE,
    UlyssesOption,
    a2a_bytes_per_layer,
    a2a_link,
    recommend_ulysses,
    ulysses_options,
)
from ringray.capacity.workers import WorkerShare, check_worker_memory, runs_bf16
from ringray.train.footprint import (  # the formulas, re-exported for callers
    Footprint,
    activation_bytes_per_token,
    gathered_bytes,
    head_activation_bytes_per_token,
    kept_activation_bytes_per_token,
    kv_repeat,
    layer_activation_bytes_per_token,
    rank_footprint,
    recompute_bytes_per_token,
    ring_buffer_bytes_per_token,
)

__all__ = [
    "ACCELERATORS", "GIB", "MEMORY_RESERVE_RATIO", "ULYSSES_RULE", "Accelerator", "ClusterShape",
    "CommBuffers", "Footprint", "MemoryBreakdown", "NcclChannels", "OverlapCheck", "PlanError",
    "PlanInputs", "PlanReport", "UlyssesOption", "WorkerShare", "a2a_bytes_per_layer",
    "a2a_link", "activation_bytes_per_token", "check_worker_memory", "comm_buffers",
    "custom_cluster", "gathered_bytes",
    "head_activation_bytes_per_token", "kept_activation_bytes_per_token", "kv_repeat",
    "layer_activation_bytes_per_token",
    "memory_breakdown", "nccl_channels", "overlap_check", "overlap_threshold_tokens",
    "parse_cluster", "plan",
    "plan_footprint", "plan_job", "rank_footprint", "recommend_cp", "recommend_ulysses",
    "recompute_bytes_per_token", "ring_buffer_bytes_per_token", "runs_bf16", "transfer_peers",
    "ulysses_options",
]
