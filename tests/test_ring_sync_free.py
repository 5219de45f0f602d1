"""After its first call with a signature, ``ring_attention`` does nothing that would
synchronise a GPU, and a bad or changed call on one rank still fails on every rank.

What would synchronise a GPU, counted per call (forward and backward) on a real gloo ring of
two processes running the fused path (the Triton kernels, in Triton's interpreter):

- collectives on the compute group other than the K/V exchange (counted by wrapping
  ``torch.distributed``'s collectives and naming the group each one ran on);
- host reads of tensor values from ringray's code: ``.item()``, ``.tolist()``, ``bool()``,
  ``int()``, ``float()`` (counted by wrapping those methods and keeping the calls whose
  caller is a ``ringray`` module), apart from the agreement's read of its host vector;
- host-to-device copies of positions, document ids and tile metadata: misses of the caches
  that hold them (``_device_tokens``, the rank and transfer plans, the own block's steps, the
  Triton tile lists).

The one thing allowed per call is the agreement, a 25-integer MAX all-reduce on the ring's
CPU side group (``agreement_group``); its wall time per call is printed.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
from distributed import run_gloo_ranks

pytest.importorskip("triton")

SEQ = 64
DOCUMENTS = [1, 20, 9, 34]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier",
               "all_to_all_single", "reduce_scatter_tensor", "gather", "scatter")


def _instrument(log: list[tuple[str, str]]):
    """Wrap collectives and host reads; append (kind, where) to ``log``. Returns undo."""
    import torch.distributed as dist

    from ringray.attention.comm import _AGREEMENT_GROUPS

    undo = []

    def wrap(owner, name, record):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            record(args, kwargs)
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)
        undo.append(lambda: setattr(owner, name, original))

    for name in COLLECTIVES:
        def record(args, kwargs, name=name):
            group = kwargs.get("group")
            side = any(group is pair[1] for pair in _AGREEMENT_GROUPS.values())
            log.append(("agreement" if side else f"collective {name}", ""))
        wrap(dist, name, record)

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        def record(args, kwargs, name=name):
            caller = sys._getframe(2)
            filename = caller.f_code.co_filename
            if "/ringray/" in filename and caller.f_code.co_name != "agree_across_ranks":
                log.append((f"read {name}", f"{filename}:{caller.f_lineno}"))
        wrap(torch.Tensor, name, record)
    return lambda: [u() for u in reversed(undo)]


def _cache_misses() -> dict[str, int]:
    from ringray.attention.backends.triton_tiles import TILE_LISTS
    from ringray.attention.ring import _device_tokens, _own_steps, _plan, _transfers

    return {"device tokens": _device_tokens.cache_info().misses,
            "plans": _plan.cache_info().misses,
            "transfer plans": _transfers.cache_info().misses,
            "own-block steps": _own_steps.cache_info().misses, "tile lists": TILE_LISTS.builds}


def _rank_counts(rank: int, world: int) -> dict:
    """Three identical calls, counted; then a changed and a bad call on rank 1 only."""
    import torch.distributed as dist

    from ringray.attention import make_layout, ring_attention

    layout = make_layout("zigzag", world, SEQ)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, SEQ, 2, 16, generator=g)
    k, v = (torch.randn(1, SEQ, 1, 16, generator=g) for _ in range(2))
    shard = [layout.shard(t, rank) for t in (q, k, v)]

    def call(documents=DOCUMENTS, softmax_scale=None):
        leaves = [t.clone().requires_grad_() for t in shard]
        out = ring_attention(*leaves, layout=layout, backend="triton", documents=documents,
                             softmax_scale=softmax_scale)
        out.square().sum().backward()

    per_call = []
    for _ in range(3):
        log: list[tuple[str, str]] = []
        before = _cache_misses()
        undo = _instrument(log)
        try:
            call()
        finally:
            undo()
        after = _cache_misses()
        per_call.append({"log": log, "misses": {n: after[n] - before[n] for n in after}})

    # The agreement's cost: the MAX all-reduce of the 25-integer vector on the side group.
    from ringray.attention.comm import agree_max

    dist.barrier()
    start = time.perf_counter()
    for _ in range(50):
        agree_max(torch.zeros(25, dtype=torch.int64), None)
    agreement_ms = (time.perf_counter() - start) / 50 * 1e3

    errors = {}
    for case, kwargs in (("changed documents", {"documents": [2, 19, 9, 34]}),
                         ("bad scale", {"softmax_scale": -1.0})):
        try:
            call(**(kwargs if rank == 1 else {}))
            errors[case] = None
        except ValueError as exc:
            errors[case] = str(exc)
    call()  # and the ring still works afterwards
    return {"per_call": per_call, "agreement_ms": agreement_ms, "errors": errors}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_gloo_ranks(2, _rank_counts, timeout_seconds=240)


def test_first_call_fills_the_caches_and_the_next_calls_do_not_sync(ranks) -> None:
    for rank, result in enumerate(ranks):
        first, *later = result["per_call"]
        assert first["misses"]["device tokens"] == 1 and first["misses"]["tile lists"] > 0
        for n, record in enumerate(later, start=2):
            syncs = [entry for entry in record["log"] if entry[0] != "agreement"]
            assert syncs == [], f"rank {rank}, call {n}: {syncs}"
            assert [e for e in record["log"] if e[0] == "agreement"] == [("agreement", "")]
            assert record["misses"] == {"device tokens": 0, "plans": 0, "transfer plans": 0,
                                        "own-block steps": 0, "tile lists": 0}
        print(f"rank {rank}: agreement {result['agreement_ms']:.3f} ms per call "
              f"(gloo, local processes); first call's cache misses {first['misses']}")


def test_a_changed_or_bad_call_on_one_rank_fails_on_every_rank(ranks) -> None:
    changed = [result["errors"]["changed documents"] for result in ranks]
    assert all(e is not None and "ranks disagree on documents" in e for e in changed), changed
    bad = [result["errors"]["bad scale"] for result in ranks]
    assert bad[1] is not None and bad[1].startswith("softmax_scale:"), bad
    assert bad[0] is not None and "rank 1 of the ring rejected its inputs (softmax_scale)" \
        in bad[0], bad
