"""RULER's offline tasks (ringray.harness.ruler) and ``ringray eval`` (ringray/cli/evaluate.py).

A tiny random Llama is saved locally with a byte-level BPE trained here on the words RULER's
generators use (its filler, templates and wonderwords' lists: nothing downloaded), so that
every generator fits its prompts at 1024 tokens, the shortest length ``ringray eval`` takes.

- every offline task builds at 1024 with the network refused (every socket lookup and
  connect raises; lm_eval's ``prepare_niah`` asks nltk for a download when first imported and
  carries on), the same samples each time, and an essay task fails to build offline;
- ``ringray eval`` on a Hugging Face directory and on a run directory (its checkpoint
  exported) writes its JSON, samples and table; ruler_vt is refused up front for a byte-level
  tokenizer, whose in-context example lm_eval's generator would try to fit forever;
- bad input in one line each: an unknown task, a length past the model's positions without
  RoPE scaling (and past what the scaling reaches), lm_eval missing, a length below 1024;
- (``slow``) a real 2-rank gloo ring gives the same greedy generations and log-likelihoods
  as one process on RULER's prompts and passkey's (tests/test_harness.py's rings, in ``make
  test``, cover the model's ring plumbing); every task by default on a byte-level run
  (ruler_vt skipped with a line); and ``ringray eval --cp 2`` (the launcher's ring, rank 0
  building the data) writing the samples a cp=1 run writes.

Generation is capped (``--max-gen-toks``) to keep the runs short.
The import of lm_eval's ``prepare_niah`` (its word list of 6 million adjective-noun pairs)
takes ~15 s of the module's time on 2 cores.
"""

from __future__ import annotations

import json
import re
import socket
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytestmark = pytest.mark.skipif(
    any(find_spec(m) is None for m in ("lm_eval", "wonderwords", "nltk", "transformers")),
    reason="needs the eval extra (lm_eval with RULER's wonderwords and nltk)")

ROOT = Path(__file__).resolve().parent.parent
LENGTH = 1024
POSITIONS = 2048
TOL = {"atol": 1e-4, "rtol": 1e-6}  # as tests/test_harness.py: float32 sums in other orders


def _corpus() -> list[str]:
    """What RULER's offline generators write: filler, templates, words (no digits, so keys
    stay one token per digit, as passkey checks)."""
    import wonderwords
    from lm_eval.tasks.ruler import cwe_utils, fwe_utils, vt_utils

    words = wonderwords.RandomWord()._categories
    texts = [vt_utils.TEMPLATE, cwe_utils.TEMPLATE, fwe_utils.TEMPLATE,
             "Some special magic numbers are hidden within the following text. Make sure to "
             "memorize it. I will quiz you about the numbers afterwards. What are all the "
             "special magic numbers for mentioned in the provided text? One of the special "
             "magic uuids for is: The special magic number for mentioned in the provided "
             "text is",
             "The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
             "back again.",
             "The pass key is. Remember it. is the pass key. What is the pass key?",
             " ".join(w for kind in ("nouns", "adjectives", "verbs") for w in words[kind])]
    return [re.sub(r"\d", "", text) for text in texts]


def save_checkpoint(path: Path, positions: int = POSITIONS) -> None:
    """A random 2-layer Llama over a byte-level BPE of 8000 tokens trained on
    :func:`_corpus`, which prepends BOS."""
    from hf_cases import save_tiny_llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=8000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False))
    save_tiny_llama(path, tokenizer, positions=positions)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ruler") / "ckpt"
    save_checkpoint(path)
    return str(path)


def _refuse_network(patch: pytest.MonkeyPatch) -> list:
    """Every name lookup and connection of this process raises; returns what was tried."""
    tried: list = []

    def refuse(*args, **kwargs):
        tried.append(args[0] if args else kwargs.get("host"))
        raise OSError("the network is off in this test")

    patch.setattr(socket, "getaddrinfo", refuse)
    patch.setattr(socket, "create_connection", refuse)
    patch.setattr(socket.socket, "connect", lambda self, address: refuse(address))
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("HF_DATASETS_OFFLINE", "1")
    # Read when the libraries were imported (earlier, in this process): set them as well, or
    # an essay task's dataset lookup retries the refused connection for 23 s.
    import datasets
    import huggingface_hub

    patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, name):
            patch.setattr(datasets.config, name, True)
    return tried


