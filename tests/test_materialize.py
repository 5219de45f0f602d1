"""A rank builds only its part of the model, and every sharding holds the same weights.

- Fresh weights: the rows a rank draws alone are bit for bit the rows of the whole
  parameter drawn at once (any row range, any block size); they follow each parameter's
  rule (ones, zeros, Normal(0, std) with the residual projections scaled).
- FSDP over 3 real gloo ranks (uneven shards: 32 rows over 3 ranks are 11, 11, 10), built
  on ``meta``: the gathered weights equal the replicated model's exactly (fresh, and loaded
  from Hugging Face checkpoints with tied embeddings and with q/k norms); each rank reads
  only its own rows of each tensor, the ranks' reads together cover each tensor once; and
  building allocates no more than the rank's shards.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from allocations import allocation_events
from distributed import run_gloo_ranks
from hf_cases import save_hf_case

import ringray.train.materialize as materialize
from ringray.model import (
    SafetensorsCheckpoint,
    load_pretrained,
    model_preset,
    read_model_config,
)
from ringray.train.materialize import _fill_normal_rows_, _stream_seed, build_model, owned_rows

CFG = model_preset("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
WORLD = 3
CPU = torch.device("cpu")


@pytest.mark.parametrize("block_elements", [5, 1 << 22])
def test_rows_drawn_alone_are_the_rows_of_the_whole(monkeypatch, block_elements: int) -> None:
    """Rows [start, stop) drawn on their own (as a rank draws its shard) equal the same rows
    of the whole parameter drawn at once, bit for bit, for every split and block size."""
    monkeypatch.setattr(materialize, "INIT_BLOCK_ELEMENTS", block_elements)
    stream = _stream_seed(7, "layers.0.attention.wq.weight")
    whole = torch.empty(10, 7)
    _fill_normal_rows_(whole, slice(0, 10), std=0.02, stream=stream)
    for start, stop in [(0, 4), (4, 8), (8, 10), (3, 4), (9, 10), (5, 5)]:
        part = torch.empty(stop - start, 7)
        _fill_normal_rows_(part, slice(start, stop), std=0.02, stream=stream)
        assert torch.equal(part, whole[start:stop]), (start, stop)


def test_fresh_weights_follow_each_parameters_rule() -> None:
    """Norm gains are 1; weights are Normal(0, init_std), the residual projections (wo, w2)
    Normal(0, init_std / sqrt(2 n_layers)): the sample mean and standard deviation of every
    matrix within 5 standard errors of those; another seed or another name draws other
    values."""
    model = build_model(CFG, device=CPU, seed=0)
    for name, param in model.named_parameters():
        values = param.detach().double()
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        std = CFG.init_std / (math.sqrt(2 * CFG.n_layers)
                              if name.endswith(("wo.weight", "w2.weight")) else 1.0)
        n = values.numel()
        assert abs(values.mean().item()) < 5 * std / math.sqrt(n), name
        assert abs(values.std().item() - std) < 5 * std / math.sqrt(2 * n), name
    other = build_model(CFG, device=CPU, seed=1)
    assert not torch.equal(other.tok_embeddings.weight, model.tok_embeddings.weight)
    wq, wk = model.layers[0].attention.wq.weight, model.layers[0].attention.wk.weight
    assert not torch.equal(wq[: wk.shape[0]], wk)


def test_replicated_rows_are_the_whole_parameter() -> None:
    model = build_model(CFG, device=CPU, seed=0)
    local, rows = owned_rows(model.tok_embeddings.weight)
    assert local is model.tok_embeddings.weight and rows == slice(0, CFG.vocab_size)


def _torch_peak_bytes(fn) -> tuple[object, int]:
    """``fn()`` and the most bytes torch's CPU allocator held at once while it ran, above
    what it held before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = allocation_events(prof)
    _, first_size, first_total = events[0]
    return result, max(total for _, _, total in events) - (first_total - first_size)


