"""The ``ringray`` command line.

    ringray train jobs/quickstart.yaml                 # an embedded local Ray
    ringray train jobs/quickstart.yaml --address auto  # the Ray cluster this machine is in
    ringray bench ring --world 4 --seq 16384 --heads 8 --kv-heads 2 --head-dim 64
    ringray bench kernel --seqs 4096,8192,16384
    ringray dashboards push --url http://localhost:3000 --token $GRAFANA_TOKEN
    ringray report runs/quickstart                     # PNG plots of a run's steps

Errors are one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict, replace
from pathlib import Path

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
    _err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
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


@bench_app.command("kernel")
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
        lengths = tuple(int(n) for n in seqs.split(",") if n.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        _fail(f"--seqs: expected comma-separated positive integers, got {seqs!r}")
    if heads % kv_heads:
        _fail(f"--kv-heads: {kv_heads} must divide --heads {heads}")
    if dtype not in ("bfloat16", "float16"):
        _fail(f"--dtype: {dtype!r} is not one of bfloat16, float16")
    from ringray.attention import make_layout

    try:
        for seq in lengths:  # the virtual ring cuts each length into --blocks zigzag blocks
            make_layout("zigzag", blocks, seq)
    except ValueError as exc:
        _fail(f"--seqs/--blocks: {exc}")
    cuda = torch.cuda.is_available()
    if not cuda:
        # Without a GPU the kernels can only run in Triton's interpreter, which must be
        # chosen before they are defined (that is, before the modules below are imported).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ringray.bench import kernel as kb

    out = Console()
    report: dict[str, list] = {}
    if not cuda:
        _err.print("kernel speed needs a CUDA GPU and there is none here: running the "
                   "correctness smoke only (Triton interpreter vs float64 reference)",
                   highlight=False)
    with _err.status("correctness smoke..."):
        report["smoke"] = kb.run_smoke(torch.device("cuda" if cuda else "cpu"))
    if cuda:
        cfg = kb.KernelBenchConfig(seqs=lengths, batch=batch, heads=heads,
                                   kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                   ring_blocks=blocks, warmup=warmup, iters=iters)
        _err.print(f"GPU: {torch.cuda.get_device_name()}; {dtype}, batch {batch}, heads "
                   f"{heads}/{kv_heads}, head_dim {head_dim}", highlight=False)
        with _err.status("timing..."):
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
        _err.print("[bold red]error:[/] the correctness smoke failed", highlight=False)
        raise typer.Exit(code=1)


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


dashboards_app = typer.Typer(help="Grafana dashboards (kept as code in ringray.dashboards).",
                             no_args_is_help=True)
app.add_typer(dashboards_app, name="dashboards")


@dashboards_app.command("export")
def dashboards_export(
    directory: str = typer.Argument(..., metavar="DIR",
                                    help="Directory to write the JSON files into."),
) -> None:
    """Write the dashboards' JSON (ringray-job.json, ringray-ring.json) into DIR.

    Example: ringray dashboards export infra/grafana/dashboards
    """
    from ringray.dashboards import write_dashboards

    try:
        paths = write_dashboards(directory)
    except OSError as exc:
        _fail(f"DIR {directory}: {exc.strerror or exc}")
    for path in paths:
        Console().print(str(path), highlight=False)


@dashboards_app.command("push")
def dashboards_push(
    url: str = typer.Option(..., "--url", envvar="GRAFANA_URL",
                            help="Grafana's address, e.g. https://grafana.example.com "
                            "(or $GRAFANA_URL)."),
    token: str = typer.Option(..., "--token", envvar="GRAFANA_TOKEN",
                              help="A Grafana service-account token (or $GRAFANA_TOKEN, which "
                              "keeps it out of the shell history)."),
    folder: str | None = typer.Option(None, "--folder",
                                      help="Folder to put them in (created if missing); "
                                      "default: General."),
) -> None:
    """Create or update the dashboards on a Grafana server (same uids: updates in place).

    Example: ringray dashboards push --url http://localhost:3000 --token $TOKEN --folder ringray
    """
    from ringray.dashboards.push import DashboardPushError, push_dashboards

    try:
        pushed = push_dashboards(url=url, token=token, folder=folder)
    except DashboardPushError as exc:
        _fail(str(exc))
    for board in pushed:
        Console().print(f"{board.title}: {board.url} (version {board.version})",
                        highlight=False)


@app.command("report")
def report(
    run: str = typer.Argument(..., metavar="RUN", help="Run directory, e.g. runs/quickstart."),
    out: str | None = typer.Option(None, "--out", help="Directory for the PNGs; default: "
                                   "RUN/report."),
) -> None:
    """PNG plots of a run's loss, tokens/s, overlap and load imbalance per step.

    Example: ringray report runs/quickstart
    """
    from ringray.report import ReportError, write_report

    try:
        paths = write_report(run, out)
    except ReportError as exc:
        _fail(str(exc))
    for path in paths:
        typer.echo(str(path))


@app.command("plan")
def plan(
    spec_path: str = typer.Argument(
        ..., metavar="SPEC", help="Job spec (YAML), e.g. jobs/llama-1b-128k-h100.yaml."
    ),
    cluster: str | None = typer.Option(
        None, "--cluster",
        help="NODESxGPUSxACCELERATOR, e.g. 4x8xH100 (NVLink inside a node, InfiniBand "
        "between). Known accelerators: H100, H200, A100.",
    ),
    gpu_tflops: float | None = typer.Option(
        None, "--gpu-tflops", help="A custom device: dense bf16 peak, TFLOP/s."),
    link_gbps: float | None = typer.Option(
        None, "--link-gbps", help="A custom device: ring link speed, Gb/s, one direction."),
    gpu_mem_gib: float | None = typer.Option(
        None, "--gpu-mem-gib", help="A custom device: memory, GiB."),
    overrides: list[str] = typer.Option(  # noqa: B008 - typer's documented form
        [], "--set", help="Override a spec field (repeatable), e.g. parallel.cp=16."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Will a job fit its cluster? Memory, ring overlap, recommended cp, verdict.

    Memory per device: weights, gradients and AdamW state (replicated),
    activations (the ring's per-layer accounting) and the ring's K/V buffers.
    Overlap: the threshold block c >= F/B x constant vs seq_len / cp per rank.
    Exit code 0 when the job fits, 1 when it does not, 2 for a usage error.

    Examples:

      ringray plan jobs/llama-1b-128k-h100.yaml --cluster 1x8xH100

      ringray plan jobs/llama-8b-1m-64xh100.yaml --cluster 8x8xH200 --json

      ringray plan jobs/quickstart.yaml --gpu-tflops 300 --link-gbps 100 --gpu-mem-gib 24
    """
    from ringray.config import JobSpecError, load_job_spec
    from ringray.plan import PlanError, custom_cluster, parse_cluster, plan_job

    custom = {"--gpu-tflops": gpu_tflops, "--link-gbps": link_gbps,
              "--gpu-mem-gib": gpu_mem_gib}
    given = [flag for flag, value in custom.items() if value is not None]
    try:
        if cluster is not None and given:
            raise PlanError(f"--cluster: give it or the custom device flags ({', '.join(given)}), "
                            f"not both")
        if cluster is not None:
            shape = parse_cluster(cluster)
        elif len(given) == len(custom):
            shape = custom_cluster(tflops=gpu_tflops, link_gbps=link_gbps,
                                   memory_gib=gpu_mem_gib)
        else:
            missing = [flag for flag in custom if flag not in given]
            raise PlanError(
                f"--cluster: required, e.g. 4x8xH100 (NODESxGPUSxACCELERATOR), unless a custom "
                f"device is given by --gpu-tflops, --link-gbps and --gpu-mem-gib (missing: "
                f"{', '.join(missing)})")
        report = plan_job(load_job_spec(spec_path, overrides), shape)
    except (JobSpecError, PlanError) as exc:
        _fail(str(exc).replace("\n", "; "))
    if as_json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        typer.echo(report.format())
    if not report.fits:
        raise typer.Exit(code=1)


