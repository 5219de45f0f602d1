"""Recovery from a node's death on a local multi-node Ray cluster: ringray vs Ray Train v2.

    python benchmarks/recovery.py                        # restart: both systems
    python benchmarks/recovery.py --scenario replicas    # replica groups (torchft): both
    python benchmarks/recovery.py --scenario all --repeat 3   # everything, with medians
    python benchmarks/recovery.py --skip-ray-train       # ringray alone
    python benchmarks/recovery.py --json
    python benchmarks/recovery.py --hosts --faults kill,partition   # on real hosts (root)

**restart**: seconds from the death of the node running a CP=2 ring to the first training
step completed after the restart, how soon the failure was noticed, and the steps done
again, for ringray's service and for Ray Train v2's ``TorchTrainer`` training the same model
with the same checkpoints. **replicas**: two replica groups averaging through torchft
(ringray's ``parallel.dp_replicate: 2``; Ray Train v2's ``TorchftConfig``), one group's node
killed: seconds to the survivors' next committed step, to the replacement's first step
committed with them, the steps rolled back and the samples dropped. Ray Train needs the
``bench`` extra (``pip install -e '.[bench]'``). What exactly is measured, and how, is in
``recovery_common.py`` next to this script; ringray's side is in ``recovery_ringray.py``,
Ray Train's in ``recovery_ray_train.py``.

With ``--hosts`` each Ray node runs on a host of its own (``recovery_hosts.py``: network
namespaces with their own addresses and host names, ``tests/hosts.py``), the driver joins
the head host's network, and the node's death is, per ``--faults``, a kill (every process of
its host) or a partition (its link cut; the host lives on, unreachable).

Everything the Ray processes print (raylet and worker logs, node deaths) goes to
``<work dir>/ray-output.log``; the terminal shows only the progress lines, the table and
where that log is. Without ``--work-dir`` the work dir is a new temporary directory that is
kept, so the log can be read afterwards.
"""

import os
import sys

# Ray reads these when it is imported (and the nodes started here inherit them): loopback
# addresses stay as they are, test clusters need no auth token, and Ray Train is v2.
# On real hosts (--hosts) the nodes have addresses of their own: multi-node Ray is allowed.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1" if "--hosts" in sys.argv else "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

# The helper modules sit next to this script (also when it is run as `python -m`).
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TextIO  # noqa: E402

from recovery_common import (  # noqa: E402
    SCENARIOS,
    Log,
    RecoveryBenchOptions,
    RecoveryResult,
    local_cluster,
    recovery_table,
    summarize,
    with_load,
)
from recovery_ray_train import (  # noqa: E402
    SYSTEM_TORCHFT,
    ray_train_missing,
    run_ray_train,
    run_ray_train_torchft,
)
from recovery_ringray import (  # noqa: E402
    SYSTEM_REPLICAS,
    SYSTEM_STANDBY,
    run_ringray,
    run_ringray_replicas,
    run_ringray_standby,
)
from rich.console import Console  # noqa: E402

RAY_OUTPUT_LOG = "ray-output.log"


# Per scenario: the cluster's shape (worker nodes, the head's CPUs) and the systems.
CLUSTERS = {"restart": {"worker_nodes": 2, "head_cpus": 0},
            # two replica groups on a node each and a spare; the head's CPU is for Ray
            # Train's Lighthouse actor (it asks for one; ringray's asks for none)
            "replicas": {"worker_nodes": 3, "head_cpus": 1}}


def run_recovery_bench(
    options: RecoveryBenchOptions, *, log: Log = print, faults: tuple[str, ...] = ()
) -> list[RecoveryResult]:
    """Each system of each scenario ``options.repeats`` times, alternating (so that a
    shared machine's load drifts over all alike), each run on a fresh local cluster, or,
    with ``faults`` (``kill``, ``partition``), on fresh real hosts once per fault."""
    ray_train = options.ray_train and ray_train_missing() is None
    if options.ray_train and not ray_train:
        log(ray_train_missing())
    systems = {
        "replicas": [(SYSTEM_REPLICAS, run_ringray_replicas), (SYSTEM_STANDBY, run_ringray_standby)]
        + ([(SYSTEM_TORCHFT, run_ray_train_torchft)] if ray_train else []),
        "restart": [("ringray", run_ringray)]
        + ([("Ray Train v2", run_ray_train)] if ray_train else []),
    }
    results = []
    for run in range(1, options.repeats + 1):
        for scenario in options.scenarios:
            for fault in faults or (None,):
                for name, measure in systems[scenario]:
                    label = scenario if fault is None else f"{scenario}, {fault}"
                    work_dir = Path(options.work_dir) / (
                        f"run{run}" if fault is None else f"run{run}-{fault}")
                    log(f"{name}, {label}, run {run} of {options.repeats} "
                        f"(load average {os.getloadavg()[0]:.1f})")
                    try:
                        with _cluster(options, scenario, fault, work_dir) as nodes:
                            result = measure(options, nodes, work_dir, log)
                    except Exception as exc:  # one run's harness failure: recorded
                        log(f"{name}, {label}, run {run}: {type(exc).__name__}: {exc}")
                        result = RecoveryResult(
                            system=name, scenario=scenario, death_to_first_step_seconds=None,
                            detection_seconds=None, ready_seconds=None, steps_lost=None,
                            restarts=0, final_step=0, finished=False,
                            note=f"harness error: {type(exc).__name__}: {exc}"[:300])
                    results.append(replace(with_load(result), run=run, scenario=label))
    return results


