"""``ringray plan SPEC``: will a job fit its cluster (memory, overlap, recommended cp and
Ulysses degree)?"""

from __future__ import annotations

import json
import sys

import typer

from ringray.cli.common import fail


def plan(
    spec_path: str = typer.Argument(
        ..., metavar="SPEC", help="Job spec (YAML), e.g. jobs/llama-1b-128k-h100.yaml."
    ),
    cluster: str | None = typer.Option(
        None, "--cluster",
        help="NODESxGPUSxACCELERATOR, e.g. 4x8xH100 (NVLink inside a node, InfiniBand "
        "between). Known accelerators: H100, H200, A100, L40S, L4.",
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
    documents: str | None = typer.Option(
        None, "--documents", metavar="SPEC",
        help="Plan the ring's steps for packed documents of this mix: stdlib, "
        "lognormal:MEAN[:SIGMA] or fixed:LEN (one sequence's lengths)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Will a job fit its cluster? Memory, ring overlap, Ulysses, recommended cp, verdict.

    Memory per device: weights, gradients and AdamW state (replicated or FSDP),
    activations (the ring's per-layer accounting), the ring's K/V buffers, and NCCL's
    buffers beside them (the ring's P2P peers and the FSDP communicator).
    Overlap: the threshold block c >= F/B x constant vs the ring's block per rank.
    Ulysses x ring: for each ulysses dividing cp, the all-to-all seconds (inside a
    node) beside the ring's transfer and exposed seconds, and the recommended ulysses.
    Step plan: with packed documents (--documents) or sliding windows, the time and bytes
    of one layer's ring from the transfer plan the ring runs, beside the plain ring's.
    Exit code 0 when the job fits, 1 when it does not, 2 for a usage error.

    Examples:

      ringray plan jobs/llama-1b-128k-h100.yaml --cluster 1x8xH100

      ringray plan jobs/llama-8b-1m-64xh100.yaml --cluster 8x8xH200 --json

      ringray plan jobs/quickstart.yaml --gpu-tflops 300 --link-gbps 100 --gpu-mem-gib 24

      ringray plan jobs/llama-1b-128k-h100.yaml --cluster 2x8xH100 --set parallel.ulysses=2

      ringray plan jobs/quickstart.yaml --cluster 1x8xH100 --documents stdlib
    """
    from ringray.capacity import PlanError, custom_cluster, parse_cluster, plan_job
    from ringray.spec import JobSpecError, load_job_spec

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
        # The job file and a pretrained model's config.json alone: the plan reads no weights,
        # tokenizer or data, and creates no run directory (a laptop can plan a cluster job).
        spec = load_job_spec(spec_path, overrides, check_paths=False)
        report = plan_job(spec.train_options(), shape, name=spec.name, documents=documents)
    except (JobSpecError, PlanError) as exc:
        fail(str(exc).replace("\n", "; "))
    if as_json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        typer.echo(report.format())
    if not report.fits:
        raise typer.Exit(code=1)
