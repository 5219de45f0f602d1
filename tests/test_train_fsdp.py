"""Sharded training (``parallel.fsdp``) is the same training as one device, and its
checkpoints reshard.

Real gloo processes, float32, SDPA, the two-layer debug model, three AdamW steps:

- FSDP over dp 2 × cp 2 (zigzag; also with selective and with full activation
  checkpointing, which recompute under FSDP's gathered weights) and over dp 1 × cp 4
  (zigzag and striped), and a pretrained Llama with tied embeddings (each rank reading its
  shard's rows), give the per-step losses (1e-5), the summed and clipped gradients (1e-5)
  and the final weights (1e-4; AdamW amplifies tiny gradient differences, see
  tests/test_train_exact.py) of a replicated one-device run on the same global batch.
  (dp 2 × cp 2 striped is left out: there one embedding element whose gradient nearly
  cancels ends 1.3e-4 from the one-device run's, replicated or sharded alike: a float32
  summation-order effect that AdamW amplifies, not FSDP's.)
- A checkpoint written by FSDP at dp 2 × cp 2 continues at FSDP dp 1 × cp 2 and at replicated
  cp 2; a replicated checkpoint continues under FSDP; each ends where the uninterrupted run
  ends (losses 1e-5, weights 1e-5). ``ringray export`` writes an FSDP-written checkpoint
  as the same weights.

Each launch of processes runs several jobs, one after another, to keep the test short.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed import run_gloo_ranks
from hf_cases import write_tokenizer
from train_cases import (
    changed,
    rank_record_steps,
    rank_run_training,
    record_steps,
    tiny_options,
    weights_from_checkpoint,
)

from ringray.model import load_pretrained
from ringray.spec import parse_job_spec
from ringray.train import TrainOptions
from ringray.train.export import export_hf

STEPS = 3
TOL = {"atol": 1e-5, "rtol": 1e-5}
WEIGHT_TOL = {"atol": 1e-4, "rtol": 1e-5}
_cache: dict = {}


def _pretrained_options(tmp: Path, **parallel) -> TrainOptions:
    """A tiny Llama with tied embeddings, saved by transformers with a tokenizer, as a job's
    ``model.from_pretrained``; its text is a local file."""
    import transformers

    source = tmp / "source"
    if not source.exists():
        config = transformers.LlamaConfig(
            vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=True, rope_theta=10_000.0)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(source)
        write_tokenizer(source)
        (tmp / "corpus").mkdir()
        (tmp / "corpus" / "a.txt").write_text("The pass key is 12345. Remember it. " * 60)
    spec = parse_job_spec({
        "run_dir": str(tmp / "run"), "model": {"from_pretrained": str(source)},
        "data": {"source": "files", "path": str(tmp / "corpus")},
        "parallel": {"attention_backend": "sdpa", **parallel},
        "train": {"steps": STEPS, "global_batch": 4, "seq_len": 64, "precision": "fp32",
                  "peak_tflops_per_device": 1.0,
                  "optimizer": {"lr": 1e-2, "warmup_steps": 1}},
    })
    return spec.train_options()


def _sharded_runs(tmp_path_factory) -> dict[str, dict]:
    """Every 4-rank FSDP run, in one launch: name -> rank 0's record (every rank's record is
    checked equal to rank 0's)."""
    if "sharded" not in _cache:
        run_dir = str(tmp_path_factory.mktemp("fsdp"))
        runs = {"dp2cp2-zigzag": tiny_options(run_dir, parallel={
            "dp": 2, "cp": 2, "layout": "zigzag", "fsdp": True}, train={"global_batch": 4})}
        runs |= {
            f"dp1cp4-{layout}": tiny_options(run_dir, parallel={
                "dp": 1, "cp": 4, "layout": layout, "fsdp": True})
            for layout in ("zigzag", "striped")
        }
        for mode in ("selective", "full"):
            runs[f"dp2cp2-{mode}"] = changed(runs["dp2cp2-zigzag"],
                                             train={"activation_checkpointing": mode})
        runs["pretrained-tied"] = _pretrained_options(
            tmp_path_factory.mktemp("pretrained"), dp=2, cp=2, fsdp=True)
        per_rank = run_gloo_ranks(4, rank_record_steps, list(runs.values()), STEPS,
                                  timeout_seconds=600)
        for rank_runs in per_rank[1:]:  # gathered weights: every rank sees the same
            for got, want in zip(rank_runs, per_rank[0], strict=True):
                _assert_same_training(got, want, weight_tol=TOL)
        _cache["sharded"] = dict(zip(runs, per_rank[0], strict=True))
        _cache["pretrained-options"] = runs["pretrained-tied"]
    return _cache["sharded"]


def _single_device(tmp_path_factory, global_batch: int) -> dict:
    key = ("single", global_batch)
    if key not in _cache:
        options = tiny_options(str(tmp_path_factory.mktemp("single")),
                               parallel={"dp": 1, "cp": 1}, train={"global_batch": global_batch})
        _cache[key] = record_steps(options, STEPS)
    return _cache[key]


