"""The job spec at the service edge: every field documented, unknown fields rejected, errors
that name the field and what would be valid, ``--set`` overrides, and a faithful mapping to the
trainer's options. Every YAML file under ``jobs/`` validates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from ringray.cluster.job_options import ClusterOptions
from ringray.data import DataOptions
from ringray.model import model_preset
from ringray.spec import (
    JobSpec,
    JobSpecError,
    apply_overrides,
    load_job_spec,
    parse_job_spec,
)
from ringray.train import (
    CheckpointOptions,
    EvalOptions,
    OptimizerOptions,
    ParallelOptions,
    TrainingOptions,
    TrainOptions,
)

JOBS_DIR = Path(__file__).resolve().parent.parent / "jobs"
JOBS_FROM_AN_EXPORT = {"extend-2-mid.yaml", "extend-3-long.yaml"}
"""Jobs whose model.from_pretrained is an earlier job's export, absent until that job runs."""
JOBS_FROM_THE_MODEL_CACHE = {"smollm2-quickstart.yaml", "smollm2-32k-8xh100.yaml",
                             "smollm2-128k-8xh100.yaml", "smollm2-yarn4-cpu.yaml"}
"""Jobs whose model.from_pretrained is ``ringray models make smollm2-135m``'s checkpoint in
~/.cache/ringray/models (made here before they validate, as `make run-real` makes it)."""


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str | None]]:
    """``(dotted name, description)`` of every field, descending into sections."""
    out = []
    for name, info in model.model_fields.items():
        out.append((prefix + name, info.description))
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out.extend(_fields(info.annotation, f"{prefix}{name}."))
    return out


def test_every_field_has_a_description() -> None:
    """The CLI prints descriptions as the spec's documentation: none may be missing."""
    fields = _fields(JobSpec)
    names = {name for name, _ in fields}
    # The walk reached every section and the one nested below train.
    assert {"model.preset", "data.path", "parallel.cp", "train.seq_len",
            "train.optimizer.lr", "checkpoint.keep", "eval.passkey_lengths"} <= names
    undocumented = [name for name, text in fields if not (text and text.strip())]
    assert undocumented == []


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"train": {"stepz": 10}}, "train.stepz: unknown field; valid: steps, global_batch"),
        ({"train": {"optimizer": {"learning_rate": 1.0}}}, "train.optimizer.learning_rate:"),
        ({"bogus": 1}, "bogus: unknown field; valid: name, run_dir, model"),
    ],
)
def test_unknown_field_is_named(data: dict, needle: str) -> None:
    with pytest.raises(JobSpecError) as info:
        parse_job_spec(data)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"data": {"source": "stdlib", "path": "/data"}},
         "data.path: only read when source is 'files' (it is 'stdlib')"),
        # zigzag splits a sequence into 2 * cp chunks.
        ({"parallel": {"cp": 2}, "train": {"seq_len": 6}},
         "train.seq_len: 6 cannot be split by layout 'zigzag' over cp=2 ranks; "
         "use a multiple of 4"),
        ({"parallel": {"cp": 3, "layout": "contiguous"}, "train": {"seq_len": 10}},
         "train.seq_len: 10 cannot be split by layout 'contiguous' over cp=3 ranks; "
         "use a multiple of 3"),
        ({"parallel": {"cp": 4, "layout": "striped"}, "train": {"seq_len": 4098}},
         "use a multiple of 4"),
        ({"parallel": {"cp": 2}, "train": {"seq_len": 8}, "eval": {"passkey_lengths": [200, 1002]}},
         "eval.passkey_lengths: 1002 cannot be split by layout 'zigzag' over cp=2 ranks; "
         "use a multiple of 4"),
        ({"model": {"n_heads": 4, "n_kv_heads": 3}},
         "model.n_kv_heads: n_heads=4 is not divisible by n_kv_heads=3"),
        ({"model": {"dim": 130}}, "model.dim: 130 is not divisible by n_heads=4"),
        ({"parallel": {"dp": 3}, "train": {"global_batch": 4}},
         "train.global_batch: 4 does not split over parallel.dp=3 replicas; use a multiple of 3"),
        ({"data": {"source": "files"}}, "data.path: required when source is 'files'; give a "
         "directory of .txt/.jsonl files"),
        ({"parallel": {"layout": "spiral"}},
         "parallel.layout: 'spiral' is not one of 'contiguous', 'zigzag', 'striped'"),
        ({"parallel": {"attention_backend": "flash"}},
         "parallel.attention_backend: 'flash' is not one of 'auto', 'reference', 'sdpa'"),
        ({"model": {"preset": "405b"}},
         "model.preset: '405b' is not one of 'debug', 'small', '1b', '8b', '70b'"),
        ({"data": {"source": "web"}},
         "data.source: 'web' is not one of 'stdlib', 'files', 'passkey'"),
        ({"train": {"optimizer": {"lr": 0}}},
         "train.optimizer.lr: 0 is too small; use a number > 0"),
        ({"parallel": {"dp": 0}}, "parallel.dp: 0 is too small; use an integer >= 1"),
        ({"parallel": {"dp": 2}, "cluster": {"dp_min": 3}},
         "cluster.dp_min: 3 is larger than parallel.dp=2 (the size the job asks for); use a "
         "value from 1 to 2"),
        ({"parallel": {"dp": 4}, "train": {"global_batch": 8}, "cluster": {"dp_min": 3}},
         "cluster.dp_min: train.global_batch=8 does not split over dp_min=3 replicas; use a "
         "divisor of it"),
        ({"cluster": {"worker_resources": {"CPU": 0}}},
         "cluster.worker_resources.CPU: 0 is not positive; give an amount > 0, or leave CPU out"),
        ({"cluster": {"worker_resources": {}}},
         "cluster.worker_resources: {} asks for nothing; give at least one resource"),
        ({"cluster": {"accelerator": "tpu"}},
         "cluster.accelerator: 'tpu' is not one of 'cpu', 'gpu'"),
        ({"cluster": {"step_timeout_seconds": 0}},
         "cluster.step_timeout_seconds: 0 is too small; use a number > 0"),
        ({"cluster": {"max_failures": -1}},
         "cluster.max_failures: -1 is too small; use an integer >= 0"),
        ({"cluster": {"nodes": 3}}, "cluster.nodes: unknown field; valid: accelerator,"),
    ],
)
def test_invalid_spec_names_the_field_and_what_is_valid(data: dict, needle: str) -> None:
    with pytest.raises(JobSpecError) as info:
        parse_job_spec(data)
    assert needle in str(info.value)


