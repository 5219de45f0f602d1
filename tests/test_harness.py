"""lm_eval's ``ringray`` model (ringray.harness) against lm_eval's own ``hf`` model.

A tiny random Llama checkpoint is saved locally with transformers (nothing downloaded), with
a byte-level BPE tokenizer that adds BOS (so the prefix-token and BOS-prefix paths run) and
a context length of 64 tokens (so long contexts are cut from the left and rolling windows
split). The same requests go to:

- ``hf`` (lm_eval's HFLM, transformers' model) and ``ringray`` with cp=1: per-request
  log-likelihoods, greedy flags, rolling log-likelihoods and greedy generations;
- real gloo rings of 3 ranks (zigzag, an odd ring: no request length is a multiple of its
  6), called directly, and of 2 ranks (striped) under lm_eval's own evaluator on two local
  tasks (per-request answers read back from its logged samples): the same as cp=1;
- the KV cache (``ringray.harness.kv_cache``): at cp=1 and over a gloo ring of 3 ranks, each
  cached decode step's logits equal a full forward's at that position (rows of different
  lengths, one layer with a sliding window), and ``generate_until`` gives the same texts
  with ``kv_cache=false`` (the whole prefix re-run for every token); the tests above run
  with the cache on (the default);
- (``slow``) ``python -m ringray.harness --cp 2`` with lm_eval's command line, and a ring
  whose rank 0 fails: the launcher exits with an error instead of waiting. The command line
  indexes every task lm_eval ships before it starts (~15 s on a quiet 2-core machine), which
  is why these two are left to ``make test-all``.

Tolerance: ``atol=1e-4, rtol=1e-6`` on summed log-probabilities. Both sides compute the
same float32 arithmetic in different orders (fused sdpa against ring blocks merged by their
log-sum-exp; other matmul shapes for a batch), so a token's log-probability (magnitude ~5
here) agrees to about 1e-6 relative, and a request sums up to ~200 of them. Any mistake in
which positions are scored, in the padding, the truncation or the ring moves a sum by
whole units. Greedy flags and generated text must be equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    find_spec("lm_eval") is None or find_spec("transformers") is None,
    reason="needs the eval extra (lm_eval) and transformers")

TOL = {"atol": 1e-4, "rtol": 1e-6}
CONTEXT = 64  # the checkpoint's max_position_embeddings: hf's max_length

LOGLIKELIHOOD = [
    ("The grass is", " green."),
    ("12345 is", " 345"),           # multi-digit merges at the split
    ("", "hello world"),            # empty context: the prefix token
    ("abc ", "def"),                # the context's trailing space moves to the continuation
    ("The sky is blue. " * 6, "And the sun is yellow."),  # longer than 64 tokens: cut
    ("The grass is", " g"),         # the same input as the next: one forward for both
    ("The grass is", " b"),
]
ROLLING = ["The pass key is 12345. Remember it. " * 5, "short"]
GENERATE = [
    ("The grass is", {"until": ["."], "max_gen_toks": 12}),
    ("12 34 345", {"until": ["\n\n"], "max_gen_toks": 9, "do_sample": False}),
    ("Here we go.", {"until": [], "max_gen_toks": 5, "temperature": 0.0}),
]
GREEDY_CONTEXTS = ["The grass", "The sky is", "Here we", "There and back", "12 34",
                   "Remember it", "The pass key", "again and", "sun is yel", "abc"]


def save_checkpoint(path: Path) -> None:
    """A random 2-layer Llama (GQA, untied) and a byte-level BPE that prepends BOS."""
    from hf_cases import save_tiny_llama, tiny_tokenizer

    save_tiny_llama(path, tiny_tokenizer(), positions=CONTEXT)


def instances(kind: str, arguments: list) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a if isinstance(a, tuple) else (a,),
                     idx=i) for i, a in enumerate(arguments)]


def run_requests(lm, requests: dict) -> dict:
    """Every kind of request through ``lm``: plain Python results."""
    return {
        "loglikelihood": lm.loglikelihood(instances("loglikelihood", requests["ll"]),
                                          disable_tqdm=True),
        "rolling": lm.loglikelihood_rolling(instances("loglikelihood_rolling",
                                                      requests["rolling"]), disable_tqdm=True),
        "generate": lm.generate_until(instances("generate_until", requests["generate"]),
                                      disable_tqdm=True),
    }


def assert_same(ours: dict, theirs: dict) -> None:
    got, want = ours["loglikelihood"], theirs["loglikelihood"]
    torch.testing.assert_close(torch.tensor([x for x, _ in got], dtype=torch.float64),
                               torch.tensor([x for x, _ in want], dtype=torch.float64), **TOL)
    assert [g for _, g in got] == [g for _, g in want]
    torch.testing.assert_close(torch.tensor(ours["rolling"], dtype=torch.float64),
                               torch.tensor(theirs["rolling"], dtype=torch.float64), **TOL)
    assert ours["generate"] == theirs["generate"]


def ring_rank(rank: int, world: int, path: str, requests: dict) -> dict | int:
    """One rank of a gloo ring (``tests/distributed.py``): rank 0 drives the ``ringray``
    model, the others serve its forwards."""
    from ringray.harness.ring import serve

    if rank:
        return serve()
    from ringray.harness.lm import RingLM

    lm = RingLM(pretrained=path, batch_size=2)  # cp: the whole process group
    try:
        assert lm.options.cp == world
        return run_requests(lm, requests)
    finally:
        lm.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("harness") / "ckpt"
    save_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def cases(checkpoint: str) -> dict:
    """The requests, hf's and cp=1's answers. Besides the fixed requests: continuations
    that are the model's own greedy next tokens (printable ones, from hf's generation), so
    that greedy flags are compared where they are true too, and a generation cut by a stop
    string the model does produce."""
    from lm_eval.models.huggingface import HFLM

    from ringray.harness.lm import RingLM

    hf = HFLM(pretrained=checkpoint, device="cpu", dtype="float32", batch_size=1)
    probe = hf.generate_until(instances("generate_until", [
        (context, {"until": [], "max_gen_toks": 1}) for context in GREEDY_CONTEXTS]),
        disable_tqdm=True)
    greedy = [(c, t) for c, t in zip(GREEDY_CONTEXTS, probe, strict=True)
              if t.isascii() and t.strip() and t.isprintable()]
    free = hf.generate_until(instances("generate_until", [
        ("The sky is", {"until": [], "max_gen_toks": 10})]), disable_tqdm=True)[0]
    stops = [c for c in free[2:] if c.isascii() and c.isprintable() and c.strip()]
    generate = GENERATE + ([("The sky is", {"until": [stops[0]], "max_gen_toks": 10})]
                           if stops else [])
    requests = {"ll": LOGLIKELIHOOD + greedy, "rolling": ROLLING, "generate": generate}
    ring = RingLM(pretrained=checkpoint, batch_size=3)
    return {"requests": requests, "hf": run_requests(hf, requests),
            "cp1": run_requests(ring, requests), "ring": ring, "stop_found": bool(stops)}


def test_cp1_equals_hf(cases: dict) -> None:
    """cp=1 (no process group) gives hf's log-likelihoods, greedy flags, rolling sums and
    generations; the greedy flags compared include true ones."""
    assert_same(cases["cp1"], cases["hf"])
    flags = [greedy for _, greedy in cases["hf"]["loglikelihood"]]
    assert any(flags) and not all(flags)
    assert cases["stop_found"]  # a generation stopped by a stop string it produced
    assert len(cases["hf"]["generate"][-1]) < 10
    ring = cases["ring"]
    assert ring.options.cp == 1 and ring.ring.engine.divisor == 2  # zigzag over one rank


def test_model_args_use_the_job_file_names(checkpoint: str) -> None:
    """``--model_args`` as lm_eval parses them: parallel.* and model.rope.* names reach the
    model (the RoPE override changes its config and its numbers); a wrong name is refused
    in one line that lists the valid ones."""
    from lm_eval.utils import simple_parse_args_string

    from ringray.harness.lm import RingLM
    from ringray.harness.options import HarnessOptions

    args = simple_parse_args_string(
        f"pretrained={checkpoint},layout=striped,attention_backend=sdpa,precision=fp32,"
        "rope.scaling=yarn,rope.factor=4,rope.original_max_position_embeddings=16,"
        "max_length=256")
    lm = RingLM(**args)
    options, engine = lm.options, lm.ring.engine
    assert (options.cp, options.layout_kind, lm.max_length) == (1, "striped", 256)
    scaling = engine.config.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_position_embeddings) == (
        "yarn", 4.0, 16)
    request = instances("loglikelihood", [("The grass is", " green.")])
    plain = RingLM(pretrained=checkpoint).loglikelihood(request, disable_tqdm=True)
    assert abs(lm.loglikelihood(request, disable_tqdm=True)[0][0] - plain[0][0]) > 1e-3
    with pytest.raises(ValueError, match=r"^rope\.factr: not a RoPE option; valid: .*rope\.factor"):
        HarnessOptions.from_model_args({"pretrained": checkpoint, "rope.factr": 4})
    with pytest.raises(ValueError, match=r"^ring: not an argument of the ringray model"):
        HarnessOptions.from_model_args({"pretrained": checkpoint, "ring": 2})
    with pytest.raises(ValueError, match=r"^cp: 2 ranks need a process group of 2"):
        RingLM(pretrained=checkpoint, cp=2)


def test_odd_ring_equals_cp1(cases: dict, checkpoint: str) -> None:
    """A real gloo ring of 3 ranks (zigzag, padded to multiples of 6) equals cp=1."""
    from distributed import run_gloo_ranks

    results = run_gloo_ranks(3, ring_rank, checkpoint, cases["requests"],
                             timeout_seconds=240, collective_timeout_seconds=120)
    assert_same(results[0], cases["cp1"])
    assert all(calls > 0 for calls in results[1:])  # the other ranks ran every forward


def write_tasks(directory: Path, loglikelihood: list) -> list[str]:
    """Two lm_eval tasks on local JSON lines: multiple choice (loglikelihood) over the first
    five loglikelihood cases, and greedy generation until ".". Returns their names."""
    choices = directory / "choices.jsonl"
    choices.write_text("".join(json.dumps(
        {"question": context or "Q", "choices": [continuation, " blue", " 12345"],
         "answer": 0}) + "\n" for context, continuation in loglikelihood[:5]))
    prompts = directory / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": context, "answer": ""}) + "\n"
                               for context in ("The sky is", "12 34 345")))
    common = "test_split: test\ndataset_path: json\ndoc_to_text: '{{question}}'\n"
    (directory / "rr_choice.yaml").write_text(
        f"task: rr_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {choices}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (directory / "rr_gen.yaml").write_text(
        f"task: rr_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {prompts}\n"
        "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return ["rr_choice", "rr_gen"]


def logged_answers(samples: dict[str, list[dict]]) -> dict:
    """lm_eval's logged samples as ``{"ll": [((context, continuation), (logprob, greedy))],
    "generate": [((context, gen_kwargs), text)]}``."""
    def arguments(sample: dict) -> list[tuple]:  # a list in memory, {"gen_args_N": ...} on disk
        found = sample["arguments"]
        found = found.values() if isinstance(found, dict) else found
        return [tuple(a.values()) if isinstance(a, dict) else tuple(a) for a in found]

    ll = [(args, (float(resp[0][0]), str(resp[0][1]) == "True"))
          for sample in samples["rr_choice"]
          for args, resp in zip(arguments(sample), sample["resps"], strict=True)]
    generate = [(arguments(sample)[0], sample["resps"][0][0]) for sample in samples["rr_gen"]]
    return {"ll": ll, "generate": generate}


def assert_logged_equal_cp1(answers: dict, ring) -> None:
    """What lm_eval logged equals the cp=1 model's answers to the same arguments."""
    assert answers["ll"] and answers["generate"]
    want = ring.loglikelihood(instances("loglikelihood", [a for a, _ in answers["ll"]]),
                              disable_tqdm=True)
    torch.testing.assert_close(
        torch.tensor([logprob for _, (logprob, _) in answers["ll"]], dtype=torch.float64),
        torch.tensor([logprob for logprob, _ in want], dtype=torch.float64), **TOL)
    assert [greedy for _, (_, greedy) in answers["ll"]] == [greedy for _, greedy in want]
    texts = ring.generate_until(instances("generate_until", [a for a, _ in answers["generate"]]),
                                disable_tqdm=True)
    assert [text for _, text in answers["generate"]] == texts