def _assert_same_training(got: dict, want: dict, *, weight_tol: dict = WEIGHT_TOL) -> None:
    """Losses, the global gradient norm reported (every step clips: it is above 1), the
    summed and clipped gradients, and the final weights."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL)
    torch.testing.assert_close(torch.tensor(got["grad_norms"]),
                               torch.tensor(want["grad_norms"]), **TOL)
    assert min(want["grad_norms"]) > 1.0  # grad_clip 1.0: the clipping is exercised
    for step, (g_step, w_step) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        assert g_step.keys() == w_step.keys()
        for name in w_step:
            torch.testing.assert_close(g_step[name], w_step[name], **TOL,
                                       msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
    for name in want["weights"]:
        torch.testing.assert_close(got["weights"][name], want["weights"][name], **weight_tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("run", ["dp2cp2-zigzag", "dp1cp4-zigzag", "dp1cp4-striped",
                                 "dp2cp2-selective", "dp2cp2-full"])
def test_fsdp_equals_single_device(tmp_path_factory, run: str) -> None:
    """Sharded over the flattened dp × cp mesh, summed by FSDP's reduce-scatter (no average),
    clipped by the global norm: the single-device training on the same global batch."""
    want = _single_device(tmp_path_factory, global_batch=4 if run.startswith("dp2") else 2)
    _assert_same_training(_sharded_runs(tmp_path_factory)[run], want)
    assert want["losses"][-1] < want["losses"][0] - 0.5  # it trains


def test_fsdp_loads_pretrained_tied_embeddings(tmp_path_factory) -> None:
    """A pretrained Llama with tied embeddings, sharded on meta and each rank's rows read
    from the checkpoint: the one table stays one parameter (in the root's FSDP unit) and
    training matches the replicated one-process run of the same job."""
    got = _sharded_runs(tmp_path_factory)["pretrained-tied"]
    options = _cache["pretrained-options"]
    want = record_steps(changed(options, parallel={"dp": 1, "cp": 1, "fsdp": False}), STEPS)
    assert "output.weight" not in want["weights"]  # tied: registered once
    _assert_same_training(got, want)


# ------------------------------------------------------------------------------ resharding
def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in lines}


def _copy_run(source: TrainOptions, target: Path, **parallel) -> TrainOptions:
    """``source``'s run directory (checkpoints, steps.jsonl) copied to ``target``, and its
    options there with ``parallel`` changed."""
    shutil.copytree(Path(source.run_dir) / "checkpoints", target / "checkpoints")
    shutil.copy(Path(source.run_dir) / "steps.jsonl", target / "steps.jsonl")
    return changed(replace(source, run_dir=str(target)), parallel=parallel)


def test_checkpoints_reshard_between_fsdp_and_replicated(tmp_path: Path) -> None:
    """Five steps with a checkpoint at step 3, global batch 4. FSDP dp 2 × cp 2 writes step 3
    (4 processes); from it, FSDP dp 1 × cp 2 and replicated cp 2 (2 processes) each train to
    step 5; a replicated cp 2 run's step-3 checkpoint continues under FSDP dp 1 × cp 2. Each
    ends where the uninterrupted FSDP dp 2 × cp 2 run does: the same losses for steps 4 and
    5 and the same weights (1e-5). Then `ringray export` writes the uninterrupted run's
    FSDP-written checkpoint, read in this one process, as those weights: in one file, and
    streamed shard by shard into many."""
    base = tiny_options("", parallel={"dp": 2, "cp": 2, "fsdp": True},
                        train={"steps": 5, "global_batch": 4}, checkpoint={"interval": 3})
    straight = replace(base, run_dir=str(tmp_path / "straight"))
    sharded = replace(base, run_dir=str(tmp_path / "sharded"))
    first = run_gloo_ranks(4, rank_run_training, [(straight, None), (sharded, 3)],
                           timeout_seconds=600)
    assert first[0][1]["last_step"] == 3
    want_weights = first[0][0]["weights"]

    to_fsdp_cp2 = _copy_run(sharded, tmp_path / "to-fsdp-cp2", dp=1, cp=2)
    to_replicated = _copy_run(sharded, tmp_path / "to-replicated", dp=1, cp=2, fsdp=False)
    replicated = changed(replace(base, run_dir=str(tmp_path / "replicated")),
                         parallel={"dp": 1, "cp": 2, "fsdp": False})
    replicated_to_fsdp = changed(replicated, parallel={"fsdp": True})
    second = run_gloo_ranks(2, rank_run_training, [
        (to_fsdp_cp2, None), (to_replicated, None), (replicated, 3), (replicated_to_fsdp, None),
    ], timeout_seconds=600)
    want_losses = _losses(tmp_path / "straight")
    for index, options in ((0, to_fsdp_cp2), (1, to_replicated), (3, replicated_to_fsdp)):
        result = second[0][index]
        assert (result["resumed_from"], result["last_step"]) == (3, 5), options.run_dir
        losses = _losses(Path(options.run_dir))
        assert sorted(losses) == [1, 2, 3, 4, 5]
        for step in (4, 5):
            assert losses[step] == pytest.approx(want_losses[step], abs=1e-5, rel=1e-5)
        for name, want in want_weights.items():
            torch.testing.assert_close(result["weights"][name], want, **TOL,
                                       msg=lambda m, n=name, d=options.run_dir: f"{d} {n}: {m}")

    # The FSDP-written checkpoint read into one replicated process, and exported.
    alone = weights_from_checkpoint(changed(straight, parallel={"dp": 1, "cp": 1,
                                                                "fsdp": False}))
    out = tmp_path / "exported"
    ref = export_hf(straight, str(out))
    assert ref.step == 5
    exported = dict(load_pretrained(out).named_parameters())
    # The same, streamed in shards of 20 kB (read and written one shard at a time).
    sharded_out = tmp_path / "exported-in-shards"
    export_hf(straight, str(sharded_out), max_shard_bytes=20_000)
    assert len(list(sharded_out.glob("model-*-of-*.safetensors"))) > 3
    in_shards = dict(load_pretrained(sharded_out).named_parameters())
    for name, want in want_weights.items():
        torch.testing.assert_close(alone[name], want, atol=0, rtol=0, msg=name)
        torch.testing.assert_close(exported[name].detach(), want, atol=0, rtol=0, msg=name)
        torch.testing.assert_close(in_shards[name].detach(), want, atol=0, rtol=0, msg=name)