def rank_build_sharded(rank: int, world: int, sources: list[str | None]) -> list[dict]:
    """For each source (``None``: fresh weights, seed 0): build the FSDP model, record the
    rows each read asked for, the allocator's peak while building, this rank's local
    bytes, and the gathered full weights."""
    from ringray.train.mesh import build_mesh, resolve_mesh_shape
    from ringray.train.sharding import full_tensor

    mesh = build_mesh(resolve_mesh_shape(world_size=world, dp=1, cp=world), device_type="cpu")
    reads: list[tuple[str, slice | None]] = []
    real_read = SafetensorsCheckpoint.read

    def read(self, name, *, rows=None):
        reads.append((name, rows))
        return real_read(self, name, rows=rows)

    SafetensorsCheckpoint.read = read
    out = []
    try:
        for source in sources:
            reads.clear()
            cfg = CFG if source is None else read_model_config(source)
            model, peak = _torch_peak_bytes(partial(
                build_model, cfg, device=CPU, seed=0, fsdp_mesh=mesh.fsdp_mesh,
                pretrained=source))
            # FSDP2 keeps each shard padded to ceil(rows / world) rows
            padded = [math.ceil(p.shape[0] / world) * p[0].numel() * 4
                      for p in model.parameters()]
            out.append({
                "reads": list(reads), "peak_bytes": peak, "padded_bytes": sum(padded),
                "largest_shard_bytes": max(padded),
                "tied": model.output.weight is model.tok_embeddings.weight,
                "weights": {n: full_tensor(p.detach()).clone()
                            for n, p in model.named_parameters()},
            })
    finally:
        SafetensorsCheckpoint.read = real_read
    return out


def test_fsdp_shards_hold_the_replicated_weights(tmp_path: Path) -> None:
    """FSDP over 3 ranks, built on meta: the gathered weights equal a replicated build's
    (fresh) and ``load_pretrained``'s (two checkpoints), bit for bit; each rank reads only
    its ``torch.chunk`` rows of every tensor, once; a tied table stays one parameter; and
    while building, the allocator never held more than the rank's (padded) shards and one
    shard's copy (``to_empty``'s unpadded tensor, which FSDP re-pads): about a third of the
    model, never the whole."""
    sources = [str(save_hf_case(case, tmp_path)) for case in ("llama3_tied", "qwen3_qk_norm")]
    per_rank = run_gloo_ranks(WORLD, rank_build_sharded, [None, *sources], timeout_seconds=300)

    wants = [dict(build_model(CFG, device=CPU, seed=0).named_parameters())]
    wants += [dict(load_pretrained(source).named_parameters()) for source in sources]
    for rank, runs in enumerate(per_rank):
        for run, want, source in zip(runs, wants, [None, *sources], strict=True):
            assert run["weights"].keys() == want.keys()
            for name, tensor in want.items():
                assert torch.equal(run["weights"][name], tensor.detach()), (source, name)
            assert run["tied"] == ("output.weight" not in want)
            assert run["peak_bytes"] <= run["padded_bytes"] + run["largest_shard_bytes"]
            full_bytes = sum(4 * t.numel() for t in want.values())
            assert run["peak_bytes"] < full_bytes / 2, (rank, source)
            if source is None:
                assert run["reads"] == []
                continue
            checkpoint = SafetensorsCheckpoint(source)
            for name, rows in run["reads"]:
                count = checkpoint.shape(name)[0]
                per = math.ceil(count / WORLD)
                assert rows == slice(rank * per, min((rank + 1) * per, count)), name
    for source in sources:  # the ranks' reads together: each tensor's rows, once
        index = [None, *sources].index(source)
        checkpoint = SafetensorsCheckpoint(source)
        covered: dict[str, list[int]] = {}
        for runs in per_rank:
            for name, rows in runs[index]["reads"]:
                covered.setdefault(name, []).extend(range(rows.start, rows.stop))
        for name, rows in covered.items():
            assert sorted(rows) == list(range(checkpoint.shape(name)[0])), name


def test_init_stream_is_numpys_pcg64() -> None:
    """The stream a parameter draws from is numpy's PCG64 seeded with (seed, name hash),
    two uniforms per element through Box-Muller: one element checked by hand."""
    stream = _stream_seed(3, "tok_embeddings.weight")
    u = np.random.Generator(np.random.PCG64(stream)).random(2)
    want = math.sqrt(-2 * math.log(1 - u[0])) * math.cos(2 * math.pi * u[1]) * 0.5
    got = torch.empty(1, 1, dtype=torch.float64)
    _fill_normal_rows_(got, slice(0, 1), std=0.5, stream=stream)
    assert got.item() == pytest.approx(want, rel=1e-15)