def evaluator_rank(rank: int, world: int, path: str, task_dir: str) -> dict | int:
    """One rank of a gloo ring under lm_eval's evaluator: rank 0 runs ``simple_evaluate``
    with the ``ringray`` model on the local tasks and returns the logged answers."""
    from ringray.harness.ring import serve, stop_followers

    if rank:
        return serve()
    import lm_eval
    from lm_eval.tasks import TaskManager

    import ringray.harness.lm  # noqa: F401 - registers "ringray"

    try:
        results = lm_eval.simple_evaluate(
            model="ringray", model_args=f"pretrained={path},layout=striped",
            tasks=["rr_choice", "rr_gen"], batch_size=2, log_samples=True,
            task_manager=TaskManager(include_path=task_dir, include_defaults=False))
    finally:
        stop_followers()
    return logged_answers(results["samples"])


def test_lm_eval_evaluator_over_ring_equals_cp1(cases: dict, checkpoint: str,
                                                tmp_path: Path) -> None:
    """lm_eval's evaluator drives the registered ``ringray`` model over a striped ring of 2
    gloo ranks: the per-request answers it logs equal cp=1's."""
    from distributed import run_gloo_ranks

    write_tasks(tmp_path, cases["requests"]["ll"])
    results = run_gloo_ranks(2, evaluator_rank, checkpoint, str(tmp_path),
                             timeout_seconds=240, collective_timeout_seconds=120)
    assert results[1] > 0
    assert_logged_equal_cp1(results[0], cases["ring"])


