"""Passkey retrieval of the real SmolLM2-135M through ringray's ring: the evaluation a job runs
(``eval.passkey_lengths``: :func:`ringray.data.evaluate_passkey`, teacher-forced, scored on the
decoded answer) with ringray's model over a zigzag ring of gloo ranks, no training.

    .venv/bin/python benchmarks/real_model_passkey.py                       # 2k and 4k, ring of 2
    .venv/bin/python benchmarks/real_model_passkey.py --lengths 8192 --samples 1

Issue 24 found that transformers alone answers the classic prompt perfectly up to 8192
tokens (the model's trained length); if this scores much lower at the same length, the
evaluation (or the ring) is wrong. Exact match under teacher forcing equals greedy decoding's:
every answer token must be the argmax given the true tokens before it.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from ringray.attention import make_layout
from ringray.bench.gloo_ranks import run_gloo_ranks
from ringray.data import evaluate_passkey
from ringray.data.tokenizer import HFTokenizer
from ringray.model import RingContext, load_pretrained
from ringray.model.gguf_import import cached_model


def rank_passkey(rank: int, world: int, checkpoint: str, lengths: list[int],
                 depths: list[float], samples: int, seed: int) -> dict | None:
    """The job's passkey evaluation with every rank of a zigzag ring holding its shard;
    rank 0 returns the report."""
    model = load_pretrained(checkpoint).eval()
    tokenizer = HFTokenizer.from_pretrained(checkpoint)

    def predict(tokens: torch.Tensor) -> torch.Tensor:
        layout = make_layout("zigzag", world, tokens.shape[1])
        ring = RingContext(layout=layout, rank=rank, backend="sdpa")
        local = model(layout.shard(tokens, rank), ring).argmax(dim=-1)
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local)
        return layout.unshard(shards)

    started = time.perf_counter()
    report = evaluate_passkey(predict, tokenizer, lengths=lengths, depths=depths,
                              samples_per_cell=samples, seed=seed, batch_size=1)
    seconds = time.perf_counter() - started
    if rank != 0:
        return None
    return {"table": report.format_table(), "report": report.to_dict(), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--samples", type=int, default=2, help="samples per (length, depth)")
    parser.add_argument("--cp", type=int, default=2, help="ranks in the ring")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    checkpoint = str(cached_model("smollm2-135m"))
    print(f"SmolLM2-135M through a zigzag ring of {args.cp} gloo ranks (1 thread each), "
          f"float32; lengths {args.lengths}, depths {args.depths}, {args.samples} per cell",
          flush=True)
    result = run_gloo_ranks(args.cp, rank_passkey, checkpoint, args.lengths, args.depths,
                            args.samples, args.seed, timeout_seconds=24 * 3600)[0]
    print(result["table"])
    print(f"{result['seconds']:.0f} s of evaluation")


if __name__ == "__main__":
    main()