@pytest.fixture
def no_network(monkeypatch) -> list:
    return _refuse_network(monkeypatch)


def _one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def _eval(*args: str):
    from ringray.cli import app

    return CliRunner().invoke(app, ["eval", *args])


# ---------------------------------------------------------------------- building the data

@pytest.fixture(scope="module")
def built(checkpoint: str) -> dict:
    """Every offline task built at 1024 with the network refused (the module's first use of
    lm_eval's RULER code), and what the network was asked for meanwhile."""
    from ringray.harness.ruler import OFFLINE_TASKS, build_task

    first_import = "lm_eval.tasks.ruler.prepare_niah" not in sys.modules
    with pytest.MonkeyPatch.context() as patch:
        tried = _refuse_network(patch)
        tasks = {name: build_task(name, LENGTH, pretrained=checkpoint, num_samples=12)
                 for name in OFFLINE_TASKS}
        essay_error = None
        try:
            from ringray.harness.ruler import task_manager

            task_manager(checkpoint, LENGTH).load(["niah_single_2"])
        except Exception as exc:  # noqa: BLE001 - what an essay task does offline
            essay_error = exc
    return {"tasks": tasks, "tried": list(tried), "first_import": first_import,
            "essay_error": essay_error}


def test_offline_tasks_build_with_the_network_off(built: dict, checkpoint: str) -> None:
    """Each offline task makes its samples at 1024 tokens with every connection refused:
    RULER's 500 (passkey: the 12 asked for), each holding its answers, none longer than the
    length (fwe's prompts fill it and leave its 50 answer tokens past it, as lm_eval's
    generator does); the only thing the network was asked for is nltk's punkt_tab (when
    prepare_niah was first imported here), and an essay task cannot build."""
    from ringray.harness.ruler import OFFLINE_TASKS

    tasks = built["tasks"]
    assert list(tasks) == list(OFFLINE_TASKS)
    for name, task in tasks.items():
        docs = list(task.eval_docs)
        assert len(docs) == (12 if name == "ringray_passkey" else 500), name
        assert {doc["max_length"] for doc in docs} == {LENGTH}
        room = 50 if name == "ruler_fwe" else 0
        assert all(doc["length"] <= LENGTH + room for doc in docs), name
        text = "context" if name == "ringray_passkey" else "input"
        for doc in docs[:20]:
            assert doc["outputs"], name
            if name.startswith(("niah", "ringray_niah", "ruler_vt")):
                assert all(answer in doc[text] for answer in doc["outputs"]), name
        if name == "ringray_niah_multivalue":
            assert all(len(doc["outputs"]) == 4 for doc in docs)
        if name == "ringray_niah_multiquery":
            assert all(doc["gen_prefix"].count(",") >= 2 and len(doc["outputs"]) == 4
                       for doc in docs)
        if name in ("niah_single_1", "ringray_niah_multivalue", "ringray_niah_multiquery"):
            assert all("The grass is green." in doc["input"] for doc in docs[:5])
    hosts = {str(host) for host in built["tried"]}
    assert hosts <= {"raw.githubusercontent.com"}, hosts
    if built["first_import"]:
        assert hosts == {"raw.githubusercontent.com"}  # nltk's attempt, which did not stop it
    assert built["essay_error"] is not None


def test_the_same_samples_every_build(built: dict, checkpoint: str) -> None:
    """A cell's data does not depend on what was built before it: ruler_cwe (whose module
    keeps a random.Random that lm_eval's loader would carry over from one build to the next)
    and passkey rebuilt now, after every other task, give the same samples."""
    from ringray.harness.ruler import build_task

    for name in ("ruler_cwe", "ringray_passkey"):
        again = build_task(name, LENGTH, pretrained=checkpoint, num_samples=12)
        first = list(built["tasks"][name].eval_docs)
        second = list(again.eval_docs)
        assert first == second, name


