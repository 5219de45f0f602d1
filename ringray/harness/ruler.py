"""RULER's synthetic long-context tasks with nothing downloaded: which tasks, their data.

    tasks, skipped = select_tasks(["niah_single_1", "niah_single_2", "ruler_vt"])
    # tasks: ["niah_single_1", "ruler_vt"]; skipped: ["niah_single_2: ...essays..."]
    task = build_task("ruler_vt", 4096, pretrained="ckpt/")   # an lm_eval Task, data built

lm_eval 0.4.13 ships RULER's 13 tasks (``lm_eval/tasks/ruler``). Every one is greedy
``generate_until``, and builds its data when the task is built (``custom_dataset``): 500
samples for each length of the metadata's ``max_seq_lengths``, sized with the model's own
tokenizer. What each needs:

- the needle tasks import ``prepare_niah``, which asks nltk for its ``punkt_tab`` sentence
  splitter over the network when imported. Offline the request fails at once, prints an
  error and returns (nothing raises), and only the essay haystack ever splits sentences, so
  the tasks below build without it;
- ``niah_single_1`` (haystack: one filler paragraph repeated), ``niah_multikey_2`` and
  ``niah_multikey_3`` (haystack: needle-shaped distractors), ``ruler_vt``, ``ruler_cwe`` and
  ``ruler_fwe`` need nothing else: they run as lm_eval defines them, by name;
- ``niah_single_2``, ``niah_single_3``, ``niah_multikey_1``, ``niah_multivalue`` and
  ``niah_multiquery`` download Paul Graham's essays (a Hugging Face dataset) for their
  haystack; ``ruler_qa_squad`` and ``ruler_qa_hotpot`` download SQuAD and HotpotQA. Their
  generators take no argument that chooses another haystack (``niah_utils`` names
  ``type_haystack="essay"`` in the code), so they are skipped, one line each.

Two tasks here stand in for the multi-value and multi-query needles: ``ringray_niah_multivalue``
and ``ringray_niah_multiquery`` are lm_eval's ``niah_multivalue`` and ``niah_multiquery``
(four values of one key; four keys asked at once) with ``niah_single_1``'s repeated filler as
the haystack instead of the essays. Everything else is lm_eval's own: its
``niah_single_1.yaml`` configuration (prompt, answer prefix, greedy generation of up to 128
tokens, scoring) loaded at run time, its sample generator and template. Since the filler
repeats, finding the needles is easier than among essays, as ``niah_single_1`` is easier than
``niah_single_2``. And ``ringray_passkey`` is ringray's own passkey prompt
(:mod:`ringray.data.passkey`) as an lm_eval ``loglikelihood`` task: the score is whether every
answer token is the model's argmax (the passkey evaluation's teacher-forced exact match).

These three are lm_eval task configurations written in Python (:func:`task_spec`, passed to
``TaskManager.load`` / ``simple_evaluate`` as dicts), not YAML files: the package ships no data
files, and a dict is what lm_eval builds from a YAML file anyway.

Determinism: a cell's data depends only on (task, length, tokenizer). :func:`build_task` seeds
Python's, numpy's and torch's generators as ``simple_evaluate`` does before it builds tasks,
and reloads ``cwe_utils``, whose module-level ``random.Random(42)`` lm_eval's loader would
otherwise carry from one build to the next; so a cell's samples are those that
``lm_eval --tasks T --metadata '{"max_seq_lengths": [L]}'`` makes in a fresh process.

Two guards against lm_eval's generators, which loop forever where a prompt cannot fit:
``ruler_vt`` builds an in-context example that must fit 500 tokens whatever the length (with a
byte-level tokenizer it never does), and every generator needs room for its template, so
:func:`check_buildable` refuses, in one line, a cell that would never finish building, and
:func:`build_task` one whose answers came out empty (``ruler_cwe`` at a length that holds no
word list).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

MIN_LENGTH = 1024
"""The shortest length evaluated: below it RULER's templates leave no room for a haystack
(and some of lm_eval's generators never return)."""

GENERATION_ROOM = 128
"""The most new tokens a RULER task generates (the needle tasks' ``max_gen_toks``)."""

PASSKEY_DEPTHS = tuple(i / 10 for i in range(11))
"""``ringray_passkey``'s needle depths, cycled through sample by sample."""

PASSKEY_SEED = 1234
"""``ringray_passkey``'s seed (the job file's ``eval.passkey_seed`` default)."""

PASSKEY_SAMPLES = 500
"""``ringray_passkey``'s samples per length unless the metadata says ``num_samples``."""

RULER_SAMPLES = 500
"""Samples lm_eval's RULER generators make per length."""

VT_EXAMPLE_LENGTH = 500
"""Tokens ``ruler_vt``'s in-context example must fit (lm_eval's ``vt_utils``)."""


NEEDED_PACKAGES = (("lm_eval", "lm_eval"), ("wonderwords", "wonderwords"), ("nltk", "nltk"))
"""Modules RULER needs, and the package each comes from (all in the eval extra)."""


def missing_packages() -> list[str]:
    """The packages of :data:`NEEDED_PACKAGES` this environment lacks (found without
    importing them)."""
    import importlib.util

    missing = []
    for module, package in NEEDED_PACKAGES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent missing, or a module set to None
            found = False
        if not found:
            missing.append(package)
    return missing


class CellNotBuilt(ValueError):
    """A (task, length) cell whose data cannot be made here (one line)."""


@dataclass(frozen=True)
class RulerTask:
    """One task that runs here."""

    name: str
    about: str
    generates: int
    """New tokens a sample may generate (1: a loglikelihood task): each is a small step
    after the prompt's one forward with the KV cache, but a forward over the whole prompt
    without it (``kv_cache=false``), where this weighs a sample's time."""
    origin: str
    """``lm_eval`` (its own task, by name) or ``ringray`` (a configuration here)."""


OFFLINE_TASKS: dict[str, RulerTask] = {t.name: t for t in (
    RulerTask("niah_single_1", "one needle (a word's 7-digit number) in a repeated filler "
              "paragraph", 128, "lm_eval"),
    RulerTask("niah_multikey_2", "one needle among needle-shaped distractors", 128, "lm_eval"),
    RulerTask("niah_multikey_3", "a UUID key's UUID among needle-shaped distractors", 128,
              "lm_eval"),
    RulerTask("ringray_niah_multivalue", "niah_multivalue (all 4 values of one key) in "
              "niah_single_1's filler instead of essays", 128, "ringray"),
    RulerTask("ringray_niah_multiquery", "niah_multiquery (4 keys asked at once) in "
              "niah_single_1's filler instead of essays", 128, "ringray"),
    RulerTask("ruler_vt", "variable tracking: every variable a chain of assignments reaches",
              30, "lm_eval"),
    RulerTask("ruler_cwe", "common words: the 10 most frequent words of a list", 120,
              "lm_eval"),
    RulerTask("ruler_fwe", "frequent words: the 3 most frequent words of a coded text", 50,
              "lm_eval"),
    RulerTask("ringray_passkey", "ringray's passkey prompt, the key's tokens teacher-forced "
              "(loglikelihood)", 1, "ringray"),
)}
"""Every task ``ringray eval`` runs, in the order it runs them."""

_ESSAYS = "Paul Graham's essays (the Hugging Face dataset baber/paul_graham_essays)"
DOWNLOADING_TASKS: dict[str, str] = {
    "niah_single_2": _ESSAYS,
    "niah_single_3": _ESSAYS,
    "niah_multikey_1": _ESSAYS,
    "niah_multivalue": _ESSAYS + "; ringray_niah_multivalue runs here",
    "niah_multiquery": _ESSAYS + "; ringray_niah_multiquery runs here",
    "ruler_qa_squad": "SQuAD v2 (rajpurkar.github.io)",
    "ruler_qa_hotpot": "HotpotQA (huggingface.co)",
}
"""lm_eval's RULER tasks that download their data, and what they download."""


def select_tasks(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(tasks to run, one line per skipped task)``: a task that downloads its data is
    skipped with a line naming it and what it downloads.

    Raises:
        ValueError: a name that is no RULER task (one line listing those that run here).
    """
    tasks, skipped = [], []
    for name in names:
        if name in OFFLINE_TASKS:
            if name not in tasks:
                tasks.append(name)
        elif name in DOWNLOADING_TASKS:
            skipped.append(f"skipped {name}: it downloads {DOWNLOADING_TASKS[name]}")
        else:
            raise ValueError(f"{name!r} is not a task that runs offline; valid: "
                             f"{', '.join(OFFLINE_TASKS)}")
    return tasks, skipped


# ---------------------------------------------------------------------- lm_eval's side

def ruler_dir() -> str:
    """lm_eval's ``tasks/ruler`` directory."""
    import lm_eval

    return os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "ruler")


def task_manager(pretrained: str, length: int, *, tokenizer: str | None = None):
    """An lm_eval ``TaskManager`` that knows RULER's tasks alone (no index of every task
    lm_eval ships), with the metadata that sizes the data: the tokenizer's directory and
    ``max_seq_lengths: [length]``."""
    from lm_eval.tasks import TaskManager

    metadata: dict[str, Any] = {"pretrained": pretrained, "max_seq_lengths": [length]}
    if tokenizer:
        metadata["tokenizer"] = tokenizer
    return TaskManager(include_path=ruler_dir(), include_defaults=False, metadata=metadata)


def _niah_repeat(**needles: int):
    """A ``custom_dataset``: lm_eval's needle generator with ``niah_single_1``'s repeated
    filler as the haystack and ``needles`` (``num_needle_v`` or ``num_needle_q``)."""

    def dataset(**metadata: Any):
        from lm_eval.tasks.ruler.common_utils import (
            DEFAULT_SEQ_LENGTHS,
            get_tokenizer,
            resolve_tokenizer_name,
        )
        from lm_eval.tasks.ruler.niah_utils import TEMPLATE, download_dataset
        from lm_eval.tasks.ruler.prepare_niah import generate_samples, get_haystack

        tokenizer = get_tokenizer(resolve_tokenizer_name(metadata))
        return download_dataset(
            generate_samples(get_haystack(type_haystack="repeat"), max_seq_length=length,
                             template=TEMPLATE, type_haystack="repeat", type_needle_k="words",
                             type_needle_v="numbers", num_samples=RULER_SAMPLES,
                             TOKENIZER=tokenizer, **needles)
            for length in metadata.get("max_seq_lengths", DEFAULT_SEQ_LENGTHS))

    return dataset


def _lm_eval_niah_config() -> dict[str, Any]:
    """lm_eval's ``niah_single_1.yaml``, its functions resolved (a fresh copy)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(os.path.join(ruler_dir(), "niah_single_1.yaml"), resolve_func=True)
    config.pop("tag", None)  # not in the longcxt tag lm_eval indexes
    return config


def passkey_dataset(**metadata: Any):
    """``ringray_passkey``'s ``custom_dataset``: for each length, ``num_samples`` (default
    :data:`PASSKEY_SAMPLES`) prompts of exactly that many tokens of the checkpoint's
    tokenizer, the needle's depth cycling through :data:`PASSKEY_DEPTHS` and 5-digit keys
    from ``random.Random(f"{seed}:{length}")`` (the first N samples do not depend on how
    many there are). A doc's ``context`` ends where the key begins; ``answer`` is the key's
    text."""
    import datasets

    from ringray.data import HFTokenizer, make_passkey_sample
    from ringray.data.passkey import PASSKEY_DIGITS, check_passkey_tokenizer

    tokenizer = HFTokenizer.from_pretrained(metadata.get("tokenizer") or
                                            metadata["pretrained"])
    check_passkey_tokenizer(tokenizer)
    count = int(metadata.get("num_samples") or PASSKEY_SAMPLES)
    seed = int(metadata.get("seed", PASSKEY_SEED))
    docs = []
    for length in metadata.get("max_seq_lengths", [4096]):
        rng = random.Random(f"{seed}:{length}")
        for index in range(count):
            key = "".join(rng.choice("0123456789") for _ in range(PASSKEY_DIGITS))
            depth = PASSKEY_DEPTHS[index % len(PASSKEY_DEPTHS)]
            sample = make_passkey_sample(tokenizer, seq_len=length, depth=depth, passkey=key)
            tokens = sample.tokens.tolist()
            docs.append({"index": index, "context": tokenizer.decode(tokens[:sample.answer_start]),
                         "answer": tokenizer.decode(tokens[sample.answer_start:]),
                         "outputs": [key], "depth": depth, "length": length,
                         "max_length": length})
    return {"test": datasets.Dataset.from_list(docs, split=datasets.Split.TEST)}


def passkey_results(doc: dict, results: list) -> dict[str, float]:
    """``ringray_passkey``'s score, named by length as RULER's are: 1 when every answer
    token is the argmax."""
    _, greedy = results[0]
    return {str(doc["max_length"]): float(greedy)}


def _passkey_config(num_samples: int | None) -> dict[str, Any]:
    from lm_eval.tasks.ruler.common_utils import aggregate_metrics

    lengths = ("4096", "8192", "16384", "32768", "65536", "131072")
    return {
        "task": "ringray_passkey", "dataset_path": "", "dataset_name": "",
        "custom_dataset": passkey_dataset, "test_split": "test",
        "output_type": "loglikelihood", "doc_to_text": "{{context}}",
        "doc_to_target": "{{answer}}", "target_delimiter": "",
        "process_results": passkey_results,
        "metric_list": [{"metric": n, "aggregation": aggregate_metrics,
                         "higher_is_better": True} for n in lengths],
        "metadata": {"version": 1.0, **({"num_samples": num_samples} if num_samples else {})},
    }


def task_spec(name: str, *, num_samples: int | None = None) -> str | dict[str, Any]:
    """What lm_eval's ``TaskManager.load`` takes for ``name``: lm_eval's own task name, or
    a configuration dict for a task defined here (``num_samples``: how many passkey
    prompts to make; RULER's generators always make 500)."""
    if name not in OFFLINE_TASKS:
        raise ValueError(f"{name!r} is not a task that runs offline; valid: "
                         f"{', '.join(OFFLINE_TASKS)}")
    if name == "ringray_passkey":
        return _passkey_config(num_samples)
    if name == "ringray_niah_multivalue":
        return {**_lm_eval_niah_config(), "task": name,
                "custom_dataset": _niah_repeat(num_needle_v=4)}
    if name == "ringray_niah_multiquery":
        return {**_lm_eval_niah_config(), "task": name,
                "custom_dataset": _niah_repeat(num_needle_q=4)}
    return name


# ---------------------------------------------------------------------- building a cell

def seed_as_lm_eval() -> None:
    """Seed Python's, numpy's and torch's generators as ``simple_evaluate`` does before it
    builds its tasks (its default seeds)."""
    import numpy as np
    import torch
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)


