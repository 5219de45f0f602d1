"""The passkey samples of ``benchmarks/real_model_extension.py``, scored with transformers'
own model instead of ringray's ring (issue 24): the reference nobody here wrote, to tell a
fault of ringray's attention or RoPE from the model's own limit.

    .venv/bin/python benchmarks/real_model_passkey_reference.py --config yarn:2 \\
        --length 16384 --depths 0.1 --samples 3

The samples, pass keys and scoring are ringray's (:func:`ringray.data.evaluate_passkey`, the
same seed, so the same keys as the extension benchmark draws for the same grid); each
prediction is the argmax of ``LlamaForCausalLM`` (transformers, SDPA attention, float32, one
process) with ``rope_parameters`` set from the configuration as transformers spells it, and
``max_position_embeddings`` raised to the length.

``--preamble`` puts the classic passkey test's opening ("There is an important info hidden
inside a lot of irrelevant text. Find it and memorize them. ...") over the first filler
tokens of each sample (same length, same needle and question), to see whether the prompt's
missing instruction is what a miss comes from.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ringray.data import evaluate_passkey
from ringray.data.tokenizer import HFTokenizer
from ringray.model.gguf_import import cached_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model_extension import TRAINED, parse_config  # noqa: E402

PREAMBLE = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
            "memorize them. I will quiz you about the important information there. ")


def hf_model(checkpoint: Path, kind: str, factor: float, length: int):
    config = AutoConfig.from_pretrained(checkpoint)
    theta = config.rope_parameters["rope_theta"]
    if kind == "theta":
        d = config.head_dim
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta * factor ** (
            d / (d - 2))}
    elif kind != "none":
        config.rope_parameters = {"rope_type": kind, "rope_theta": theta, "factor": factor,
                                  "original_max_position_embeddings": TRAINED}
    config.max_position_embeddings = max(config.max_position_embeddings, length)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, config=config,
                                                 dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=parse_config, default=("yarn", 2.0),
                        help="none, or KIND:FACTOR as in real_model_extension.py")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preamble", action="store_true",
                        help="open each sample with the classic test's instruction")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.manual_seed(0)
    checkpoint = cached_model("smollm2-135m")
    tokenizer = HFTokenizer.from_pretrained(str(checkpoint))
    kind, factor = args.config
    model = hf_model(checkpoint, kind, factor, args.length)
    seconds: list[float] = []

    opening = torch.tensor(tokenizer.encode(PREAMBLE)) if args.preamble else None

    def predict(tokens: torch.Tensor) -> torch.Tensor:
        if opening is not None:  # over the first filler tokens: same length, same needle
            tokens = tokens.clone()
            tokens[:, :len(opening)] = opening
        started = time.perf_counter()
        with torch.inference_mode():
            logits = model(input_ids=tokens).logits
        seconds.append(time.perf_counter() - started)
        print(f"  forward {len(seconds)}: {seconds[-1]:.0f} s", flush=True)
        return logits.argmax(dim=-1)

    report = evaluate_passkey(predict, tokenizer, lengths=[args.length], depths=args.depths,
                              samples_per_cell=args.samples, seed=args.seed, batch_size=1)
    result = report.to_dict()
    for cell in result["cells"]:
        print(f"transformers {kind}:{factor:g} {cell['length']} depth {cell['depth']}: exact "
              f"{cell['accuracy']:.2f} over {cell['samples']}, digits "
              f"{cell['digit_accuracy']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": f"{kind}:{factor:g}",
                                               "cells": result["cells"],
                                               "forward_seconds": seconds}, indent=2))


if __name__ == "__main__":
    main()