def test_valid_cross_field_combinations_pass() -> None:
    """The same checks accept values that fit: zigzag over cp=2 at a multiple of 4, a batch
    that splits over dp, files with a path; with cp left to the world size, the sequence
    length is checked at launch instead."""
    parse_job_spec({"parallel": {"cp": 2}, "train": {"seq_len": 12},
                    "eval": {"passkey_lengths": [200, 1000]}})
    parse_job_spec({"parallel": {"dp": 2, "cp": None}, "train": {"global_batch": 4,
                                                                  "seq_len": 7}})
    parse_job_spec({"data": {"source": "files", "path": "/tmp/texts"}})
    parse_job_spec({"model": {"preset": "1b", "n_kv_heads": 32}})


def test_apply_overrides_parses_yaml_values() -> None:
    """``section.key=value`` sets nested keys, creating sections; values are YAML scalars."""
    data = {"train": {"steps": 5}, "name": "x"}
    apply_overrides(data, [
        "train.steps=20",
        "train.activation_checkpointing=true",
        "parallel.cp=null",
        "train.optimizer.lr=0.5",
        "model.preset=small",
        "name = spaced ",
        "eval.passkey_lengths=[64, 128]",
        "data.path=a=b",
    ])
    assert data == {
        "train": {"steps": 20, "activation_checkpointing": True, "optimizer": {"lr": 0.5}},
        "parallel": {"cp": None},
        "model": {"preset": "small"},
        "name": "spaced",
        "eval": {"passkey_lengths": [64, 128]},
        "data": {"path": "a=b"},
    }


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.steps", "--set 'train.steps': expected section.key=value"),
        ("=3", "--set '=3': expected section.key=value"),
        ("name.first=1", "name.first: 'name' is not a section"),
        (".steps=3", "--set '.steps=3': a field name has an empty part; expected "
                     "section.key=value, e.g. train.steps=3"),
        ("train..steps=3", "--set 'train..steps=3': a field name has an empty part"),
    ],
)
def test_malformed_override(override: str, needle: str) -> None:
    with pytest.raises(JobSpecError) as info:
        apply_overrides({"name": "job"}, [override])
    assert needle in str(info.value)