@contextlib.contextmanager
def _kept_random_state() -> Iterator[None]:
    import numpy as np

    state, np_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


def needs_tokenizer(name: str, length: int) -> bool:
    """Whether :func:`check_buildable` measures ``name`` at ``length`` with the tokenizer
    (otherwise it passes or refuses without one)."""
    return name == "ruler_vt" or length < MIN_LENGTH


def check_buildable(name: str, length: int, tokenizer: Any) -> None:
    """:class:`CellNotBuilt` (one line) when lm_eval's generator for ``name`` would never
    finish at ``length`` with ``tokenizer`` (a transformers tokenizer): ``ruler_vt``'s loops
    shrink the filler until a prompt fits and spin forever when even the least they try does
    not (its in-context example must fit :data:`VT_EXAMPLE_LENGTH` tokens at any length).
    Measured on prompts made as ``vt_utils`` makes them, the random state kept."""
    if length < MIN_LENGTH:
        raise CellNotBuilt(f"{name} at {length}: shorter than {MIN_LENGTH} tokens, which "
                           f"RULER's templates need")
    if name != "ruler_vt":
        return
    from lm_eval.tasks.ruler import vt_utils

    answer_room = vt_utils.CONFIG["variable_tracking"]["tokens_to_generate"]
    with _kept_random_state(), contextlib.redirect_stdout(io.StringIO()):
        example, _ = vt_utils.generate_input_output(5, 1, 4, is_icl=True)
        prompt, _ = vt_utils.generate_input_output(10, 1, 4)
    margin = 16  # random variable names and values change a count by a few tokens
    example_tokens = len(tokenizer(example).input_ids) + answer_room + margin
    if example_tokens > VT_EXAMPLE_LENGTH:
        raise CellNotBuilt(
            f"ruler_vt: lm_eval's generator would never return with this tokenizer: its "
            f"in-context example must fit {VT_EXAMPLE_LENGTH} tokens and takes about "
            f"{example_tokens} with the least filler it tries (a byte-level tokenizer?); "
            f"leave ruler_vt out")
    needed = len(tokenizer(prompt).input_ids) + answer_room + VT_EXAMPLE_LENGTH + margin
    if needed > length:
        raise CellNotBuilt(f"ruler_vt at {length}: lm_eval's generator would never return: "
                           f"its least prompt with the in-context example takes about "
                           f"{needed} tokens; use a longer length")


