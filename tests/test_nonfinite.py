"""Nothing non-finite is trained on, committed or kept (``train.nonfinite_skips``).

A step whose loss or gradient norm is NaN or infinite is passed over on every rank alike (its
batch skipped, nothing applied, counted); past the limit the run stops naming the step; a
checkpoint of non-finite weights is never written, so pruning never removes the last good
one; a pretrained checkpoint holding a NaN is refused naming the tensor. Real gloo ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_gloo_ranks
from hf_cases import save_hf_case
from safetensors.torch import load_file, save_file
from train_cases import changed, tiny_options, weights_from_checkpoint

from ringray.model import load_pretrained, read_model_config
from ringray.train import (
    CheckpointStore,
    NonFiniteSteps,
    NonFiniteWeights,
    OptimizerOptions,
    TrainingSession,
    plan_session,
    run_training,
)
from ringray.train.materialize import build_model
from ringray.train.trainer import Trainer


def _steps(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "steps.jsonl").read_text().splitlines()]


def rank_diverging_run(rank: int, world: int, options) -> str:
    try:
        run_training(options, log=lambda _: None)
    except NonFiniteSteps as exc:
        return str(exc)
    return "finished"


def test_a_diverging_run_stops_naming_the_step_and_keeps_its_good_checkpoint(
        tmp_path: Path) -> None:
    """lr 1e30 (what a hostile user sets): step 1's update is finite but huge, so every
    later attempt's gradient norm is NaN. Both ranks (dp 2, each its own loss) stop at step
    2 after 1 + 3 attempts with the same one-line error; the step-1 checkpoint, the only one
    with checkpoint.keep 1 and a checkpoint every step, is still there and loads finite."""
    options = tiny_options(
        str(tmp_path / "run"), parallel={"dp": 2},
        train={"steps": 6, "optimizer": OptimizerOptions(lr=1e30, warmup_steps=0, eps=1e-5)},
        checkpoint={"interval": 1, "keep": 1})
    errors = run_gloo_ranks(2, rank_diverging_run, options)
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("step 2: not finite in 4 attempts in a row"), errors[0]
    assert "train.nonfinite_skips: 3" in errors[0] and "train.optimizer.lr" in errors[0]
    assert [s["step"] for s in _steps(options.run_dir)] == [1]
    store = CheckpointStore(options.checkpoint_location)
    assert [ref.step for ref in store.committed()] == [1]
    weights = weights_from_checkpoint(changed(options, parallel={"dp": 1}))
    assert all(torch.isfinite(w).all() for w in weights.values())


def rank_with_a_nan_loss(rank: int, world: int, options, nan_rank: int, nan_batch: int) -> dict:
    """run_training where rank ``nan_rank``'s loss is NaN on batch ``nan_batch`` (its
    gradients are NaN from there: the backward runs on the NaN loss)."""
    real = Trainer._loss_sum_backward

    def loss_sum_backward(self, inputs, labels, ring, counted):
        batch = self.loader.next_index - 1  # the batch just read
        if rank == nan_rank and batch == nan_batch:
            real(self, inputs, labels, ring, counted)
            poisoned = next(self.model.parameters())
            poisoned.grad.view(-1)[0] = float("nan")
            return torch.tensor(float("nan"))
        return real(self, inputs, labels, ring, counted)

    Trainer._loss_sum_backward = loss_sum_backward
    try:
        result = run_training(options, log=lambda _: None)
    except NonFiniteSteps as exc:
        return {"error": str(exc)}
    finally:
        Trainer._loss_sum_backward = real
    return {"last_step": result.last_step, "weights": weights_from_checkpoint(options)}


def test_a_nan_on_one_rank_is_passed_over_by_every_rank(tmp_path: Path) -> None:
    """Rank 1 alone meets a NaN on batch 1 (cp 2: the ranks share each sequence). Both ranks
    pass the attempt over (no hang, no rank stepping alone): step 2 trains on batch 2, the
    run ends at step 4 after 5 batches, and steps.jsonl counts the skip at step 2. The
    weights are finite and equal, bit for bit, those of the same run with the NaN on rank 0
    instead: which rank meets it does not matter."""
    base = tiny_options("", parallel={"cp": 2}, train={"steps": 4})
    on_1 = changed(base, run_dir=str(tmp_path / "on1"))
    on_0 = changed(base, run_dir=str(tmp_path / "on0"))
    first = run_gloo_ranks(2, rank_with_a_nan_loss, on_1, 1, 1)
    second = run_gloo_ranks(2, rank_with_a_nan_loss, on_0, 0, 1)
    assert [r["last_step"] for r in first] == [4, 4]
    steps = _steps(on_1.run_dir)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["nonfinite_skipped"] for s in steps] == [0, 1, 0, 0]
    assert all(s["finite"] for s in steps)
    for name, want in first[0]["weights"].items():
        torch.testing.assert_close(second[0]["weights"][name], want, atol=0, rtol=0,
                                   msg=name)
        assert torch.isfinite(want).all(), name
    store = CheckpointStore(on_1.checkpoint_location)
    trainer = Trainer(changed(on_1, parallel={"cp": 1}, checkpoint={"resume": False}))
    trainer.load_checkpoint(store, store.latest())
    assert trainer.loader.next_index == 5  # four steps and one batch passed over


def test_with_no_skips_allowed_the_first_nan_stops_the_run(tmp_path: Path) -> None:
    options = tiny_options(str(tmp_path / "run"), parallel={"cp": 2},
                           train={"steps": 4, "nonfinite_skips": 0})
    out = run_gloo_ranks(2, rank_with_a_nan_loss, options, 0, 2)
    assert out[0]["error"] == out[1]["error"]
    assert out[0]["error"].startswith("step 3: not finite in 1 attempt in a row"), out
    assert "loss nan" in out[0]["error"]


def test_a_checkpoint_of_nonfinite_weights_is_refused_and_nothing_is_written(
        tmp_path: Path) -> None:
    options = tiny_options(str(tmp_path / "run"), train={"steps": 4})
    session = TrainingSession(options, plan_session(options))
    session.step()
    first = session.checkpoint().checkpoint
    session.step()
    with torch.no_grad():
        session.trainer.model.layers[1].attention.wo.weight[3, 2] = float("inf")
    with pytest.raises(NonFiniteWeights, match=r"^step 2: not checkpointed: weight "
                                               r"layers\.1\.attention\.wo\.weight holds"):
        session.checkpoint()
    store = CheckpointStore(options.checkpoint_location)
    assert [ref.location for ref in store.committed()] == [first.location]
    assert [p.name for p in Path(options.checkpoint_location).iterdir()
            if p.name.startswith("step_")] == [Path(first.location).name]


def _poisoned_pretrained(tmp_path: Path, name: str, row: int) -> Path:
    path = save_hf_case("llama_yarn", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors[name][row, 0] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


BAD = "model.layers.1.mlp.down_proj.weight"


def test_a_pretrained_checkpoint_holding_a_nan_is_refused_naming_the_tensor(
        tmp_path: Path) -> None:
    path = _poisoned_pretrained(tmp_path, BAD, 5)
    with pytest.raises(ValueError, match=rf"tensor {BAD} holds a NaN or an infinity"):
        load_pretrained(path)
    with pytest.raises(ValueError, match=rf"tensor {BAD} holds a NaN or an infinity"):
        build_model(read_model_config(str(path)), device=torch.device("cpu"), seed=0,
                    pretrained=str(path))


def rank_build_sharded(rank: int, world: int, source: str) -> str:
    from ringray.train.mesh import build_mesh, resolve_mesh_shape

    mesh = build_mesh(resolve_mesh_shape(world_size=world, dp=1, cp=world), device_type="cpu")
    try:
        build_model(read_model_config(source), device=torch.device("cpu"), seed=0,
                    fsdp_mesh=mesh.fsdp_mesh, pretrained=source)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_fsdp_ranks_refuse_a_nan_only_one_of_them_read(tmp_path: Path) -> None:
    """Under FSDP over 2 ranks each reads half of each tensor's rows; the NaN sits in the
    last row, rank 1's. Both ranks raise the same line (no rank waits for the other)."""
    path = _poisoned_pretrained(tmp_path, BAD, -1)
    out = run_gloo_ranks(2, rank_build_sharded, str(path))
    assert out[0] == out[1], out
    assert f"tensor {BAD} holds a NaN or an infinity" in out[0]