@app.command("train")
def train(
    spec_path: str = typer.Argument(
        ..., metavar="SPEC", help="Job spec (YAML), e.g. jobs/quickstart.yaml."
    ),
    address: str | None = typer.Option(
        None, "--address",
        help="Ray cluster to run on ('auto', host:port, ray://...); default: $RAY_ADDRESS, "
        "else an embedded local Ray that ends with the command.",
    ),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Override train.steps."),
    overrides: list[str] = typer.Option(  # noqa: B008 - typer's documented form
        [], "--set", help="Override a spec field (repeatable), e.g. train.seq_len=8192."
    ),
) -> None:
    """Run a job on Ray: place its rings, train, recover from failures, follow progress.

    Ctrl-C checkpoints at the next step and stops (a second Ctrl-C detaches and leaves a job
    on a cluster running; `ringray train` with the same spec reattaches).

    Example: ringray train jobs/quickstart.yaml --steps 20 --set train.seq_len=2048
    """
    spec = load_spec(spec_path, overrides, steps=steps)
    train_options = spec.train_options()
    cluster_options = spec.cluster_options()
    train_options = replace(
        train_options, run_dir=_absolute(train_options.run_dir),
        checkpoint_path=_absolute(train_options.checkpoint_location),
    )
    address = address or os.environ.get("RAY_ADDRESS")
    world = cluster_options.dp_max * cluster_options.cp
    _err.print(
        f"ringray: job {cluster_options.job_name!r}, {train_options.model.num_params() / 1e6:.2f}M"
        f"-parameter model, dp={cluster_options.dp_max} × cp={cluster_options.cp} "
        f"({train_options.layout}), seq {train_options.seq_len}, {train_options.steps} steps, "
        f"on {'Ray at ' + address if address else 'an embedded local Ray'}",
        highlight=False,
    )
    _write_effective_spec(spec, train_options.run_dir)
    _run_on_ray(train_options, cluster_options, address=address, world=world)


