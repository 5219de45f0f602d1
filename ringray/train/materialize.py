"""This rank's model, made without any rank ever holding the whole of it.

    model = build_model(options.model, device=device, seed=options.train.seed,
                        fsdp_mesh=mesh.fsdp_mesh, param_dtype=torch.bfloat16)   # FSDP
    model = build_model(options.model, device=device, seed=0)                    # replicated
    model = build_model(cfg, device=device, seed=0, pretrained="ckpt/", fsdp_mesh=...)

Torchtitan's order: the :class:`~ringray.model.Transformer` is built on the ``meta`` device
(shapes, no storage), sharded with FSDP2 (``fully_shard`` works on meta modules,
:func:`ringray.train.sharding.shard_model`) or left whole (replicated), and only then
given storage with ``to_empty``: under FSDP, each parameter's local tensor is this rank's
rows of it (FSDP2 shards dim 0 the way ``torch.chunk`` does: ``ceil(rows / world)`` rows a
rank, the last ranks short or empty; :func:`owned_rows`). Those rows are then filled:

- **Fresh weights** (:func:`fill_initial_`): as :func:`ringray.model.llama.parameter_init`
  says (ones, zeros, or Normal(0, std)), where the normal draws are a function of the seed,
  the parameter's name and the element's index alone: a counter-based stream (numpy's
  PCG64, seeded from the seed and a hash of the name, advanced straight to the rank's first
  element; two uniform doubles per element through Box-Muller). A rank draws only its own
  rows, and every sharding (any dp × cp, replicated or FSDP) holds bit-identical weights, so
  CP = N still equals CP = 1 exactly (``tests/test_train_exact.py``,
  ``tests/test_train_fsdp.py``, ``tests/test_materialize.py``).
- **Pretrained weights** (:func:`fill_pretrained_`): after the header check
  (:func:`~ringray.model.check_hf_weights`), each rank reads from the safetensors files only
  the byte range of the rows it owns, tensor by tensor
  (:meth:`~ringray.model.SafetensorsCheckpoint.read` with ``rows``), as DCP's Hugging Face
  storage reader does for its shards.

A rank's host memory for its weights is then its shard plus one block of draws (at most
:data:`INIT_BLOCK_ELEMENTS` elements) or one tensor's rows read, never the full model.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ringray.model import (
    ModelConfig,
    SafetensorsCheckpoint,
    Transformer,
    all_finite,
    check_hf_weights,
    hf_parameter_names,
    nonfinite_tensor_message,
)
from ringray.model.llama import ActivationCheckpointing, parameter_init
from ringray.train.sharding import shard_model

INIT_BLOCK_ELEMENTS = 1 << 22
"""Elements drawn at a time by :func:`fill_initial_` (each costs two float64 uniforms and a
float64 normal while it is made: 96 MiB a block)."""


def build_model(
    cfg: ModelConfig, *, device: torch.device, seed: int,
    activation_checkpointing: ActivationCheckpointing = "none",
    fsdp_mesh: DeviceMesh | None = None, param_dtype: torch.dtype | None = None,
    pretrained: str | SafetensorsCheckpoint | None = None,
) -> Transformer:
    """A float32 model on ``device``: sharded over ``fsdp_mesh`` with FSDP2 (gathering
    weights in ``param_dtype``, see :func:`~ringray.train.sharding.shard_model`), or whole
    when it is ``None``; its weights fresh from ``seed`` or read from the Hugging Face
    checkpoint ``pretrained``, only this rank's rows of each either way.

    Raises:
        ValueError: one line naming the tensor, for a pretrained checkpoint that does not
            hold exactly this model's tensors and shapes (checked before any data is read).
    """
    if isinstance(pretrained, str):
        pretrained = SafetensorsCheckpoint(pretrained)
    if pretrained is not None:
        check_hf_weights(cfg, pretrained)
    with torch.device("meta"):
        model = Transformer(cfg, activation_checkpointing=activation_checkpointing)
    if fsdp_mesh is not None:
        shard_model(model, fsdp_mesh, param_dtype=param_dtype)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives a tied pair separate tensors (FSDP keeps them tied)
    if pretrained is None:
        fill_initial_(model, seed=seed)
    else:
        bad = fill_pretrained_(model, pretrained)
        if fsdp_mesh is not None:  # each rank read other rows: every rank raises alike
            bad = _first_on_any_rank(model, bad, fsdp_mesh)
        if bad is not None:
            raise ValueError(nonfinite_tensor_message(pretrained.root, bad))
    return model


def _first_on_any_rank(model: nn.Module, bad: str | None, mesh: DeviceMesh) -> str | None:
    """The first (in model order) checkpoint tensor any rank of ``mesh`` found non-finite:
    one all-reduce of one integer, so the check adds nothing to the build's peak."""
    names = list(hf_parameter_names(model.config).values())
    index = torch.tensor([names.index(bad) if bad is not None else len(names)])
    dist.all_reduce(index, op=dist.ReduceOp.MIN, group=mesh.get_group())
    return names[index.item()] if index.item() < len(names) else None