# ---------------------------------------------------------------------- the ring

def _requests(built: dict, max_gen_toks: int = 4, per_task: int = 2) -> dict:
    """The first generation prompts of three tasks (as lm_eval makes them: template, answer
    prefix) with generation capped, and two passkey loglikelihood requests."""
    generate = []
    for name in ("niah_single_1", "ruler_vt", "ringray_niah_multiquery"):
        task = built["tasks"][name]
        task.build_all_requests(limit=per_task, rank=0, world_size=1)
        for instance in task.instances:
            context, kwargs = instance.args
            generate.append((context, {**kwargs, "max_gen_toks": max_gen_toks}))
    passkey = built["tasks"]["ringray_passkey"]
    passkey.build_all_requests(limit=2, rank=0, world_size=1)
    loglikelihood = [instance.args for instance in passkey.instances]
    return {"generate": generate, "loglikelihood": loglikelihood}


def _answers(lm, requests: dict) -> dict:
    from lm_eval.api.instance import Instance

    def instances(kind: str, items: list) -> list:
        return [Instance(request_type=kind, doc={}, arguments=tuple(args), idx=i)
                for i, args in enumerate(items)]

    return {"generate": lm.generate_until(instances("generate_until", requests["generate"]),
                                          disable_tqdm=True),
            "loglikelihood": lm.loglikelihood(instances("loglikelihood",
                                                        requests["loglikelihood"]),
                                              disable_tqdm=True)}


def ring_rank(rank: int, world: int, path: str, requests: dict) -> dict | int:
    from ringray.harness.ring import serve

    if rank:
        return serve()
    from ringray.harness.lm import RingLM

    lm = RingLM(pretrained=path, max_length=LENGTH + 128)
    try:
        assert lm.options.cp == world
        return _answers(lm, requests)
    finally:
        lm.close()


@pytest.mark.slow
def test_a_ring_of_two_answers_as_one_process(built: dict, checkpoint: str) -> None:
    """A real 2-rank gloo ring on RULER's own prompts (niah_single_1, ruler_vt, the
    multi-query needle) and passkey's: the same greedy generations, and log-likelihoods
    within float32 rounding with the same greedy flags, as one process."""
    from distributed import run_gloo_ranks

    from ringray.harness.lm import RingLM

    requests = _requests(built, per_task=1)
    one = _answers(RingLM(pretrained=checkpoint, max_length=LENGTH + 128), requests)
    ring = run_gloo_ranks(2, ring_rank, checkpoint, requests, timeout_seconds=240,
                          collective_timeout_seconds=120)
    assert ring[1] > 0
    assert ring[0]["generate"] == one["generate"]
    assert len(set(one["generate"])) > 1  # the prompts differ, and so do the answers
    torch.testing.assert_close(
        torch.tensor([ll for ll, _ in ring[0]["loglikelihood"]], dtype=torch.float64),
        torch.tensor([ll for ll, _ in one["loglikelihood"]], dtype=torch.float64), **TOL)
    assert [g for _, g in ring[0]["loglikelihood"]] == [g for _, g in one["loglikelihood"]]


# ---------------------------------------------------------------------- ringray eval