def load_spec(spec_path: str, overrides: list[str], *, steps: int | None,
              check_paths: bool = True):
    """The validated spec with ``--set`` and ``--steps`` applied, checked as far as
    `ringray train` needs (its mesh too); a bad one ends the command in one line."""
    from ringray.config import JobSpecError, load_job_spec

    if steps is not None:
        overrides = [*overrides, f"train.steps={steps}"]
    try:
        spec = load_job_spec(spec_path, overrides, check_paths=check_paths)
        spec.cluster_options()
    except JobSpecError as exc:
        _fail(str(exc).replace("\n", "; "))
    return spec


def _absolute(location: str) -> str:
    """A local path made absolute (workers and the controller do not share our cwd)."""
    return location if "://" in location else str(Path(location).expanduser().resolve())


def _write_effective_spec(spec, run_dir: str) -> None:
    """The spec as run (overrides applied, run_dir absolute) as ``RUN/job.yaml``, so that
    ``ringray resume RUN`` can run the job again."""
    import yaml

    data = spec.model_dump(mode="json")
    data["run_dir"] = run_dir
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "job.yaml").write_text(
        "# The job as run by `ringray train` (overrides applied); `ringray resume` reads it.\n"
        + yaml.safe_dump(data, sort_keys=False)
    )


def _run_on_ray(train_options, cluster_options, *, address: str | None, world: int) -> None:
    from ringray.cluster.launch import (
        connect,
        follow,
        job_status,
        release,
        request_stop,
        start_controller,
    )

    if address is None:
        # An embedded Ray listens on loopback only and ends with this command: Ray 2.60's
        # token authentication protects nothing there, and its token file outlives the run.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with _err.status("starting Ray..." if address is None else f"connecting to {address}..."):
        try:
            embedded = connect(address, local_cpus=max(world, os.cpu_count() or 1))
        except (ConnectionError, ValueError, RuntimeError) as exc:
            _fail(f"--address {address}: cannot connect to Ray ({str(exc).splitlines()[0]})"
                  if address else f"cannot start a local Ray: {exc}")
    if embedded:  # nothing can join an embedded Ray: do not wait for capacity
        cluster_options = replace(cluster_options, capacity_wait_seconds=0,
                                  request_resources=False)
    controller, reattached = start_controller(train_options, cluster_options)
    if reattached:
        _err.print(f"reattached to the running job {cluster_options.job_name!r}")
    url = job_status(controller).metrics_url
    if url:
        _err.print(f"metrics: {url} (Prometheus; dashboards in dashboards/)", highlight=False)
    view = _TrainView(train_options.steps)
    final = None
    # `ringray stop` (Ray's job stop) sends SIGTERM: handled like Ctrl-C, checkpoint and stop.
    signal.signal(signal.SIGTERM, _interrupt)
    with view:
        while final is None:
            try:
                final = follow(controller, on_status=view.update)
            except KeyboardInterrupt:
                if view.stopping:
                    _err.print("detached; the job goes on (ringray train with the same spec "
                               "reattaches)")
                    raise typer.Exit(code=130) from None
                view.stopping = True
                view.say("stopping: checkpoint at the next step boundary (Ctrl-C again to "
                         "detach)")
                request_stop(controller)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    release(controller)
    _report_end(final, train_options.run_dir)
    if final.state == "stopped":
        raise typer.Exit(code=130)  # stopped by Ctrl-C: checkpointed, but not finished


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class _TrainView:
    """A progress bar with one live line, and the controller's events printed above it."""

    def __init__(self, total_steps: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("[bold]{task.fields[state]:<13}"), BarColumn(bar_width=24),
            MofNCompleteColumn(), TextColumn("{task.fields[line]}"),
            console=_err, transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, state="placing",
                                           line="")
        self.events_seen = 0.0
        self.stopping = False

    def __enter__(self) -> _TrainView:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def say(self, message: str) -> None:
        self.progress.console.print(message, highlight=False)

    def update(self, status) -> None:
        for event in status.events:
            if event.time > self.events_seen:
                self.events_seen = event.time
                if not event.message.startswith("state: "):
                    self.say(f"  {event.message}")
        self.progress.update(self.task, completed=status.step, state=status.state,
                             line=format_status_line(status))


