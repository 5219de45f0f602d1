"""Zero-shot context extension of the real SmolLM2-135M through ringray's ring (issue 24):
for each RoPE configuration, passkey exact match (:func:`ringray.data.evaluate_passkey`, the
job's evaluation, scored on the decoded answer) and perplexity by position on one long real
text, every forward over a zigzag ring of gloo ranks, float32, no training.

    .venv/bin/python benchmarks/real_model_extension.py                     # 16k, all configs
    .venv/bin/python benchmarks/real_model_extension.py --lengths 16384 32768 \\
        --configs none yarn:2 --depths 0.1 0.5 0.9 --json out.json

SmolLM2-135M was trained at 8192 tokens with rope_theta 100000. A configuration is ``none``
(the model as trained) or ``KIND:FACTOR`` with KIND one of

- ``linear``, ``llama3``, ``yarn``: ``model.rope`` = ``{scaling: KIND, factor: FACTOR,
  original_max_position_embeddings: 8192}`` (ringray's :class:`RopeOptions`, the job spec's
  spelling), other parameters at transformers' defaults;
- ``theta``: ringray has no ``theta`` scaling kind; ``model.rope.theta`` raises the base. The
  base is set NTK-aware: ``theta * FACTOR ** (d / (d - 2))`` with head size d = 64, so the
  longest wavelength grows by FACTOR (x2: 204 522, x4: 418 294).

Perplexity by position: the text is ``_pydecimal.py`` of this Python's standard library (one
document of 61 005 tokens under the model's tokenizer), its first LENGTH tokens; the mean
next-token negative log-likelihood (nats) of the tokens in each 2048-token bucket of positions
is reported, and the perplexity over all. Each rank scores the positions it holds (its local
logits, never gathered); the per-token losses are gathered and unsharded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringray.attention import make_layout
from ringray.bench.gloo_ranks import run_gloo_ranks
from ringray.data import evaluate_passkey
from ringray.data.tokenizer import HFTokenizer
from ringray.model import RingContext, Transformer, load_hf_weights
from ringray.model.gguf_import import cached_model
from ringray.model.hf import read_model_config
from ringray.model.options import ModelOptions, RopeOptions

TEXT_FILE = "_pydecimal.py"
BUCKET = 2048
TRAINED = 8192
KINDS = ("none", "theta", "linear", "yarn", "llama3")
DEFAULT_CONFIGS = ["none", "theta:2", "theta:4", "linear:2", "linear:4", "yarn:2", "yarn:4",
                   "llama3:2", "llama3:4"]


def parse_config(text: str) -> tuple[str, float]:
    kind, _, factor = text.partition(":")
    if kind not in KINDS or (kind == "none") != (factor == ""):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected 'none' or KIND:FACTOR with KIND one of {', '.join(KINDS[1:])}")
    return kind, float(factor or 1)


def rope_options(checkpoint: str, kind: str, factor: float) -> RopeOptions:
    if kind == "none":
        return RopeOptions()
    if kind == "theta":
        cfg = read_model_config(checkpoint)
        d = cfg.head_dim
        return RopeOptions(theta=cfg.rope_theta * factor ** (d / (d - 2)))
    return RopeOptions(scaling=kind, factor=factor, original_max_position_embeddings=TRAINED)


def real_text_tokens(tokenizer: HFTokenizer, length: int) -> torch.Tensor:
    text = (Path(sysconfig.get_paths()["stdlib"]) / TEXT_FILE).read_text()
    ids = tokenizer.encode(text)
    if len(ids) < length:
        raise SystemExit(f"{TEXT_FILE} has {len(ids)} tokens, fewer than --lengths {length}")
    return torch.tensor(ids[:length], dtype=torch.long).unsqueeze(0)


def rank_extension(rank: int, world: int, checkpoint: str, configs: list[str],
                   lengths: list[int], depths: list[float], samples: int, seed: int,
                   tasks: list[str], progress: str | None) -> list[dict] | None:
    """Every configuration's passkey and perplexity at every length; rank 0 returns rows."""
    tokenizer = HFTokenizer.from_pretrained(checkpoint)
    rows = []
    for name in configs:
        kind, factor = parse_config(name)
        options = ModelOptions(from_pretrained=checkpoint,
                               rope=rope_options(checkpoint, kind, factor))
        cfg = options.build()
        model = Transformer(cfg)
        load_hf_weights(model, checkpoint)
        model.eval()
        forwards: list[float] = []

        def local_logits(tokens: torch.Tensor, ring: RingContext, layout,
                         model=model, forwards=forwards) -> torch.Tensor:
            started = time.perf_counter()
            with torch.inference_mode():
                out = model(layout.shard(tokens, rank), ring)
            forwards.append(time.perf_counter() - started)
            return out

        def predict(tokens: torch.Tensor, local_logits=local_logits) -> torch.Tensor:
            layout = make_layout("zigzag", world, tokens.shape[1])
            ring = RingContext(layout=layout, rank=rank, backend="sdpa")
            local = local_logits(tokens, ring, layout).argmax(dim=-1)
            shards = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(shards, local)
            return layout.unshard(shards)

        for length in lengths:
            row: dict = {"config": name, "kind": kind, "factor": factor, "length": length,
                         "rope_theta": cfg.rope_theta}
            if "passkey" in tasks:
                forwards.clear()
                started = time.perf_counter()
                report = evaluate_passkey(predict, tokenizer, lengths=[length], depths=depths,
                                          samples_per_cell=samples, seed=seed, batch_size=1)
                result = report.to_dict()
                cells = result["cells"]
                row["passkey_correct"] = sum(round(c["accuracy"] * c["samples"])
                                             for c in cells)
                row["passkey_samples"] = sum(c["samples"] for c in cells)
                row["passkey_cells"] = cells
                row["passkey_seconds"] = time.perf_counter() - started
                row["passkey_forward_seconds"] = list(forwards)
            if "ppl" in tasks:
                started = time.perf_counter()
                tokens = real_text_tokens(tokenizer, length)
                targets = torch.full_like(tokens, -100)
                targets[:, :-1] = tokens[:, 1:]
                layout = make_layout("zigzag", world, length)
                ring = RingContext(layout=layout, rank=rank, backend="sdpa")
                logits = local_logits(tokens, ring, layout)
                local_targets = layout.shard(targets, rank)
                nll = F.cross_entropy(logits[0], local_targets[0], ignore_index=-100,
                                      reduction="none").unsqueeze(0)
                del logits
                shards = [torch.empty_like(nll) for _ in range(world)]
                dist.all_gather(shards, nll)
                nll = layout.unshard(shards)[0, :-1]  # the last token predicts nothing
                buckets = [nll[i: i + BUCKET].mean().item() for i in range(0, length - 1,
                                                                           BUCKET)]
                row["nll_by_bucket"] = buckets
                row["ppl"] = math.exp(nll.mean().item())
                row["ppl_seconds"] = time.perf_counter() - started
            rows.append(row)
            if rank == 0:
                print(format_row(row), flush=True)
                if progress:
                    Path(progress).write_text(json.dumps(rows, indent=2))
    return rows if rank == 0 else None