def owned_rows(param: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """The tensor this rank stores for ``param`` and the rows (of dim 0 of the whole
    parameter) it holds: all of them for a plain tensor; for FSDP2's ``Shard(0)`` DTensor
    over a 1-D mesh, its local tensor and the ``torch.chunk`` rows of this rank."""
    if not isinstance(param, DTensor):
        return param, slice(0, param.shape[0])
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(f"param: placements {param.placements} over a {param.device_mesh.ndim}"
                         f"-D mesh; expected FSDP2's (Shard(dim=0),) over a 1-D mesh")
    local, rows = param.to_local(), param.shape[0]
    per_rank = math.ceil(rows / param.device_mesh.size())
    start = min(param.device_mesh.get_local_rank() * per_rank, rows)
    stop = min(start + per_rank, rows)
    if local.shape[0] != stop - start:
        raise AssertionError(f"local shard of {local.shape[0]} rows, expected rows "
                             f"[{start}, {stop}) of {rows}")
    return local, slice(start, stop)


@torch.no_grad()
def fill_initial_(model: nn.Module, *, seed: int) -> None:
    """Fill this rank's rows of every parameter of ``model`` (a :class:`Transformer`, whole
    or FSDP-sharded) with their initial values, which depend on ``seed``, the parameter's
    name and each element's index only (see the module's docstring)."""
    cfg = model.config
    for name, param in model.named_parameters():
        local, rows = owned_rows(param)
        kind, value = parameter_init(name, cfg)
        if kind == "fill":
            local.fill_(value)
        else:
            _fill_normal_rows_(local, rows, std=value, stream=_stream_seed(seed, name))


def _stream_seed(seed: int, name: str) -> np.random.SeedSequence:
    """The seed of parameter ``name``'s stream: the job's seed and 128 bits of the name."""
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:16], "little")
    return np.random.SeedSequence([seed % 2**64, name_key])


def _fill_normal_rows_(local: torch.Tensor, rows: slice, *, std: float,
                       stream: np.random.SeedSequence) -> None:
    """``local`` (the whole parameter's ``rows``) := Normal(0, std) draws whose element ``i``
    of the whole parameter (row-major) comes from uniforms ``2i`` and ``2i + 1`` of the
    parameter's PCG64 stream, so a rank jumps to its first element instead of drawing the
    rows before it."""
    if local.numel() == 0:
        return
    row_elements = local[0].numel()
    bits = np.random.PCG64(stream)
    bits.advance(2 * rows.start * row_elements)  # each double takes one 64-bit draw
    uniforms = np.random.Generator(bits)
    flat = local.view(-1)
    for begin in range(0, flat.numel(), INIT_BLOCK_ELEMENTS):
        count = min(INIT_BLOCK_ELEMENTS, flat.numel() - begin)
        u = uniforms.random(2 * count).reshape(count, 2)
        radius = np.sqrt(-2.0 * np.log1p(-u[:, 0]))  # 1 - u in (0, 1]: the log is finite
        normal = radius * np.cos(2.0 * np.pi * u[:, 1]) * std
        flat[begin : begin + count].copy_(torch.from_numpy(normal))


@torch.no_grad()
def fill_pretrained_(model: nn.Module, checkpoint: SafetensorsCheckpoint) -> str | None:
    """Fill this rank's rows of every parameter of ``model`` (whole or FSDP-sharded) from a
    Hugging Face checkpoint, reading only those rows' bytes of each tensor (cast to the
    parameter's dtype). The caller has checked the checkpoint
    (:func:`~ringray.model.check_hf_weights`). Returns the checkpoint's name of the first
    tensor whose rows read here hold a NaN or an infinity, else ``None``."""
    hf_names = hf_parameter_names(model.config)
    bad = None
    for name, param in model.named_parameters():
        local, rows = owned_rows(param)
        if local.numel():
            local.copy_(checkpoint.read(hf_names[name], rows=rows))
            if bad is None and not all_finite(local):
                bad = hf_names[name]
    return bad