def format_status_line(status) -> str:
    """step, loss, tokens/s, overlap, imbalance, world size, restarts: the live line."""
    stats = status.last_stats
    world = f"world {status.world_size}/{status.target_dp * status.cp}"
    restarts = f"restarts {len(status.restarts)}"
    if stats is None:
        return f"{world}  {restarts}"
    return (f"loss {stats.loss:.4f}  {stats.tokens_per_second:,.0f} tok/s  "
            f"overlap {stats.overlap_ratio:.3f}  imbalance {stats.load_imbalance:.3f}  "
            f"{world}  {restarts}")


def _report_end(status, run_dir: str) -> None:
    out = Console()
    if status.restarts:
        table = Table(title="restarts", title_justify="left")
        for col in ("reason", "at step", "resumed from", "lost steps", "recovery s", "world"):
            table.add_column(col, justify="right")
        for r in status.restarts:
            table.add_row(
                r.reason, str(r.failed_at_step), _or_dash(r.resumed_from_step),
                _or_dash(r.lost_steps),
                f"{r.recovery_seconds:.1f}" if r.recovery_seconds is not None else "-",
                f"{r.world_size_before} → {_or_dash(r.world_size_after)}",
            )
        out.print(table)
    if status.state == "failed":
        _fail(f"job {status.job_name!r} failed at step {status.step}: {status.error}")
    out.print(f"job {status.job_name!r} {status.state} at step {status.step}/"
              f"{status.total_steps}; run directory {run_dir} (steps.jsonl, events.jsonl"
              f"{', passkey.json' if (Path(run_dir) / 'passkey.json').exists() else ''})",
              highlight=False)


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


# The commands for jobs on a remote cluster (submit, list, status, logs, stop, resume) live
# in their own module; importing it registers them on `app`.
from ringray import cli_jobs  # noqa: E402, F401


def main() -> None:
    app()


if __name__ == "__main__":
    main()