def _fresh_ruler_modules() -> None:
    """Forget the RULER modules lm_eval's loader keeps whose state carries from one build
    to the next (``cwe_utils``' ``random.Random(42)``), so the next build starts as a fresh
    process would."""
    sys.modules.pop("lm_eval.tasks.ruler.cwe_utils", None)


def build_task(name: str, length: int, *, pretrained: str, tokenizer: str | None = None,
               num_samples: int | None = None, log: io.TextIOBase | None = None):
    """``name``'s lm_eval ``Task`` with its data for ``length`` built (seeded as
    ``simple_evaluate`` seeds), set up as ``simple_evaluate`` sets up a task it runs (no
    few-shot examples, their sampler seeded); what the generators print goes to ``log``
    (default: nowhere).

    Raises:
        CellNotBuilt: a cell whose data cannot be built (:func:`check_buildable`, a
            generator's own refusal), or whose answers came out empty (one line).
    """
    if needs_tokenizer(name, length):
        import transformers

        check_buildable(name, length, transformers.AutoTokenizer.from_pretrained(
            tokenizer or pretrained))
    _fresh_ruler_modules()
    seed_as_lm_eval()
    manager = task_manager(pretrained, length, tokenizer=tokenizer)
    sink = log if log is not None else io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            loaded = manager.load([task_spec(name, num_samples=num_samples)])
    except ValueError as exc:  # a generator's own refusal (no sample fits, a tokenizer)
        raise CellNotBuilt(f"{name} at {length}: {' '.join(str(exc).split())}") from None
    task = loaded["tasks"][name]
    from lm_eval.defaults import DEFAULT_OTHER_SEED

    if task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    docs = task.eval_docs
    empty = sum(1 for doc in docs if not doc["outputs"])
    if empty:
        raise CellNotBuilt(f"{name} at {length}: lm_eval's generator made {empty} of "
                           f"{len(docs)} samples with no answer (no room for its list at "
                           f"this length with this tokenizer); use a longer length")
    return task