def format_row(row: dict) -> str:
    parts = [f"{row['config']:>9} {row['length']:>6}"]
    if "passkey_correct" in row:
        parts.append(f"passkey {row['passkey_correct']}/{row['passkey_samples']}"
                     f" ({row['passkey_seconds']:.0f} s)")
    if "ppl" in row:
        parts.append(f"ppl {row['ppl']:7.2f} ({row['ppl_seconds']:.0f} s)")
    return "  ".join(parts)


def format_table(rows: list[dict]) -> str:
    buckets = max((len(r.get("nll_by_bucket", [])) for r in rows), default=0)
    head = ["config", "length", "rope_theta", "passkey", "ppl"] + [
        f"{i * BUCKET // 1024}-{(i + 1) * BUCKET // 1024}k" for i in range(buckets)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        passkey = (f"{r['passkey_correct']}/{r['passkey_samples']}"
                   if "passkey_correct" in r else "-")
        ppl = f"{r['ppl']:.2f}" if "ppl" in r else "-"
        nll = [f"{x:.2f}" for x in r.get("nll_by_bucket", [])]
        nll += ["-"] * (buckets - len(nll))
        cells = [r["config"], str(r["length"]), f"{r['rope_theta']:.0f}", passkey, ppl, *nll]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                        help="'none' or KIND:FACTOR, KIND in theta, linear, yarn, llama3")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.5])
    parser.add_argument("--samples", type=int, default=1, help="passkey samples per depth")
    parser.add_argument("--tasks", nargs="+", choices=["passkey", "ppl"],
                        default=["passkey", "ppl"])
    parser.add_argument("--cp", type=int, default=2, help="ranks in the ring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="a Hugging Face checkpoint directory to score instead of the "
                        "pretrained SmolLM2-135M (e.g. a fine-tune's `ringray export --hf`)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON (also as they "
                        "finish)")
    args = parser.parse_args()
    for name in args.configs:
        parse_config(name)
    checkpoint = args.checkpoint or str(cached_model("smollm2-135m"))
    if not (Path(checkpoint) / "config.json").is_file():
        parser.error(f"--checkpoint {checkpoint}: no config.json there (expected a Hugging "
                     "Face checkpoint directory, e.g. from `ringray export RUN --hf DIR`)")
    print(f"{checkpoint}: SmolLM2-135M (trained at {TRAINED}) through a zigzag ring of "
          f"{args.cp} gloo ranks (1 thread each), float32, forward only; lengths "
          f"{args.lengths}, configs {args.configs}, passkey depths {args.depths} x "
          f"{args.samples}, perplexity on {TEXT_FILE}; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    started = time.perf_counter()
    rows = run_gloo_ranks(args.cp, rank_extension, checkpoint, args.configs, args.lengths,
                          args.depths, args.samples, args.seed, args.tasks, args.json,
                          timeout_seconds=24 * 3600)[0]
    print(format_table(rows))
    print(f"{time.perf_counter() - started:.0f} s in all; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
