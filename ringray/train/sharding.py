"""How weights and gradients are spread over the mesh: replicated, or sharded with FSDP2.

    if options.parallel.fsdp:
        shard_model(model, mesh.fsdp_mesh, param_dtype=torch.bfloat16)  # mesh: train.mesh
    ...  # forward, backward: FSDP's reduce-scatter sums the gradients
    else: all_reduce_gradients(model)                  # replicated: one all-reduce
    grad_norm = clip_gradients_(model.parameters(), max_norm)   # the global norm, either way

**Replicated** (``parallel.fsdp: false``): every rank holds the full float32 weights,
gradients and AdamW state; after the backward one all-reduce over the whole mesh sums the
gradients.

**FSDP** (``parallel.fsdp: true``): torchtitan's recipe. Every decoder block is one FSDP2
unit and the root (embedding, final norm, output projection; a tied embedding table is one
parameter, so it stays in this one unit) another, sharded over the *flattened* dp × cp mesh:
context-parallel ranks hold different tokens of the same sequences, so they need the same
weights exactly as data-parallel ranks do, and their per-token partial gradients are summed
by the same reduce-scatter. Ranks are numbered ``arange(world).view(dp, cp)``, so the
flattened mesh is simply the world in rank order; it is the job's device mesh flattened to
one dimension (:data:`ringray.train.mesh.FSDP_DIM`; a 2-D slice would make ``fully_shard``
replicate over the first dimension: HSDP).

**Exact gradients.** Each rank backpropagates its token sum divided by the *global* token
count, so the gradient is the plain sum over ranks. FSDP would divide by the world size (an
average); ``set_gradient_divide_factor(1.0)`` with ``set_force_sum_reduction_for_comms``
makes every reduction a plain SUM (no pre/post scaling, no PREMUL_SUM, which gloo lacks).

**Clipping** uses the norm over all shards: ``get_total_norm`` of DTensor gradients is a
DTensor, made a plain tensor (``full_tensor``) before it scales anything or is reported.

**Mixed precision.** With bf16, FSDP's ``MixedPrecisionPolicy`` gathers bf16 weights for
compute and reduces gradients in float32 into the float32 shards the optimizer updates (in
place of autocast, whose bf16 weight copies it makes unnecessary). Inputs are not cast at
the blocks' boundaries (``cast_forward_inputs=False``): the rotary tables stay float32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ringray.model import Transformer


def shard_model(model: Transformer, mesh: DeviceMesh, *,
                param_dtype: torch.dtype | None) -> list[FSDPModule]:
    """Apply FSDP2 in place: each block, then the root (bottom-up, as ``fully_shard`` needs);
    returns the units. ``param_dtype`` (e.g. bf16) is the dtype weights are gathered in,
    with float32 gradient reduction; ``None`` keeps float32 throughout.

    ``model`` may be on the ``meta`` device (what :func:`ringray.train.materialize.build_model`
    passes: each rank then materialises and fills only its shards), or hold the same full
    weights on every rank, each keeping its shard of them.
    """
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
        cast_forward_inputs=False,
    )
    units = [fully_shard(block, mesh=mesh, mp_policy=policy) for block in model.layers]
    units.append(fully_shard(model, mesh=mesh, mp_policy=policy))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # sum over ranks: the loss is already scaled
        unit.set_force_sum_reduction_for_comms(True)
    return units


def set_reduce_hook(model: nn.Module, hook: Callable[[torch.Tensor], None]) -> int:
    """Have FSDP call ``hook(reduced)`` inside the backward, on each unit of ``model`` right
    after its reduce-scatter: ``reduced`` is the unit's summed gradient shards, one flat
    buffer that its parameters' ``.grad`` then view (FSDP2's all-reduce hook, made for an
    all-reduce over replicas outside FSDP's own mesh). Returns how many units were hooked:
    0 for a model FSDP does not shard.

    The hook may start an asynchronous in-place reduction of ``reduced`` and return: with
    every reduction a plain float32 or bfloat16 SUM in the parameters' dtype
    (:func:`shard_model`), FSDP neither scales nor copies the buffer afterwards, and with
    the gradients set to ``None`` before each backward it adds nothing into it; the caller
    waits for the reductions before anything reads a gradient."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.set_all_reduce_hook(hook)
    return len(units)


def all_reduce_gradients(model: nn.Module) -> None:
    """Replicated weights: sum every gradient over the whole mesh, as one flat buffer (one
    collective)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_gradients_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm`` (``inf``:
    measure only); returns that norm before clipping, a plain scalar tensor on every rank.
    Works for replicated gradients and for FSDP's sharded (DTensor) ones alike."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):  # sharded gradients: the norm over every shard
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter or gradient, gathered if FSDP shards it (collective
    then: every rank calls it for the same tensors, in the same order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter, gradient or optimizer state: its shard under FSDP."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