def launch(arguments: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ringray.harness", *arguments], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_launcher_command_line_equals_cp1(cases: dict, checkpoint: str,
                                          tmp_path: Path) -> None:
    """``python -m ringray.harness --cp 2 -- <lm_eval's command line>`` runs the tasks over
    a ring of 2 processes it starts; the answers lm_eval logs equal cp=1's and every rank
    leaves when lm_eval is done (the command returns 0)."""
    tasks = write_tasks(tmp_path, cases["requests"]["ll"])
    out = tmp_path / "out"
    done = launch(["--cp", "2", "--threads", "1", "--timeout", "120", "--", "--model",
                   "ringray", "--model_args", f"pretrained={checkpoint},layout=striped",
                   "--batch_size", "2", "--tasks", ",".join(tasks), "--include_path",
                   str(tmp_path), "--output_path", str(out), "--log_samples"])
    assert done.returncode == 0, done.stderr[-3000:]
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = next(t for t in tasks if path.name.startswith(f"samples_{t}_"))
        samples[task] = [json.loads(line) for line in path.open()]
    assert set(samples) == set(tasks)
    assert_logged_equal_cp1(logged_answers(samples), cases["ring"])


@pytest.mark.slow
def test_launcher_failing_rank_stops_the_ring(checkpoint: str, tmp_path: Path) -> None:
    """Rank 0 fails (a checkpoint that is not there) while the other rank waits for its
    first call: the other rank sees the connection close, the launcher exits non-zero at
    once, well inside the timeouts it was given (an hour each)."""
    tasks = write_tasks(tmp_path, LOGLIKELIHOOD)
    done = launch(["--cp", "2", "--threads", "1", "--timeout", "3600", "--idle-timeout",
                   "3600", "--", "--model", "ringray", "--model_args",
                   f"pretrained={tmp_path / 'missing'}", "--tasks", ",".join(tasks),
                   "--include_path", str(tmp_path)], timeout=240)
    assert done.returncode != 0
    assert "pretrained:" in done.stderr and "is not a directory" in done.stderr


