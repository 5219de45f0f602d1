"""Recovery from a node's death on a local multi-node Ray cluster: ringray vs Ray Train v2.

    python benchmarks/recovery.py                    # both systems, side by side
    python benchmarks/recovery.py --skip-ray-train   # ringray alone
    python benchmarks/recovery.py --repeat 3          # alternating runs, with medians
    python benchmarks/recovery.py --json

Seconds from the death of the node running a CP=2 ring to the first training step completed
after the restart, how soon the failure was noticed, and the steps done again, for ringray's
service and for Ray Train v2's ``TorchTrainer`` training the same model with the same
checkpoints. Ray Train needs the ``bench`` extra (``pip install -e '.[bench]'``). The
measurement code, and what exactly is measured, is in ``ringray/cluster/recovery_bench.py``.
"""

import os

# Ray reads these when it is imported (and the nodes started here inherit them): loopback
# addresses stay as they are, test clusters need no auth token, and Ray Train is v2.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import asdict  # noqa: E402

from rich.console import Console  # noqa: E402

from ringray.cluster.recovery_bench import (  # noqa: E402
    RecoveryBenchOptions,
    recovery_table,
    run_recovery_bench,
    summarize,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps of each job")
    parser.add_argument("--kill-after", type=int, default=15,
                        help="kill the ring's node once this many steps are done")
    parser.add_argument("--checkpoint-interval", type=int, default=10)
    parser.add_argument("--seq", type=int, default=1024, help="sequence length")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each system, alternating; medians are added")
    parser.add_argument("--work-dir", default=None,
                        help="where runs, checkpoints and logs go (default: a temporary dir)")
    parser.add_argument("--skip-ray-train", action="store_true",
                        help="measure ringray alone")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.kill_after >= args.steps:
        parser.error(f"--kill-after ({args.kill_after}) must be below --steps ({args.steps})")

    err = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="ringray-recovery-") as scratch:
        options = RecoveryBenchOptions(
            work_dir=args.work_dir or scratch, steps=args.steps, kill_after_step=args.kill_after,
            checkpoint_interval=args.checkpoint_interval, seq_len=args.seq,
            ray_train=not args.skip_ray_train, repeats=args.repeat,
        )
        # Ray prints node deaths and raylet log tails to stdout: keep them off the results.
        with contextlib.redirect_stdout(sys.stderr):
            results = run_recovery_bench(options,
                                         log=lambda line: err.print(line, highlight=False))

    if args.json:
        json.dump({"options": asdict(options), "results": [asdict(r) for r in results],
                   "medians": [asdict(r) for r in summarize(results)]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    out = Console(width=max(Console().width, 100))  # rich assumes 80 columns off a terminal
    out.print(recovery_table(results, options))
    for r in results:
        if r.note:
            out.print(f"{r.system} (run {r.run}): {r.note}", highlight=False)


if __name__ == "__main__":
    main()
