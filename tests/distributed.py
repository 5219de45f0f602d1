"""The multi-process test harness is the package's own launcher (one home for it)."""

from ringray.bench.gloo_ranks import RanksFailed, free_loopback_port, run_gloo_ranks

__all__ = ["RanksFailed", "free_loopback_port", "run_gloo_ranks"]