DECODE_LENGTHS = (13, 7, 19)  # rows of different lengths; 19 pads to 20 (cp=1), 24 (cp=3)
DECODE_STEPS = 6
DECODE_WINDOW = 5  # layer 0's sliding window: cuts both the prompt and the generated tail


def cached_decode(rank: int, world: int, path: str, prompts: torch.Tensor,
                  lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank (or, with ``world`` 1, the only process) of a ring engine that prefills the
    right-padded ``prompts`` and decodes ``DECODE_STEPS`` greedy tokens from the cache, with
    a sliding window on layer 0: the prefill's next tokens ``(rows,)`` and each step's
    logits ``(rows, steps, vocab)``."""
    from ringray.harness.options import HarnessOptions
    from ringray.harness.ring import RingEngine

    engine = RingEngine(HarnessOptions(pretrained=path, cp=world, device="cpu"))
    engine.model.layers[0].attention.window = DECODE_WINDOW
    first = engine.prefill(prompts, lengths)
    chosen, steps = first, []
    for _ in range(DECODE_STEPS):
        logits = engine.decode_logits(chosen)
        steps.append(logits)
        chosen = logits.argmax(dim=-1)
    return first, torch.stack(steps, dim=1)


@pytest.mark.parametrize("world", [1, 3])
def test_cached_decode_equals_full_forward(checkpoint: str, world: int) -> None:
    """The KV cache's decode (cp=1, and a gloo ring of 3 ranks whose zigzag layout splits
    no row's length, one row too short to reach the last rank) gives at every step the
    float32 logits a full forward of the whole sequence gives at that position, to 1e-5,
    with a sliding window on one layer. (This tiny model's float32 noise is near that: the
    padded ring forward itself differs from a plain one by up to 9e-6 on logits up to 7;
    the cache's largest gap was 5e-6 at cp=1 and 7.5e-6 over 3 ranks.)"""
    from distributed import run_gloo_ranks

    from ringray.harness.options import HarnessOptions
    from ringray.harness.ring import load_model

    model = load_model(HarnessOptions(pretrained=checkpoint), torch.device("cpu"))
    model.layers[0].attention.window = DECODE_WINDOW
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor(DECODE_LENGTHS)
    prompts = torch.randint(0, model.config.vocab_size, (len(lengths), int(lengths.max())),
                            generator=generator)
    prompts[torch.arange(prompts.shape[1]) >= lengths[:, None]] = 0  # right padding
    if world == 1:
        first, steps = cached_decode(0, 1, checkpoint, prompts, lengths)
    else:
        results = run_gloo_ranks(world, cached_decode, checkpoint, prompts, lengths,
                                 timeout_seconds=240, collective_timeout_seconds=120)
        first, steps = results[0]
        for other in results[1:]:  # every rank has the same tokens and logits
            assert torch.equal(other[0], first)
            torch.testing.assert_close(other[1], steps, rtol=0, atol=1e-6)
    for row, length in enumerate(DECODE_LENGTHS):
        fed = [int(first[row]), *steps[row, :-1].argmax(dim=-1).tolist()]
        sequence = torch.cat((prompts[row, :length], torch.tensor(fed)))
        with torch.no_grad():
            full = model(sequence[None])[0]
        assert int(full[length - 1].argmax()) == int(first[row])
        torch.testing.assert_close(steps[row], full[length:], rtol=0, atol=1e-5)


def test_generate_with_and_without_kv_cache(cases: dict, checkpoint: str) -> None:
    """generate_until gives the same texts decoding from the KV cache (the default) as
    re-running the whole prefix for every token (``kv_cache=false``), in batches whose rows
    stop at different steps (EOS, stop strings, max_gen_toks, a total max_length that
    leaves one row no token at all)."""
    from lm_eval.utils import simple_parse_args_string

    from ringray.harness.lm import RingLM

    stopping = {"until": ["34"], "max_gen_toks": 30}  # one batch: rows stop at other steps
    total = {"until": [], "max_gen_toks": 20, "max_length": 12}
    requests = cases["requests"]["generate"] + [
        (context, stopping) for context in ("The pass key is 12345. Remember it.", "12 34",
                                            "The sky", "Here we go again", "abc")] + [
        ("The grass is green. The sky is blue.", total), ("abc", total)]
    plain = RingLM(**simple_parse_args_string(f"pretrained={checkpoint},kv_cache=false"),
                   batch_size=3)
    assert not plain.options.kv_cache and cases["ring"].options.kv_cache
    want = plain.generate_until(instances("generate_until", requests), disable_tqdm=True)
    got = cases["ring"].generate_until(instances("generate_until", requests), disable_tqdm=True)
    assert got == want
    batch = sorted(len(text) for text in got[-7:-2])
    assert batch[0] < 15 and batch[-1] > 20  # rows of one batch stopped at other steps
    assert got[-2] == "" and got[-1]  # no room left under max_length, and some