def test_eval_on_a_checkpoint_writes_json_and_table(built: dict, checkpoint: str,
                                                    tmp_path: Path, no_network: list,
                                                    monkeypatch) -> None:
    """``ringray eval DIR`` with the network off: a line for the essay task it skips, the
    table on stdout, results.json with a cell per task and length (score, samples, seconds),
    samples.jsonl with each sample's answer, under ./eval-NAME by default; the responses are
    the cp=1 model's on the same prompts."""
    monkeypatch.chdir(tmp_path)
    result = _eval(checkpoint, "--tasks", "niah_single_1,niah_single_2,ringray_passkey",
                   "--lengths", str(LENGTH), "--limit", "2", "--max-gen-toks", "4")
    assert result.exit_code == 0, result.output
    assert "skipped niah_single_2: it downloads Paul Graham's essays" in result.output
    out = tmp_path / f"eval-{Path(checkpoint).name}"
    results = json.loads((out / "results.json").read_text())
    assert [(c["task"], c["length"], c["samples"]) for c in results["cells"]] == [
        ("niah_single_1", LENGTH, 2), ("ringray_passkey", LENGTH, 2)]
    assert all(0.0 <= c["score"] <= 1.0 and c["seconds"] > 0 for c in results["cells"])
    assert results["settings"]["gen_kwargs"] == {"max_gen_toks": 4}
    assert results["skipped"] == [line for line in result.output.splitlines()
                                  if line.startswith("skipped ")]
    rows = {line.split()[0]: line for line in result.output.splitlines()}
    assert rows["task"].split() == ["task", str(LENGTH)]
    assert "niah_single_1" in rows and "ringray_passkey" in rows
    records = [json.loads(line) for line in (out / "samples.jsonl").open()]
    assert [r["task"] for r in records] == ["niah_single_1"] * 2 + ["ringray_passkey"] * 2
    assert all(isinstance(r["response"], str) for r in records[:2])
    assert all("loglikelihood" in r and r["score"] == float(r["greedy"]) for r in records[2:])
    assert "first request" in result.output and "elapsed" in result.output
    requests = _requests(built, max_gen_toks=4)
    from ringray.harness.lm import RingLM

    one = _answers(RingLM(pretrained=checkpoint, max_length=LENGTH + 128),
                   {"generate": requests["generate"][:2],
                    "loglikelihood": requests["loglikelihood"][:2]})
    assert [r["response"] for r in records[:2]] == one["generate"]
    assert [r["loglikelihood"] for r in records[2:]] == pytest.approx(
        [ll for ll, _ in one["loglikelihood"]], abs=1e-4)


def _run_dir(tmp_path: Path, *overrides: str) -> Path:
    """A run directory of the quickstart job (debug preset, byte tokenizer, trained at 2048
    tokens; ``overrides``: more job-file fields) holding a checkpoint of random weights at
    step 2."""
    from ringray.model import Transformer
    from ringray.spec import load_job_spec
    from ringray.spec.run_spec import write_run_spec
    from ringray.train import CheckpointStore

    run_dir = tmp_path / "run"
    spec = load_job_spec(ROOT / "jobs/quickstart.yaml",
                         [f"run_dir={run_dir}", "train.seq_len=2048", *overrides],
                         check_paths=False)
    options = spec.train_options()
    torch.manual_seed(0)
    weights = {k: v.detach() for k, v in Transformer(options.model).named_parameters()}
    store = CheckpointStore(options.checkpoint_location, lineage="run")
    store.save(2, {"model": weights}, keep=3, extra={"model_config": options.model.to_dict()})
    write_run_spec(spec, run_dir=str(run_dir))
    return run_dir


