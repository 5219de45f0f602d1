"""The run's rules (``ringray.train.policy``), each in its one wording; the drivers' own tests
(``test_cli_refusals``, ``test_train_entrypoint``, ``test_cluster_machine``) check that they
say exactly this."""

from __future__ import annotations

from train_cases import tiny_options

from ringray.train import CheckpointRef
from ringray.train.policy import (
    evaluation_due,
    final_checkpoint_due,
    model_config_differences,
    steps_below_checkpoint,
)

OPTIONS = tiny_options("run", train={"steps": 10})


def _ref(step: int) -> CheckpointRef:
    return CheckpointRef(step=step, location=f"/ck/step_{step}", lineage="run-1")


def test_a_checkpoint_past_train_steps_is_refused_in_one_line() -> None:
    assert steps_below_checkpoint(OPTIONS, None) is None
    assert steps_below_checkpoint(OPTIONS, _ref(10)) is None
    assert steps_below_checkpoint(OPTIONS, _ref(20)) == (
        "train.steps: 10 is below step 20 of the checkpoint this run resumes (/ck/step_20); "
        "set train.steps to 20 or more (--steps with ringray train), or give a new run_dir to "
        "train afresh")


def test_the_last_step_ends_on_a_checkpoint_then_the_evaluation() -> None:
    assert not final_checkpoint_due(9, None, OPTIONS)  # not there yet
    assert final_checkpoint_due(10, 8, OPTIONS)  # the interval's checkpoint was step 8
    assert not final_checkpoint_due(10, 10, OPTIONS)  # the interval's was the last step's
    assert final_checkpoint_due(10, None, OPTIONS)  # no checkpoint at all yet
    assert not evaluation_due(tiny_options("run", eval={"passkey_lengths": ()}))
    assert evaluation_due(tiny_options("run", eval={"passkey_lengths": (256,)}))


def test_the_model_config_check_names_each_field_with_both_values() -> None:
    assert model_config_differences({"dim": 32, "n_layers": 2}, {"dim": 32, "n_layers": 2}) == ""
    assert model_config_differences({"dim": 32, "n_layers": 2}, {"dim": 64, "n_layers": 2,
                                                                 "qk_norm": True}) == (
        "dim: 32 in the checkpoint, 64 now, qk_norm: None in the checkpoint, True now")
