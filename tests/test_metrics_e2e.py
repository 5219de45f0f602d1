"""End to end with a real Prometheus: a real training job on a local Ray cluster serves its
metrics, Debian's `prometheus` (CI installs the package) scrapes them every second, and every
PromQL expression of every dashboard panel, with its variables substituted, returns data.
The alert and recording rules of ``infra/prometheus/rules.yml`` are loaded too and evaluate
without errors against the real series."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from distributed import free_loopback_port
from ray_cluster import LocalCluster, cluster_options, job_options, start_job, wait_until

from ringray.cluster.driver import release
from ringray.dashboards import panel_queries
from ringray.metrics import MetricsOptions
from ringray.metrics.catalog import CATALOG

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
RULES = ROOT / "infra" / "prometheus" / "rules.yml"
REQUIRES = {spec.name: spec.requires for spec in CATALOG}


def _query(base: str, expression: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _get(base: str, path: str) -> dict:
    with urllib.request.urlopen(f"{base}{path}", timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture()
def prometheus(tmp_path: Path):
    """A real Prometheus on a free loopback port; yields (base URL, config path writer)."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: install Debian's `prometheus` package (.ci/run does)"
    port = free_loopback_port()
    config = tmp_path / "prometheus.yml"
    processes = []

    def start(target: str) -> str:
        shutil.copy(RULES, tmp_path / "rules.yml")
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "rule_files: [rules.yml]\n"
            # honor_labels: the exporter's own job label (the ringray job's name) stays.
            "scrape_configs:\n  - job_name: ringray\n    honor_labels: true\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        processes.append(subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
        ))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as response:
                    if response.status == 200:
                        return base
            except OSError:
                pass
            if processes[0].poll() is not None or time.monotonic() > deadline:
                raise AssertionError((tmp_path / "prometheus.log").read_text()[-3000:])
            time.sleep(0.3)

    try:
        yield start
    finally:
        for process in processes:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def test_every_dashboard_query_returns_data_from_a_real_run(prometheus, tmp_path: Path) -> None:
    assert [p.name for p in DASHBOARDS] == ["ringray-job.json", "ringray-ring.json"]
    cluster = LocalCluster()
    try:
        cluster.add_node("slot_e2e", slots=4)
        options = job_options(str(tmp_path / "run"), parallel={"dp": 2},
                              train={"steps": 120, "global_batch": 2},
                              checkpoint={"interval": 20})
        controller = start_job("e2e", options, cluster_options("slot_e2e"),
                               metrics=MetricsOptions(port=0))
        try:
            status = wait_until(controller, lambda s: s.metrics_url is not None and s.step >= 1,
                                timeout=120, what="the metrics endpoint and a first step")
            target = urllib.parse.urlparse(status.metrics_url).netloc
            base = prometheus(target)
            status = wait_until(controller, lambda s: s.done, timeout=240, what="the job's end")
            assert status.state == "finished", status.error
            time.sleep(4)  # a few scrapes after the end, so rate() windows hold samples

            health = _get(base, "/api/v1/targets")["data"]["activeTargets"]
            assert [t["health"] for t in health] == ["up"], health
            missing, optional = [], []
            for path in DASHBOARDS:
                dashboard = json.loads(path.read_text())
                for title, expression in panel_queries(dashboard, job="e2e"):
                    answer = _query(base, expression)
                    assert answer["status"] == "success", (title, expression, answer)
                    if not answer["data"]["result"]:
                        # A series that exists only when the job asks for it (the catalog's
                        # ``requires``), which this job does not.
                        names = set(re.findall(r"ringray_[a-z0-9_]+", expression))
                        if names and all(REQUIRES.get(n) for n in names):
                            optional.append(title)
                        else:
                            missing.append(f"{path.name} / {title}: {expression}")
            assert not missing, "queries without data:\n" + "\n".join(missing)
            assert optional == ["Task score by length"]  # eval.tasks (tests/test_ruler.py)

            groups = _get(base, "/api/v1/rules")["data"]["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            assert rules, "rules.yml was not loaded"
            broken = [(r["name"], r.get("lastError")) for r in rules if r.get("health") == "err"]
            assert not broken, broken
        finally:
            release(controller)
    finally:
        cluster.shutdown()