def test_eval_on_a_run_directory(tmp_path: Path, no_network: list, monkeypatch) -> None:
    """``ringray eval RUN``: its newest checkpoint exported (and removed after), results
    under RUN/eval; ruler_vt refused before any cell runs, since with the run's byte-level
    tokenizer lm_eval's generator would never return; a length past the 2048 positions the
    run trained at is refused naming the flags."""
    monkeypatch.chdir(ROOT)
    run_dir = _run_dir(tmp_path)
    result = _eval(str(run_dir), "--tasks", "ringray_passkey,niah_multikey_3", "--lengths",
                   str(LENGTH), "--limit", "1", "--max-gen-toks", "3")
    assert result.exit_code == 0, result.output
    assert "exported step 2" in result.output
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert results["model"]["step"] == 2 and results["model"]["run"] == str(run_dir.resolve())
    assert [(c["task"], c["samples"]) for c in results["cells"]] == [
        ("ringray_passkey", 1), ("niah_multikey_3", 1)]
    assert not Path(results["model"]["pretrained"]).exists()  # the export is gone

    result = _eval(str(run_dir), "--tasks", "ringray_passkey,ruler_vt", "--lengths",
                   str(LENGTH), "--limit", "1", "--out", str(tmp_path / "vt"))
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: ruler_vt: lm_eval's generator would never return with "
                           "this tokenizer"), line
    assert not (tmp_path / "vt" / "results.json").exists()  # no cell ran

    result = _eval(str(run_dir), "--lengths", "4096")
    line = _one_line(result.output)
    assert result.exit_code == 2
    assert line.startswith("error: --lengths: 4096 is past the run's position limit (2048)")
    assert "--rope-scaling yarn --rope-factor 2" in line


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bad_input_is_one_line(checkpoint: str, tmp_path: Path, monkeypatch) -> None:
    """Refused before anything starts, one line and exit code 2 each."""
    cases = [
        (["--tasks", "niah_single_9"],
         "error: --tasks: 'niah_single_9' is not a task that runs offline; valid: "
         "niah_single_1, niah_multikey_2, niah_multikey_3, ringray_niah_multivalue"),
        (["--lengths", "4096"],
         f"error: --lengths: 4096 is past the model's max_position_embeddings ({POSITIONS}), "
         f"read from {checkpoint}/config.json, and no RoPE scaling is set; pass "
         f"--rope-scaling yarn --rope-factor 2 (or a length up to {POSITIONS})"),
        (["--lengths", "8192", "--rope-scaling", "yarn", "--rope-factor", "2"],
         f"error: --lengths: 8192 is past 4096 ({POSITIONS} x --rope-factor 2); raise "
         f"--rope-factor or give a length up to 4096"),
        (["--rope-factor", "2"], "error: --rope-factor: needs --rope-scaling"),
        (["--lengths", "512"], "error: --lengths: 512 is below 1024"),
        (["--lengths", "4k"], "error: --lengths: '4k' is not a whole number of tokens"),
        (["--accelerator", "tpu", "--address", "auto"],
         "error: --accelerator: 'tpu' is not cpu or gpu"),
        (["--accelerator", "gpu"], "error: --accelerator: only with --address"),
        (["--address", f"127.0.0.1:{_free_port()}", "--lengths", str(LENGTH)],
         "error: --address 127.0.0.1:"),  # nothing answers there: before any export
    ]
    for args, start in cases:
        result = _eval(checkpoint, *args, "--out", str(tmp_path / "out"))
        assert result.exit_code == 2, (args, result.output)
        line = _one_line(result.output)
        assert line.startswith(start), (args, line)
    assert not (tmp_path / "out").exists()

    result = _eval(checkpoint, "--tasks", "niah_single_2,ruler_qa_squad")
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[:2] == [
        "skipped niah_single_2: it downloads Paul Graham's essays (the Hugging Face dataset "
        "baber/paul_graham_essays)",
        "skipped ruler_qa_squad: it downloads SQuAD v2 (rajpurkar.github.io)"]
    assert lines[2].startswith("error: --tasks: nothing left to run offline; valid: ")

    result = _eval(str(tmp_path), "--tasks", "ruler_vt")
    assert result.exit_code == 2
    assert _one_line(result.output).startswith(
        f"error: RUN_OR_MODEL: '{tmp_path}' is neither a run directory (job.yaml) nor")

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails
    result = _eval(checkpoint)
    assert result.exit_code == 2
    assert _one_line(result.output) == (
        "error: lm_eval not installed: ringray eval runs RULER with lm_eval; pip install "
        "'ringray[eval]'")


