"""Greedy generation through the ``ringray`` lm_eval model with and without its KV cache,
side by side in one process: the same prompt, the same model, alternating runs.

    .venv/bin/python benchmarks/kv_cache.py --model ~/.cache/ringray/models/smollm2-135m \\
        --length 4096 --max-gen-toks 10 --repeat 2

The prompt is prose the model's tokenizer encodes to ``--length`` tokens (up to one sentence
short), ending in a
question; generation is greedy and stops at a blank line or after ``--max-gen-toks``
tokens. Without the cache (``kv_cache=false``) each new token re-runs the whole prompt; with
it the prompt runs once and each token is one decoding step. One rank (cp=1), float32, CPU;
a ring shares the same code, plus two small all-reduces per layer and token. Prints the
seconds of each run, their medians and ratio, and checks that both texts are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _prompt(tokenizer, length: int) -> str:
    """Prose of at most ``length`` tokens (at most one sentence short) ending in a question."""
    sentence = ("The river ran past the old mill, where the miller counted the sacks of "
                "grain and wrote the numbers in a ledger by the window. ")
    question = "Question: what did the miller write in the ledger? Answer:"
    per = len(tokenizer.encode(sentence, add_special_tokens=False))
    room = length - len(tokenizer.encode(question, add_special_tokens=False)) - 2
    return sentence * max(1, room // per) + question


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.expanduser(
        "~/.cache/ringray/models/smollm2-135m"), help="a Hugging Face checkpoint directory")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--max-gen-toks", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    from lm_eval.api.instance import Instance

    from ringray.harness.lm import RingLM

    models = {cached: RingLM(pretrained=args.model, device="cpu", kv_cache=cached,
                             max_length=max(args.length + args.max_gen_toks, 8192))
              for cached in (True, False)}
    prompt = _prompt(models[True].tokenizer, args.length)
    tokens = len(models[True].tokenizer.encode(prompt))
    request = Instance(request_type="generate_until", doc={}, idx=0, arguments=(
        prompt, {"until": ["\n\n"], "max_gen_toks": args.max_gen_toks, "do_sample": False}))
    seconds: dict[bool, list[float]] = {True: [], False: []}
    texts: dict[bool, str] = {}
    for run in range(args.repeat):
        for cached in (True, False) if run % 2 == 0 else (False, True):
            start = time.perf_counter()
            (texts[cached],) = models[cached].generate_until([request], disable_tqdm=True)
            seconds[cached].append(time.perf_counter() - start)
            print(f"run {run + 1}, kv_cache={str(cached).lower()}: "
                  f"{seconds[cached][-1]:.1f} s", flush=True)
    with open("/proc/loadavg", encoding="utf-8") as f:
        load = f.read().split()[0]
    result = {
        "model": args.model, "prompt_tokens": tokens, "max_gen_toks": args.max_gen_toks,
        "text": texts[True], "same_text": texts[True] == texts[False],
        "seconds_cached": seconds[True], "seconds_uncached": seconds[False],
        "median_cached": statistics.median(seconds[True]),
        "median_uncached": statistics.median(seconds[False]),
        "load_at_end": float(load), "threads": os.environ.get("OMP_NUM_THREADS"),
    }
    result["speedup"] = result["median_uncached"] / result["median_cached"]
    print(f"{tokens} prompt tokens, text {texts[True]!r}: cached {result['median_cached']:.1f} s, "
          f"re-run {result['median_uncached']:.1f} s ({result['speedup']:.1f}x); same text: "
          f"{result['same_text']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if not result["same_text"]:
        raise SystemExit("the two texts differ")


if __name__ == "__main__":
    main()