DECODE_STEPS_PER_FORWARD = 100
"""Tokens decoded from the KV cache in the time of one forward over the prompt (measured:
SmolLM2-135M at 4096 tokens over a ring of 2 CPU ranks, 18 s a prefill, 0.13 to 0.3 s a
step)."""


def attention_even_length(pretrained: str) -> int | None:
    """The context length at which a token's causal attention (scores and weighted values
    over half the context, on average) costs as many FLOPs as the rest of its layer (the
    q/k/v/o projections and the MLP), from the checkpoint's config.json; None where ringray
    cannot read it. Past it a forward's time grows with the square of the length: 6144
    tokens for SmolLM2-135M, ~50k for an 8B Llama."""
    from ringray.model.hf import read_model_config

    try:
        config = read_model_config(pretrained)
    except (OSError, ValueError):
        return None
    dim, heads, head_dim = config.dim, config.n_heads, config.head_dim
    rest = 2 * dim * (2 * heads + 2 * config.n_kv_heads) * head_dim + 6 * dim * config.ffn_hidden
    return max(1, round(rest / (2 * heads * head_dim)))


def weight(name: str, length: int, max_gen_toks: int | None = None, *,
           even: int | None = None) -> int:
    """A sample's share of the work, for the time estimate: the prompt's forward and the
    tokens it may generate after it (at most ``max_gen_toks``; none for a loglikelihood
    task), each a :data:`DECODE_STEPS_PER_FORWARD`-th of a forward, times its length, and
    times ``1 + length / even`` where attention's share grows with the length (``even``:
    :func:`attention_even_length`; None: linear in the length)."""
    generates = OFFLINE_TASKS[name].generates
    if max_gen_toks is not None and generates > 1:
        generates = min(generates, max_gen_toks)
    quadratic = 1 + length / even if even else 1
    return round(length * quadratic * (1 + (generates - 1) / DECODE_STEPS_PER_FORWARD))
