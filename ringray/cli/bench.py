"""``ringray bench ring | train | kernel | memory``: thin commands over :mod:`ringray.bench`."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, replace

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ringray.cli.common import err, fail, read_spec

MAX_BENCH_SEQ = 16_777_216
"""The longest --seq a benchmark takes: the job file's cap on train.seq_len (a 2e9-token ring
benchmark was ended by the kernel's out-of-memory killer, without a word)."""

app = typer.Typer(help="Benchmarks that print the project's measured figures.",
                  no_args_is_help=True)


@app.command("ring")
def bench_ring(
    world: int = typer.Option(4, "--world", min=1, help="Ranks: local gloo processes (ring "
                              "size x --ulysses)."),
    ulysses: int = typer.Option(1, "--ulysses", min=1, help="Ranks per Ulysses group (a head "
                                "all-to-all around a ring of --world / --ulysses ranks)."),
    seq: int = typer.Option(16384, "--seq", min=1, help="Total sequence length (tokens), "
                            f"at most {MAX_BENCH_SEQ}."),
    heads: int = typer.Option(8, "--heads", min=1, help="Query heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", min=1, help="Key/value heads (GQA)."),
    head_dim: int = typer.Option(64, "--head-dim", min=1, help="Head dimension."),
    layouts: str = typer.Option(None, "--layouts", show_default=False,
                                help="Comma-separated layouts to compare (default: zigzag,"
                                "striped,contiguous; with --documents also balanced,whole)."),
    full: bool = typer.Option(False, "--full", help="Full (non-causal) attention."),
    iters: int = typer.Option(2, "--iters", min=1, help="Measured iterations per layout."),
    documents: str = typer.Option(None, "--documents", metavar="SPEC",
                                  help="Pack documents into the sequence and mask attention "
                                  "to each: stdlib (the standard library's files), "
                                  "lognormal:MEAN[:SIGMA] or fixed:LEN."),
    transfers: str = typer.Option(
        "mask", "--transfers",
        help="Comma-separated transfer modes, each run per layout side by side: mask (only "
        "the rows a reader reads) and/or all (every block whole to every rank, as a plain "
        "ring)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per layout."),
) -> None:
    """Overlap, load balance and work efficiency of ring attention on local gloo ranks.

    Example: ringray bench ring --world 4 --seq 16384 --heads 8 --kv-heads 2 --head-dim 64

    Packed documents, the plain ring's traffic beside ringray's, in one run:
    ringray bench ring --world 4 --documents stdlib --layouts balanced,whole --transfers all,mask
    """
    from ringray.bench.ring import RingBenchConfig, document_lengths, run_ring_bench

    if layouts is None:
        layouts = "zigzag,striped,contiguous" + (",balanced,whole" if documents else "")
    names = tuple(n.strip() for n in layouts.split(",") if n.strip())
    if not names:
        fail("--layouts: give at least one of zigzag, striped, contiguous, balanced, whole")
    if seq > MAX_BENCH_SEQ:
        fail(f"--seq: {seq} is longer than {MAX_BENCH_SEQ} tokens, the longest a job trains")
    if heads % kv_heads:
        fail(f"--kv-heads: {kv_heads} must divide --heads {heads}")
    if world % ulysses:
        fail(f"--ulysses: {ulysses} must divide --world {world} (the ring has world / ulysses "
             f"ranks)")
    modes = tuple(m.strip() for m in transfers.split(",") if m.strip())
    if not modes or any(m not in ("mask", "all") for m in modes):
        fail(f"--transfers: {transfers!r} is not a comma-separated list of mask, all")
    cfg = RingBenchConfig(world=world, seq=seq, heads=heads, kv_heads=kv_heads,
                          head_dim=head_dim, layouts=names, causal=not full, iters=iters,
                          documents=documents, ulysses=ulysses, transfers=modes)
    try:
        from ringray.attention import make_layout
        from ringray.attention.ulysses import check_ulysses_heads

        if ulysses > 1:
            check_ulysses_heads(heads, kv_heads, ulysses)
        lengths = document_lengths(documents, seq) if documents else None
        for name in names:
            make_layout(name, world, seq, documents=lengths, ulysses=ulysses)
    except ValueError as exc:
        message = str(exc)
        flag = {"documents:": "--documents:", "q:": "--heads:", "k:": "--kv-heads:",
                "layout: unknown": "--layouts: unknown", "layout:": "--seq:"}
        prefix = next((p for p in flag if message.startswith(p)), None)
        fail(f"{flag[prefix]}{message.removeprefix(prefix)}" if prefix else message)
    packed = f", {len(lengths)} documents ({documents})" if lengths else ""
    grid = f" (ring {world // ulysses} x ulysses {ulysses})" if ulysses > 1 else ""
    err.print(
        f"ring attention: {world} gloo ranks{grid} x 1 thread, seq {seq}, heads "
        f"{heads}/{kv_heads}, head_dim {head_dim}, {'full' if full else 'causal'}{packed}, "
        f"layouts {', '.join(names)}, transfers {', '.join(modes)}",
        highlight=False,
    )
    with err.status("running (single-process SDPA reference, then each layout)..."):
        results = run_ring_bench(cfg)
    if as_json:
        json.dump([asdict(r) for r in results], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    if ulysses > 1:
        from ringray.bench.ring import ulysses_tables

        for table in ulysses_tables(results):  # the summary needs more than 80 columns
            Console(width=max(Console().width, 150)).print(table)
        return
    _print_ring_tables(results, per_document=documents is not None)


@app.command("train")
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

    names = tuple(n.strip() for n in layouts.split(",") if n.strip())
    if not names:
        fail("--layouts: give at least one of zigzag, striped, contiguous, balanced, whole")
    if gpu:
        err.print(f"training benchmark: 1b preset, seq {seq}, one CUDA device", highlight=False)
        try:
            results = [run_gpu_bench(seq_len=seq, steps=steps, warmup=warmup)]
        except ValueError as exc:
            fail(str(exc))
    else:
        jobs = [read_spec(config, [*overrides, f"parallel.layout={name}"],
                          check_paths=False).train_options() for name in names]
        err.print(f"training benchmark: {config}, layouts {', '.join(names)}, "
                  f"{warmup} + {steps} steps each", highlight=False)
        with err.status("training..."):
            try:
                results = run_train_bench(jobs, steps=steps, warmup=warmup)
            except ValueError as exc:
                fail(str(exc))
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


@app.command("kernel")
def bench_kernel(
    seqs: str = typer.Option("4096,8192,16384", "--seqs",
                             help="Comma-separated total sequence lengths."),
    batch: int = typer.Option(1, "--batch", min=1, help="Batch size."),
    heads: int = typer.Option(16, "--heads", min=1, help="Query heads."),
    kv_heads: int = typer.Option(8, "--kv-heads", min=1, help="Key/value heads (GQA)."),
    head_dim: int = typer.Option(128, "--head-dim", min=1, help="Head dimension."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 or float16."),
    blocks: int = typer.Option(4, "--blocks", min=1, help="Blocks of the virtual ring."),
    iters: int = typer.Option(10, "--iters", min=1, help="Timed repetitions (median)."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed repetitions first."),
    sweep: bool = typer.Option(False, "--sweep", help="Time every candidate tile shape at "
                               "the first --seqs length (causal) instead."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Triton ring-step kernels vs PyTorch SDPA (flash, cuDNN): TFLOP/s and a virtual ring.

    Needs a CUDA GPU for speed; on CPU it runs the kernels' correctness smoke only.

    Example: ringray bench kernel --seqs 4096,8192,16384 --heads 16 --kv-heads 8
    """
    import torch

    try:
        lengths = tuple(int(n) for n in seqs.split(","))  # an empty part is a typo: refused
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        fail(f"--seqs: expected comma-separated positive integers, got {seqs!r}")
    if max(lengths) > MAX_BENCH_SEQ:
        fail(f"--seqs: {max(lengths)} is longer than {MAX_BENCH_SEQ} tokens, the longest a "
             f"job trains")
    if heads % kv_heads:
        fail(f"--kv-heads: {kv_heads} must divide --heads {heads}")
    if dtype not in ("bfloat16", "float16"):
        fail(f"--dtype: {dtype!r} is not one of bfloat16, float16")
    from ringray.attention import make_layout

    try:
        for seq in lengths:  # the virtual ring cuts each length into --blocks zigzag blocks
            make_layout("zigzag", blocks, seq)
    except ValueError as exc:
        fail(f"--seqs/--blocks: {exc}")
    cuda = torch.cuda.is_available()
    if not cuda:
        # Without a GPU the kernels can only run in Triton's interpreter, which must be
        # chosen before they are defined (that is, before the modules below are imported).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ringray.bench import kernel as kb

    out = Console()
    report: dict[str, list] = {}
    if not cuda:
        err.print("kernel speed needs a CUDA GPU and there is none here: running the "
                   "correctness smoke only (Triton interpreter vs float64 reference)",
                   highlight=False)
    with err.status("correctness smoke..."):
        report["smoke"] = kb.run_smoke(torch.device("cuda" if cuda else "cpu"))
    if cuda:
        cfg = kb.KernelBenchConfig(seqs=lengths, batch=batch, heads=heads,
                                   kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                   ring_blocks=blocks, warmup=warmup, iters=iters)
        err.print(f"GPU: {torch.cuda.get_device_name()}; {dtype}, batch {batch}, heads "
                   f"{heads}/{kv_heads}, head_dim {head_dim}", highlight=False)
        with err.status("timing..."):
            if sweep:
                report["sweep"] = kb.run_sweep(cfg, lengths[0], causal=True)
            else:
                report["speed"] = kb.run_speed(cfg)
                report["virtual_ring"] = kb.run_virtual_ring(cfg)
    if as_json:
        json.dump({name: [asdict(r) for r in rows] for name, rows in report.items()},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        tables = {"smoke": kb.smoke_table, "speed": kb.speed_table,
                  "virtual_ring": kb.virtual_ring_table, "sweep": kb.sweep_table}
        for name, rows in report.items():
            out.print(tables[name](rows))
    if not all(r.passed for r in report["smoke"]):
        err.print(Text.assemble(("error:", "bold red"), " the correctness smoke failed"),
                  highlight=False)
        raise typer.Exit(code=1)


@app.command("memory")
def bench_memory(
    config: str = typer.Option("jobs/quickstart.yaml", "--config", help="Job spec to measure."),
    overrides: list[str] = typer.Option(  # noqa: B008 - typer's documented form
        [], "--set", help="Override a spec field (repeatable), e.g. model.preset=small."
    ),
    checkpointing: str = typer.Option(None, "--checkpointing", show_default=False,
                                      help="Comma-separated activation checkpointing modes "
                                      "to compare: none, full, selective (default: the "
                                      "spec's)."),
    sharding: str = typer.Option(None, "--sharding", show_default=False,
                                 help="Comma-separated: replicated, fsdp (default: the "
                                 "spec's parallel.fsdp)."),
    steps: int = typer.Option(1, "--steps", min=1, help="Measured steps per job, after one "
                              "warm-up step."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Measured peak memory per rank in a training step, against `ringray plan`'s prediction.

    On CPU each rank is a local gloo process and the peak is the CPU allocator's (from the
    profiler's memory records); on CUDA, one device, torch.cuda.max_memory_allocated.

    Example: ringray bench memory --set model.preset=small --set train.seq_len=4096
    --set train.global_batch=1 --set parallel.cp=2 --checkpointing none,full,selective
    --sharding replicated,fsdp
    """
    from ringray.bench.memory import run_memory_bench

    spec = read_spec(config, overrides, check_paths=False)
    base = spec.train_options()
    modes = _choices("--checkpointing", checkpointing, ("none", "full", "selective"),
                     base.train.activation_checkpointing)
    shardings = _choices("--sharding", sharding, ("replicated", "fsdp"),
                         "fsdp" if base.parallel.fsdp else "replicated")
    jobs = []
    for shard in shardings:
        for mode in modes:
            jobs.append(replace(base, parallel=replace(base.parallel, fsdp=shard == "fsdp"),
                                train=replace(base.train, activation_checkpointing=mode)))
    err.print(f"memory benchmark: {config}, {len(jobs)} job(s): "
              f"{', '.join(shardings)} x checkpointing {', '.join(modes)}", highlight=False)
    with err.status("training..."):
        try:
            results = run_memory_bench(jobs, steps=steps)
        except ValueError as exc:
            fail(str(exc))
    if as_json:
        json.dump([asdict(r) | {"measured_bytes": r.measured_bytes,
                                "predicted_bytes": r.predicted_bytes,
                                "error_ratio": r.error_ratio} for r in results],
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    first = results[0]
    Console().print(
        f"{first.world} rank(s) on {first.device}, seq {first.seq_len}, {first.local_tokens} "
        f"tokens per rank; peak: the largest rank's allocated bytes in a step; plan: "
        f"`ringray plan`'s peak; ring: bytes one rank sends per step.", highlight=False)
    table = Table()
    for col in ("job", "measured MiB", "plan MiB", "plan error", "ring MiB"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        table.add_row(r.label, f"{r.measured_bytes / 2**20:.1f}",
                      f"{r.predicted_bytes / 2**20:.1f}", f"{r.error_ratio:+.1%}",
                      f"{max(r.ring_bytes_sent) / 2**20:.1f}")
    Console().print(table)


def _choices(flag: str, text: str | None, valid: tuple[str, ...], default: str) -> list[str]:
    """A comma-separated list of ``valid`` names (``default`` when not given)."""
    if text is None:
        return [default]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        fail(f"{flag}: {text!r} is not a comma-separated list of {', '.join(valid)}")
    return names


def _print_ring_tables(results, per_document: bool = False) -> None:
    from ringray.attention.stats import overlap_ratio

    out = Console()
    for r in results:
        table = Table(title=f"layout: {r.layout}, transfers: {r.transfers}", title_justify="left")
        for col in ("rank", "compute s", "exposed comm s", "of it peer wait s",
                    "transfer alone s", "overlap"):
            table.add_column(col, justify="right")
        for rank, (c, e, n, w, t) in enumerate(zip(
            r.compute_seconds, r.exposed_comm_seconds, r.transfer_exposed_seconds,
            r.peer_wait_seconds, r.transfer_seconds, strict=True,
        )):  # overlap leaves the peer wait out: 1 - (exposed - peer wait) / transfer alone
            table.add_row(str(rank), f"{c:.3f}", f"{e:.4f}", f"{w:.4f}", f"{t:.4f}",
                          f"{overlap_ratio(n, t):.3f}")
        out.print(table)
    ideal = "1-process SDPA per document" if per_document else "1-process SDPA"
    step_note = ("; step imbal. theory = visible pairs of the slowest rank summed over ring "
                 "steps / mean" if per_document else "")
    summary = Table(title="summary (compute = CPU seconds, forward + backward; call s = the "
                    "slowest rank's compute + exposed wait; sent = the most a rank sent; "
                    "transfers: mask = only what readers read, all = every block to every "
                    f"rank; imbalance = max/mean; work eff. = ranks' compute / {ideal}"
                    f"{step_note})", title_justify="left")
    steps = ("step imbal. theory",) if per_document else ()
    for col in ("layout", "transfers", "call s", "sent MiB", "overlap", "imbal.",
                "imbal. theory", *steps, "work eff.", "max s", "SDPA s"):
        summary.add_column(col, justify="right", no_wrap=True)
    for r in results:
        step = (f"{r.step_imbalance_theoretical:.3f}",) if per_document else ()
        call = max(c + e for c, e in zip(r.compute_seconds, r.exposed_comm_seconds,
                                         strict=True))
        summary.add_row(r.layout, r.transfers, f"{call:.3f}",
                        f"{r.bytes_sent_per_rank / 2**20:.1f}", f"{r.overlap_ratio:.3f}",
                        f"{r.imbalance_measured:.3f}", f"{r.imbalance_theoretical:.3f}", *step,
                        f"{r.work_efficiency:.3f}", f"{r.compute_seconds_max:.3f}",
                        f"{r.single_process_seconds:.3f}")
    # The summary does not fit 80 columns (rich's width when output is piped).
    Console(width=max(out.width, 140)).print(summary)