def test_load_job_spec_with_overrides(tmp_path: Path) -> None:
    """Overrides apply on top of the file and the result is validated as a whole."""
    path = tmp_path / "job.yaml"
    path.write_text("name: demo\nparallel:\n  cp: 2\ntrain:\n  seq_len: 64\n  steps: 5\n")
    spec = load_job_spec(path, ["train.steps=7", "train.seq_len=128", "parallel.dp=null"])
    assert (spec.name, spec.train.steps, spec.train.seq_len) == ("demo", 7, 128)
    assert (spec.parallel.dp, spec.parallel.cp) == (None, 2)
    with pytest.raises(JobSpecError, match=r"train.seq_len: 66 cannot be split"):
        load_job_spec(path, ["train.seq_len=66"])
    with pytest.raises(JobSpecError, match=r"train.stepz"):
        load_job_spec(path, ["train.stepz=1"])
    # A mapping merges into its section: the file's seq_len and an earlier --set survive
    # (the whole section was replaced, silently, before).
    spec = load_job_spec(path, ["train.global_batch=4", "train={steps: 3, seed: 2}"])
    assert (spec.train.steps, spec.train.seq_len, spec.train.global_batch, spec.train.seed) \
        == (3, 64, 4, 2)


def test_load_job_spec_file_errors(tmp_path: Path) -> None:
    """A missing file, a file that is not YAML, and YAML that is not a mapping each name the
    file; an empty file is the all-defaults spec."""
    missing = tmp_path / "nope.yaml"
    with pytest.raises(JobSpecError, match=r"nope.yaml: cannot read the job spec"):
        load_job_spec(missing)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(JobSpecError, match=r"list.yaml: a job spec is a mapping of sections, "
                                           r"got list"):
        load_job_spec(listing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [1, 2\n")
    with pytest.raises(JobSpecError, match=r"broken.yaml: not valid YAML"):
        load_job_spec(broken)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"name: caf\xe9\n")  # a traceback through read_text, before
    with pytest.raises(JobSpecError, match=r"latin1.yaml: not UTF-8 text \(byte 9: "
                                           r"b'\\xe9'\); save the job spec as UTF-8"):
        load_job_spec(latin1)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_job_spec(empty) == JobSpec()


def test_train_options_maps_every_field() -> None:
    """Each spec field lands in the matching option: TFLOP/s become FLOP/s, the model is the
    preset with the overrides, tuples for the passkey grid."""
    spec = parse_job_spec({
        "name": "mapped",
        "run_dir": "/scratch/run",
        "model": {"preset": "small", "n_layers": 2, "rope_theta": 1000.0},
        "data": {"source": "files", "path": "/data", "seed": 3},
        "parallel": {"dp": 2, "cp": 2, "layout": "striped", "attention_backend": "reference"},
        "train": {
            "steps": 9, "global_batch": 6, "seq_len": 128, "seed": 5, "precision": "bf16",
            "activation_checkpointing": "full", "peak_tflops_per_device": 312,
            "optimizer": {"lr": 0.01, "min_lr_ratio": 0.2, "warmup_steps": 3,
                          "weight_decay": 0.0, "beta1": 0.8, "beta2": 0.9, "eps": 1e-6,
                          "grad_clip": 0.5},
        },
        "checkpoint": {"path": "s3://bucket/job", "interval": 4, "keep": 1, "resume": False},
        "eval": {"passkey_lengths": [192, 256], "passkey_depths": [0.5], "passkey_samples": 2},
    })
    want = TrainOptions(
        model=model_preset("small", n_layers=2, rope_theta=1000.0),
        data=DataOptions(source="files", path="/data", seed=3),
        parallel=ParallelOptions(dp=2, cp=2, layout="striped", attention_backend="reference"),
        train=TrainingOptions(
            steps=9, global_batch=6, seq_len=128, seed=5, precision="bf16",
            activation_checkpointing="full", peak_tflops_per_device=312,
            optimizer=OptimizerOptions(lr=0.01, min_lr_ratio=0.2, warmup_steps=3,
                                       weight_decay=0.0, beta1=0.8, beta2=0.9, eps=1e-6,
                                       grad_clip=0.5),
        ),
        checkpoint=CheckpointOptions(path="s3://bucket/job", interval=4, keep=1, resume=False),
        eval=EvalOptions(passkey_lengths=(192, 256), passkey_depths=(0.5,), passkey_samples=2),
        run_dir="/scratch/run",
    )
    got = spec.train_options()
    assert got == want
    assert got.model.dim == 512 and got.model.n_layers == 2  # the preset, overridden
    assert got.checkpoint_location == "s3://bucket/job"
    assert got.peak_flops_per_device == 312e12


def test_train_options_defaults() -> None:
    """No run_dir: ``runs/<name>``, checkpoints under it; no peak: None (measured later)."""
    options = parse_job_spec({"name": "quick"}).train_options()
    assert options.run_dir == "runs/quick"
    assert options.checkpoint_location == "runs/quick/checkpoints"
    assert options.peak_flops_per_device is None
    assert options.model == model_preset("debug")
    assert options.train == TrainingOptions()
    assert options.parallel == ParallelOptions()


def test_job_files_validate() -> None:
    """Every job spec shipped under ``jobs/`` validates and maps to trainer and cluster
    options; the CPU ones (run on this machine) also pass the local path checks, the GPU
    ones are for a cluster's file systems."""
    from ringray.model.gguf_import import cached_model

    failures = []
    for path in sorted(JOBS_DIR.glob("*.yaml")):
        if path.name in JOBS_FROM_AN_EXPORT:
            continue  # tests/test_context_extension.py validates it against a stand-in export
        if path.name in JOBS_FROM_THE_MODEL_CACHE:
            cached_model("smollm2-135m")  # converted once per machine, then reused
        try:
            spec = load_job_spec(path, check_paths=False)
            spec.train_options()
            spec.job_options()
            if spec.cluster.accelerator == "cpu":
                load_job_spec(path)
        except (JobSpecError, ValueError) as exc:
            failures.append(f"{path.name}: {exc}")
    assert failures == []


def test_job_options_map_the_cluster_section() -> None:
    """`ringray train` needs an explicit mesh; the elastic floor defaults to the fixed size;
    a GPU job's workers ask for one GPU each unless the spec says otherwise."""
    spec = parse_job_spec({
        "name": "big", "parallel": {"dp": 4, "cp": 8}, "train": {"global_batch": 8},
        "cluster": {"accelerator": "gpu", "dp_min": 2, "max_failures": 5,
                    "step_timeout_seconds": 90, "grow_after_seconds": 30,
                    "failure_domain": "rack", "inter_node_gbps": 400},
    })
    job = spec.job_options()
    assert (job.name, job.cp, job.dp_max, job.dp_min) == ("big", 8, 4, 2)
    assert job.worker_resources == {"GPU": 1.0}
    assert job.cluster == ClusterOptions(
        accelerator="gpu", dp_min=2, max_failures=5, step_timeout_seconds=90,
        grow_after_seconds=30, failure_domain="rack", inter_node_gbps=400,
    )
    assert job.cluster.process_group_backend == "nccl"

    fixed = parse_job_spec({"parallel": {"dp": 2, "cp": 2}}).job_options()
    assert (fixed.dp_min, fixed.dp_max, fixed.worker_resources) == (2, 2, {"CPU": 1.0})
    custom = parse_job_spec({"parallel": {"cp": 2},
                             "cluster": {"worker_resources": {"CPU": 2, "big_mem": 1}}})
    assert custom.job_options().worker_resources == {"CPU": 2.0, "big_mem": 1.0}


@pytest.mark.parametrize("field", ["dp", "cp"])
def test_job_options_need_an_explicit_mesh(field: str) -> None:
    spec = parse_job_spec({"parallel": {"dp": 1, "cp": 2, field: None}})
    with pytest.raises(JobSpecError, match=f"parallel.{field}: required by `ringray train`"):
        spec.job_options()


def test_yaml_is_read_strictly(tmp_path: Path) -> None:
    """A key given twice is an error (plain YAML keeps the last one silently); ``1e-3`` is a
    float as in YAML 1.2 (PyYAML alone reads it as a string); values are not coerced."""
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(JobSpecError, match=r"dup.yaml: not valid YAML \(line 3: key 'steps' "
                                           r"appears twice in one mapping; keep one\)"):
        load_job_spec(dup)
    floats = tmp_path / "floats.yaml"
    floats.write_text("train:\n  optimizer:\n    lr: 1e-3\n    eps: 1E-8\n")
    assert load_job_spec(floats).train.optimizer.lr == 1e-3
    for override, needle in [("train.steps='10'", "train.steps: '10' is not an integer"),
                             ("train.steps=yes", "train.steps: true is not an integer"),
                             ("checkpoint.resume=0", "checkpoint.resume: 0 is not a boolean"),
                             ("name=", "name: null is not allowed here; e.g. 'ringray-job'")]:
        with pytest.raises(JobSpecError, match=re.escape(needle)):
            load_job_spec(floats, [override])


def test_a_dumped_spec_loads_back_equal(tmp_path: Path) -> None:
    """``ringray train`` writes the spec as run (``model_dump(mode='json')`` as YAML) for
    ``ringray resume``; the strict loader reads it back to the same spec."""
    spec = load_job_spec(JOBS_DIR / "quickstart.yaml", ["train.optimizer.eps=1e-8",
                                                        "cluster.worker_resources={CPU: 2}"])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    assert load_job_spec(path) == spec


def test_local_paths_are_checked_at_load_time(tmp_path: Path) -> None:
    """``data.path`` must be a directory here and the output directories creatable; with
    ``check_paths=False`` (a spec for another machine) only the schema is checked."""
    path = tmp_path / "job.yaml"
    path.write_text(f"data:\n  source: files\n  path: {tmp_path / 'corpus'}\n"
                    f"run_dir: {tmp_path / 'run'}\n")
    with pytest.raises(JobSpecError, match=r"data.path: '.*corpus' does not exist"):
        load_job_spec(path)
    assert load_job_spec(path, check_paths=False).data.path == str(tmp_path / "corpus")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("a document")
    assert load_job_spec(path).data.source == "files"
    (tmp_path / "file").write_text("x")
    with pytest.raises(JobSpecError, match=r"checkpoint.path: '.*file/ckpt' cannot be created: "
                                           r".*file is a file"):
        load_job_spec(path, [f"checkpoint.path={tmp_path / 'file' / 'ckpt'}"])
    with pytest.raises(JobSpecError, match=r"data.path: '.*file' is a file"):
        load_job_spec(path, [f"data.path={tmp_path / 'file'}"])
    assert load_job_spec(path, ["checkpoint.path=s3://bucket/job"]).checkpoint.path


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_output_directories_are_tried_for_real_not_by_their_permission_bits(
        tmp_path: Path) -> None:
    """/proc's bits say writable to root, but nothing can be made there: the job trained to its
    first save, then failed (torchrun with a traceback; Ray retried it three times), before."""
    path = tmp_path / "job.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\n")
    with pytest.raises(JobSpecError, match=r"checkpoint.path: '/proc/ringray-ckpt' cannot be "
                                           r"created: /proc is not writable \(no such file"):
        load_job_spec(path, ["checkpoint.path=/proc/ringray-ckpt"])
    with pytest.raises(JobSpecError, match=r"run_dir: '/proc' is not writable \("):
        load_job_spec(path, ["run_dir=/proc"])
    assert load_job_spec(path).run_dir == str(tmp_path / "run")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ringray-probe")]


def test_intervals_longer_than_the_run_are_allowed() -> None:
    """A checkpoint interval or log interval past train.steps means only the final
    checkpoint / only the first and last lines; a warmup past it ends the run inside the
    warmup (a smoke run such as ``--steps 4`` on a spec with 10 warmup steps)."""
    spec = parse_job_spec({"train": {"steps": 5, "log_every": 50,
                                     "optimizer": {"warmup_steps": 10}},
                           "checkpoint": {"interval": 100}})
    assert spec.train_options().checkpoint.interval == 100