def test_a_model_extended_by_its_own_rope_scaling_is_judged_by_it(
        checkpoint: str, tmp_path: Path, monkeypatch) -> None:
    """A checkpoint whose config.json has YaRN x2 over its 2048 positions (as an export of an
    extension run keeps them: the pretrained max_position_embeddings beside the scaling), and
    a run trained with ``model.rope`` YaRN x2: both may be evaluated at 4096 without
    ``--rope-scaling``, and 8192 is refused naming the model's own factor. They were refused
    at 4096 as if unscaled. (An unreachable ``--address``, checked after the lengths, ends
    each accepted command before anything runs.)"""
    import shutil

    extended = tmp_path / "extended"
    shutil.copytree(checkpoint, extended)
    config = json.loads((extended / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": POSITIONS}
    config["rope_scaling"] = yarn  # transformers 4's name, and 5's (below): both, as exported
    config["rope_parameters"] = {**config.get("rope_parameters", {}), **yarn}
    (extended / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(ROOT)
    run_dir = _run_dir(tmp_path, "model.rope.scaling=yarn", "model.rope.factor=2",
                       f"model.rope.original_max_position_embeddings={POSITIONS}")
    for target in (str(extended), str(run_dir)):
        accepted = _eval(target, "--lengths", "4096", "--address",
                         f"127.0.0.1:{_free_port()}", "--out", str(tmp_path / "out"))
        assert _one_line(accepted.output).startswith("error: --address 127.0.0.1:"), target
        refused = _eval(target, "--lengths", "8192", "--out", str(tmp_path / "out"))
        assert refused.exit_code == 2
        assert _one_line(refused.output).startswith(
            f"error: --lengths: 8192 is past 4096 ({POSITIONS} x the model's yarn rope "
            f"factor 2)"), target


@pytest.mark.slow
def test_every_task_on_a_byte_level_run(tmp_path: Path, no_network: list,
                                        monkeypatch) -> None:
    """``ringray eval RUN`` with the default tasks (all) on a run of ringray's byte-level
    preset: ruler_vt is skipped with a line (lm_eval's generator would never return), every
    other task that builds at 1024 runs, and the skipped cells are in results.json."""
    monkeypatch.chdir(ROOT)
    run_dir = _run_dir(tmp_path)
    result = _eval(str(run_dir), "--lengths", str(LENGTH), "--limit", "1", "--max-gen-toks",
                   "2")
    assert result.exit_code == 0, result.output
    assert "skipped ruler_vt: lm_eval's generator would never return" in result.output
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    ran = {cell["task"] for cell in results["cells"]}
    skipped = {line.split()[1].rstrip(":") for line in results["skipped"]}
    assert "ruler_vt" in skipped and "ruler_vt" not in ran
    assert ran | skipped == set(results["tasks"])
    assert {"niah_single_1", "ringray_passkey"} <= ran


@pytest.mark.slow
def test_eval_over_a_ring_equals_one_process(checkpoint: str, tmp_path: Path) -> None:
    """``ringray eval --cp 2`` (the launcher's processes; rank 0 builds the data and runs
    lm_eval) writes the samples a cp=1 run writes: the same prompts, generations, greedy
    flags, and log-likelihoods within float32 rounding."""
    runs = {}
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}"
        result = _eval(checkpoint, "--tasks", "niah_multikey_2,ruler_fwe,ringray_passkey",
                       "--lengths", str(LENGTH), "--limit", "2", "--max-gen-toks", "5",
                       "--cp", str(cp), "--out", str(out))
        assert result.exit_code == 0, result.output
        runs[cp] = [json.loads(line) for line in (out / "samples.jsonl").open()]
    for one, ring in zip(runs[1], runs[2], strict=True):
        assert one.pop("loglikelihood", 0.0) == pytest.approx(ring.pop("loglikelihood", 0.0),
                                                              abs=1e-4)
        assert one == ring


# ---------------------------------------------------------------------- inside a job

def test_a_job_file_names_only_tasks_it_can_run(tmp_path: Path, monkeypatch) -> None:
    """The ``eval`` section's tasks are refused before anything starts, one line each,
    naming the field: an unknown task, one that downloads, lengths past the trained model's
    positions (with the RoPE setting to change), tasks without lengths and lengths without
    tasks, ruler_vt with the preset's byte-level tokenizer, lm_eval missing."""
    from ringray.spec import JobSpecError, load_job_spec

    monkeypatch.chdir(ROOT)

    def refusal(*sets: str) -> str:
        overrides = [f"run_dir={tmp_path / 'run'}", "train.seq_len=2048", *sets]
        with pytest.raises(JobSpecError) as caught:
            load_job_spec("jobs/quickstart.yaml", overrides)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert refusal("eval.tasks=[niah_single_9]", "eval.task_lengths=[1024]").startswith(
        "eval.tasks: 'niah_single_9' is not a task that runs offline; valid: niah_single_1, ")
    assert refusal("eval.tasks=[niah_single_2]", "eval.task_lengths=[1024]").startswith(
        "eval.tasks: niah_single_2 downloads Paul Graham's essays")
    assert refusal("eval.tasks=[niah_single_1]", "eval.task_lengths=[8192]") == (
        "eval.task_lengths: 8192 is past the trained model's position limit 2048 "
        "(train.seq_len 2048); set model.rope.scaling: yarn with model.rope.factor: 4, or "
        "give lengths up to 2048")
    assert "eval.task_lengths: [] gives tasks ['niah_single_1'] no length" in refusal(
        "eval.tasks=[niah_single_1]")
    assert "eval.tasks: [] gives task_lengths nothing to run" in refusal(
        "eval.task_lengths=[1024]")
    assert refusal("eval.tasks=[ruler_vt]", "eval.task_lengths=[1024]").startswith(
        "eval.tasks: ruler_vt: lm_eval's generator would never return with this tokenizer")
    load_job_spec("jobs/quickstart.yaml", [f"run_dir={tmp_path / 'run'}", "train.seq_len=2048",
                                           "eval.tasks=[niah_single_1, ringray_passkey]",
                                           "eval.task_lengths=[1024, 2048]"])
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert refusal("eval.tasks=[niah_single_1]", "eval.task_lengths=[1024]") == (
        "eval.tasks: lm_eval not installed: the job's evaluation runs them with lm_eval; "
        "pip install 'ringray[eval]'")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_evaluates_its_tasks_after_training(tmp_path: Path) -> None:
    """``ringray train`` with ``eval.tasks``: after the final checkpoint the job's two
    workers are one ring for lm_eval (rank 0 exports the checkpoint and builds the data, the
    other serves its forwards); RUN/eval holds results.json (a cell per task and length, on
    the final step), samples.jsonl and lm_eval.log; the events name each score; the
    temporary export beside the checkpoints is gone; ``ringray report`` plots the scores.
    With ``tasks_at_checkpoints`` the step-1 checkpoint is evaluated too (RUN/eval/step_1).
    A task the job cannot run is refused before anything starts."""
    import subprocess

    ringray = str(Path(sys.executable).parent / "ringray")
    run_dir = tmp_path / "run"
    job = [ringray, "train", "jobs/quickstart.yaml", "--steps", "2", "--set", "name=tasks",
           "--set", f"run_dir={run_dir}", "--set", f"train.seq_len={LENGTH}",
           "--set", "parallel.cp=2", "--set", "eval.passkey_lengths=[]",
           "--set", "eval.tasks=[ringray_passkey,niah_multikey_3]",
           "--set", f"eval.task_lengths=[{LENGTH}]", "--set", "eval.task_samples=1",
           "--set", "checkpoint.interval=1", "--set", "eval.tasks_at_checkpoints=true",
           "--set", "eval.task_max_gen_toks=3"]
    done = subprocess.run(job, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert results["model"]["step"] == 2 and results["settings"]["cp"] == 2
    assert [(c["task"], c["length"], c["samples"]) for c in results["cells"]] == [
        ("ringray_passkey", LENGTH, 1), ("niah_multikey_3", LENGTH, 1)]
    samples = (run_dir / "eval" / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["task"] for line in samples] == ["ringray_passkey",
                                                              "niah_multikey_3"]
    assert (run_dir / "eval" / "lm_eval.log").is_file()
    events = [json.loads(line)["message"]
              for line in (run_dir / "events.jsonl").read_text().splitlines()]
    scores = [e for e in events if e.startswith("lm_eval tasks: ")]
    assert len(scores) == 2 and f"ringray_passkey @ {LENGTH}: " in scores[1], events
    at_step_1 = json.loads((run_dir / "eval" / "step_00000001" / "results.json").read_text())
    assert at_step_1["model"]["step"] == 1 and len(at_step_1["cells"]) == 2
    assert [p.name for p in (run_dir / "checkpoints").iterdir()
            if p.name.startswith(".ringray-eval-export-")] == []

    report = subprocess.run([ringray, "report", str(run_dir)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert str(run_dir / "report" / "tasks.png") in report.stdout.split()

    refused = subprocess.run([*job[:-4], "--set", "eval.tasks=[ruler_vt]"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "error: eval.tasks: ruler_vt: lm_eval's generator would never return"), refused.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eval_on_ray_workers_equals_one_process(checkpoint: str, tmp_path: Path,
                                                local_cluster) -> None:
    """``ringray eval --address`` (a separate process, as a user runs it): the ring is two
    Ray workers of the cluster, placed as a job's are (the head has no worker slots, so they
    land on the node added here); rank 0's progress is drawn by the command (its first
    request's line comes through); the samples equal a local cp=1 run's, with log-likelihoods
    within float32 rounding. A run directory's checkpoint is exported beside the checkpoints
    and removed after. No placement group or worker actor is left."""
    import subprocess
    import time

    local_cluster.add_node("eval_ray", slots=2)
    args = ["--tasks", "niah_multikey_2,ringray_passkey", "--lengths", str(LENGTH),
            "--limit", "2", "--max-gen-toks", "5"]
    one = _eval(checkpoint, *args, "--out", str(tmp_path / "one"))
    assert one.exit_code == 0, one.output
    ringray = str(Path(sys.executable).parent / "ringray")
    done = subprocess.run([ringray, "eval", checkpoint, *args, "--cp", "2", "--address",
                           local_cluster.cluster.address, "--out", str(tmp_path / "ray")],
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "placed a ring of 2 on 1 node(s)" in done.stderr
    assert "first request (niah_multikey_2 @ 1024)" in done.stderr, done.stderr
    assert "ringray_passkey @ 1024: " in done.stderr
    results = json.loads((tmp_path / "ray" / "results.json").read_text())
    assert results["settings"]["cp"] == 2
    samples = {name: [json.loads(line) for line in (tmp_path / name / "samples.jsonl").open()]
               for name in ("one", "ray")}
    assert len(samples["ray"]) == 4
    for a, b in zip(samples["one"], samples["ray"], strict=True):
        assert a.pop("loglikelihood", 0.0) == pytest.approx(b.pop("loglikelihood", 0.0),
                                                            abs=1e-4)
        assert a == b
    # A run directory: its newest checkpoint exported beside the checkpoints (every node
    # reads them), removed after; the results in RUN/eval.
    run_dir = _run_dir(tmp_path)
    done = subprocess.run([ringray, "eval", str(run_dir), "--tasks", "ringray_passkey",
                           "--lengths", str(LENGTH), "--limit", "1", "--cp", "2",
                           "--address", local_cluster.cluster.address],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert results["model"]["step"] == 2 and results["settings"]["cp"] == 2
    assert [p.name for p in (run_dir / "checkpoints").iterdir()
            if p.name.startswith(".ringray-eval-export-")] == []

    from ray_leftovers import leftovers

    left = leftovers()
    for _ in range(50):  # the GCS marks a killed actor dead within moments
        if left == {"actors": [], "placement_groups": []}:
            break
        time.sleep(0.2)
        left = leftovers()
    assert left == {"actors": [], "placement_groups": []}


def test_the_time_estimate_weighs_attention_by_the_models_shape(tmp_path: Path) -> None:
    """The progress bar's weights: a forward's time grows with the square of the length past
    the length where attention costs what the rest of a layer does. SmolLM2-135M's shape
    (576 wide, 9 heads of 64, 3 KV heads, 1536 MLP): 6144 tokens; a sample there weighs twice
    its linear share; without the fields the weights stay linear."""
    from ringray.harness.ruler import attention_even_length, weight

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576,
              "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
              "num_hidden_layers": 30, "vocab_size": 49152, "max_position_embeddings": 8192,
              "rope_theta": 100000.0, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    even = attention_even_length(str(tmp_path))
    assert even == 6144
    assert weight("ringray_passkey", even, even=even) == 2 * weight("ringray_passkey", even)
    assert weight("ringray_passkey", 4096) == 4096  # a loglikelihood task: one forward
    del config["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert attention_even_length(str(tmp_path)) is None