def _cluster(options: RecoveryBenchOptions, scenario: str, fault: str | None, work_dir: Path):
    """A fresh local cluster, or (``fault`` given: ``--hosts``) a cluster on real hosts."""
    if fault is None:
        return local_cluster(slots_per_node=options.slots_per_node, **CLUSTERS[scenario])
    from recovery_hosts import host_cluster

    return host_cluster(slots_per_node=options.slots_per_node, fault=fault,
                        log_dir=work_dir / "hosts", **CLUSTERS[scenario])


@contextmanager
def output_to(log_path: Path) -> Iterator[TextIO]:
    """Point file descriptors 1 and 2 at ``log_path`` (appending) until the block ends, and
    yield a text stream on the original stderr.

    Redirecting the descriptors, not just ``sys.stdout``, is what silences Ray: its node
    processes (GCS, raylets, workers) inherit this process's descriptors 1 and 2 when the
    clusters start them, and its C++ core writes to them directly."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(saved_err), "w", buffering=1)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for fd in (saved_out, saved_err, log_fd):
            os.close(fd)
        terminal.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="restart",
                        help="restart: from the last checkpoint (default); replicas: replica "
                             "groups over torchft; all: both, in each run")
    parser.add_argument("--steps", type=int, default=30, help="steps of each restart job")
    parser.add_argument("--kill-after", type=int, default=15,
                        help="kill the node once this many steps are done")
    parser.add_argument("--checkpoint-interval", type=int, default=10)
    defaults = RecoveryBenchOptions(work_dir="")
    parser.add_argument("--replica-steps", type=int, default=defaults.replica_steps,
                        help="steps of each replicas job (the replacement must join before "
                             "the end)")
    parser.add_argument("--replica-tail-steps", type=int, default=defaults.replica_tail_steps,
                        help="stop a replicas job once the replacement has committed this "
                             "many steps with the survivors (0: run all --replica-steps)")
    parser.add_argument("--replica-checkpoint-interval", type=int,
                        default=defaults.replica_checkpoint_interval)
    parser.add_argument("--replica-heartbeat", type=float,
                        default=defaults.replica_heartbeat_seconds,
                        help="seconds: the Lighthouse's heartbeat and join timeouts, both "
                             "systems (default: ringray's cluster.replica_heartbeat_seconds)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each system, alternating; medians are added")
    parser.add_argument("--work-dir", default=None,
                        help="where runs, checkpoints and logs go (default: a new temporary "
                             "dir, kept)")
    parser.add_argument("--skip-ray-train", action="store_true",
                        help="measure ringray alone")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--hosts", action="store_true",
                        help="each node on a host of its own (network namespaces; root)")
    parser.add_argument("--faults", default="kill",
                        help="with --hosts: how the node dies, comma-separated: kill "
                             "(every process of its host), partition (its link cut)")
    args = parser.parse_args()
    faults = tuple(f for f in args.faults.split(",") if f) if args.hosts else ()
    bad = [f for f in faults if f not in ("kill", "partition")]
    if args.hosts and (bad or not faults):
        parser.error(f"--faults: {','.join(bad) or 'none given'}; valid: kill, partition")
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    if "restart" in scenarios and args.kill_after >= args.steps:
        parser.error(f"--kill-after ({args.kill_after}) must be below --steps ({args.steps})")
    if "replicas" in scenarios and args.kill_after >= args.replica_steps:
        parser.error(f"--kill-after ({args.kill_after}) must be below --replica-steps "
                     f"({args.replica_steps})")

    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="ringray-recovery-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir.resolve() / RAY_OUTPUT_LOG
    options = RecoveryBenchOptions(
        work_dir=str(work_dir), steps=args.steps, kill_after_step=args.kill_after,
        checkpoint_interval=args.checkpoint_interval, seq_len=args.seq,
        ray_train=not args.skip_ray_train, repeats=args.repeat, scenarios=scenarios,
        replica_steps=args.replica_steps, replica_tail_steps=args.replica_tail_steps,
        replica_checkpoint_interval=args.replica_checkpoint_interval,
        replica_heartbeat_seconds=args.replica_heartbeat,
    )
    where = f"Ray's output (raylets, workers, node deaths): {log_path}"
    try:
        with output_to(log_path) as terminal:
            err = Console(file=terminal, highlight=False, markup=False)
            results = run_recovery_bench(options, log=err.print, faults=faults)
    except BaseException:
        print(where, file=sys.stderr, flush=True)
        raise

    if args.json:
        json.dump({"options": asdict(options), "results": [asdict(r) for r in results],
                   "medians": [asdict(r) for r in summarize(results)],
                   "load_average": os.getloadavg()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out = Console(width=max(Console().width, 100))  # rich assumes 80 columns off a tty
        out.print(recovery_table(results, options))
        for r in results:
            if r.note:
                out.print(f"{r.system}, {r.scenario} (run {r.run}): {r.note}",
                          highlight=False)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        out.print(f"load average at the end (1, 5, 15 min): {load}; {os.cpu_count()} CPUs",
                  highlight=False)
    sys.stdout.flush()
    print(where, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
