"""The ``ringray`` command line.

    ringray bench ring --world 4 --seq 16384 --heads 8 --kv-heads 2 --head-dim 64

Errors are one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="ringray: exact ring attention and long-context training on Ray.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks that print the project's measured figures.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

_err = Console(stderr=True)


def _fail(message: str) -> None:
    _err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code=2)


@bench_app.command("ring")
def bench_ring(
    world: int = typer.Option(4, "--world", min=1, help="Ring size: local gloo processes."),
    seq: int = typer.Option(16384, "--seq", min=1, help="Total sequence length (tokens)."),
    heads: int = typer.Option(8, "--heads", min=1, help="Query heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", min=1, help="Key/value heads (GQA)."),
    head_dim: int = typer.Option(64, "--head-dim", min=1, help="Head dimension."),
    layouts: str = typer.Option("zigzag,striped,contiguous", "--layouts",
                                help="Comma-separated layouts to compare."),
    full: bool = typer.Option(False, "--full", help="Full (non-causal) attention."),
    iters: int = typer.Option(2, "--iters", min=1, help="Measured iterations per layout."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per layout."),
) -> None:
    """Overlap, load balance and work efficiency of ring attention on local gloo ranks.

    Example: ringray bench ring --world 4 --seq 16384 --heads 8 --kv-heads 2 --head-dim 64
    """
    from ringray.bench.ring import RingBenchConfig, run_ring_bench

    names = tuple(n.strip() for n in layouts.split(",") if n.strip())
    if not names:
        _fail("--layouts: give at least one of zigzag, striped, contiguous")
    if heads % kv_heads:
        _fail(f"--kv-heads: {kv_heads} must divide --heads {heads}")
    cfg = RingBenchConfig(world=world, seq=seq, heads=heads, kv_heads=kv_heads,
                          head_dim=head_dim, layouts=names, causal=not full, iters=iters)
    try:
        from ringray.attention import make_layout

        for name in names:
            make_layout(name, world, seq)
    except ValueError as exc:
        _fail(str(exc))
    _err.print(
        f"ring attention: {world} gloo ranks x 1 thread, seq {seq}, heads {heads}/{kv_heads}, "
        f"head_dim {head_dim}, {'full' if full else 'causal'}, layouts {', '.join(names)}",
        highlight=False,
    )
    with _err.status("running (single-process SDPA reference, then each layout)..."):
        results = run_ring_bench(cfg)
    if as_json:
        json.dump([asdict(r) for r in results], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    _print_ring_tables(results)


@bench_app.command("train")
def bench_train(
    config: str = typer.Option("jobs/quickstart.yaml", "--config", help="Job spec to run."),
    layouts: str = typer.Option("zigzag,striped,contiguous", "--layouts",
                                help="Comma-separated layouts to compare."),
    steps: int = typer.Option(8, "--steps", min=1, help="Measured steps per layout."),
    warmup: int = typer.Option(2, "--warmup", min=0, help="Steps run first, not measured."),
    overrides: list[str] = typer.Option(  # noqa: B008 - typer's documented form
        [], "--set", help="Override a spec field (repeatable), e.g. train.seq_len=8192."
    ),
    gpu: bool = typer.Option(False, "--gpu", help="One CUDA device: the 1b preset at --seq."),
    seq: int = typer.Option(16384, "--seq", min=2, help="Sequence length for --gpu."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Tokens/s, MFU, overlap and load imbalance of a job spec, per layout.

    Example: ringray bench train --config jobs/quickstart.yaml --steps 8
    """
    from ringray.bench.train import run_gpu_bench, run_train_bench
    from ringray.config import JobSpecError

    names = tuple(n.strip() for n in layouts.split(",") if n.strip())
    try:
        if gpu:
            _err.print(f"training benchmark: 1b preset, seq {seq}, one CUDA device",
                       highlight=False)
            results = [run_gpu_bench(seq_len=seq, steps=steps, warmup=warmup)]
        else:
            _err.print(f"training benchmark: {config}, layouts {', '.join(names)}, "
                       f"{warmup} + {steps} steps each", highlight=False)
            with _err.status("training..."):
                results = run_train_bench(config, layouts=names, steps=steps, warmup=warmup,
                                          overrides=tuple(overrides))
    except (JobSpecError, ValueError) as exc:
        _fail(str(exc))
    if as_json:
        json.dump([asdict(r) for r in results], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    first = results[0]
    Console().print(
        f"{first.world} rank(s), seq {first.seq_len}, global batch {first.global_batch}; "
        f"medians over {first.measured_steps} steps. overlap: share of the ring's transfer "
        f"time hidden (worst rank); imbalance: max/mean attention compute.", highlight=False,
    )
    table = Table()
    for col in ("layout", "tok/s", "step s", "MFU", "overlap", "imbal.", "peak MiB"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
        table.add_row(r.layout, f"{r.tokens_per_second:.0f}", f"{r.step_seconds:.3f}", mfu,
                      f"{r.overlap_ratio:.3f}", f"{r.load_imbalance:.3f}",
                      f"{r.peak_memory_bytes / 2**20:.0f}")
    Console().print(table)


def _print_ring_tables(results) -> None:
    from ringray.attention.stats import overlap_ratio

    out = Console()
    for r in results:
        table = Table(title=f"layout: {r.layout}", title_justify="left")
        for col in ("rank", "compute s", "exposed comm s", "transfer alone s", "overlap"):
            table.add_column(col, justify="right")
        for rank, (c, e, t) in enumerate(
            zip(r.compute_seconds, r.exposed_comm_seconds, r.transfer_seconds, strict=True)
        ):
            table.add_row(str(rank), f"{c:.3f}", f"{e:.4f}", f"{t:.4f}",
                          f"{overlap_ratio(e, t):.3f}")
        out.print(table)
    summary = Table(title="summary (compute = CPU seconds, forward + backward; imbalance = "
                    "max/mean; work eff. = ranks' compute / 1-process SDPA)",
                    title_justify="left")
    for col in ("layout", "overlap", "imbal.", "imbal. theory", "work eff.", "max s",
                "SDPA s"):
        summary.add_column(col, justify="right", no_wrap=True)
    for r in results:
        summary.add_row(r.layout, f"{r.overlap_ratio:.3f}", f"{r.imbalance_measured:.3f}",
                        f"{r.imbalance_theoretical:.3f}", f"{r.work_efficiency:.3f}",
                        f"{r.compute_seconds_max:.3f}", f"{r.single_process_seconds:.3f}")
    out.print(summary)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
