"""`ringray submit` to a stock Ray cluster: one whose Python has Ray and torch and nothing of
ringray's (no console script on its PATH, no pydantic-typer-rich-... stack beyond what Ray
itself pulls in).

The cluster is `ray start --head` from a virtual environment that holds only
``ray[default]`` and ``torch`` at the project's versions, built once into ``.venv-stock/`` at
the repository root (gitignored, about 1.5 minutes; rebuilt when the versions change) and
reused afterwards. Its PATH leads to that environment only, so neither ``ringray`` nor the
project's Python can be found there by accident.

Contracts pinned:
- the entrypoint is ``python -m ringray train ...`` and runs on the cluster's Python;
- the runtime environment's pip brings ringray's dependencies (pyproject.toml's, never torch,
  triton or Ray), so the quickstart runs to SUCCEEDED and ``logs``/``status`` show it;
- with ``--no-pip`` the missing dependency is one line naming it and the flags that fix it,
  no traceback, in ``ringray logs`` and in ``ringray status``;
- ``--dry-run`` prints what would be sent (JSON) and sends nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
from distributed import free_loopback_port
from ray_cluster import stop_processes_under
from typer.testing import CliRunner

from ringray.cli import app

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
RINGRAY = str(Path(sys.executable).parent / "ringray")
STOCK = ROOT / ".venv-stock"
STOCK_BIN = STOCK / "bin"
# The cluster's image: the project's Ray and torch (torch's public version: the Makefile's
# `torch==X` keeps the CPU build where the machine offers one).
STOCK_PACKAGES = (f"torch=={metadata.version('torch').split('+')[0]}",
                  f"ray[default]=={metadata.version('ray')}")
NEVER_INSTALLED = {"torch", "triton", "ray"}


def _stock_python() -> Path:
    """``.venv-stock``'s Python, built (or rebuilt, when the versions changed) first."""
    stamp = STOCK / ".ringray-stock"
    if stamp.is_file() and stamp.read_text() == " ".join(STOCK_PACKAGES):
        return STOCK_BIN / "python"
    shutil.rmtree(STOCK, ignore_errors=True)
    base_python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}"
    subprocess.run([str(base_python), "-m", "venv", str(STOCK)], check=True, timeout=300)
    installed = subprocess.run(
        [str(STOCK_BIN / "python"), "-m", "pip", "install", "--quiet", *STOCK_PACKAGES],
        capture_output=True, text=True, timeout=900)
    assert installed.returncode == 0, installed.stderr[-3000:]
    stamp.write_text(" ".join(STOCK_PACKAGES))
    return STOCK_BIN / "python"


def _cluster_env() -> dict[str, str]:
    """The stock cluster's environment: its own bin first, then the system's directories;
    no virtual environment, PYTHONPATH or console script of this project reachable."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "RAY_ADDRESS"}}
    env["PATH"] = f"{STOCK_BIN}:/usr/local/bin:/usr/bin:/bin"
    return env


def _start_head(temp_dir: str) -> str:
    """`ray start --head` from the stock environment on free ports, the dashboard agent's and
    the Ray client's included (their defaults, 52365 and 10001, may be held by another
    cluster on this machine); tried twice: a port picked free may be taken by the time Ray
    binds it. The dashboard's URL."""
    for _attempt in range(2):
        port, dashboard_port, agent_port, client_port = (free_loopback_port()
                                                         for _ in range(4))
        started = subprocess.run(
            [str(STOCK_BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=4",
             f"--temp-dir={temp_dir}", "--include-dashboard=true",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
             f"--dashboard-agent-listen-port={agent_port}",
             f"--ray-client-server-port={client_port}", "--disable-usage-stats"],
            env=_cluster_env(), cwd=temp_dir, capture_output=True, text=True, timeout=180,
        )
        if started.returncode == 0:
            return f"http://127.0.0.1:{dashboard_port}"
        stop_processes_under(temp_dir)
    raise AssertionError(f"ray start failed twice:\n{started.stdout[-2000:]}\n"
                         f"{started.stderr[-3000:]}")


@pytest.fixture(scope="module")
def stock_head():
    """A Ray head whose Python lacks ringray and its dependencies (the Jobs API's URL)."""
    python = _stock_python()
    missing = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('ringray'))"],
        env=_cluster_env(), cwd="/", capture_output=True, text=True, check=True)
    assert missing.stdout.strip() == "None", "ringray is importable in the stock cluster"
    assert shutil.which("ringray", path=_cluster_env()["PATH"]) is None
    temp_dir = tempfile.mkdtemp(prefix="rr-stock-", dir="/tmp")
    try:
        url = _start_head(temp_dir)
        deadline = time.monotonic() + 90
        while True:  # the dashboard's job module comes up after `ray start` returns
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the Ray dashboard never answered"
                time.sleep(1)
        yield url
    finally:
        stop_processes_under(temp_dir)
        # The directory holds the virtualenv Ray cloned for the job's pip step (about the
        # size of .venv-stock): removed in the background, the test need not wait for it.
        subprocess.Popen(["rm", "-rf", temp_dir], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _ringray(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([RINGRAY, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result


def _small(name: str) -> list[str]:
    return ["--steps", "2", "--set", f"name={name}", "--set", "train.seq_len=512",
            "--set", "parallel.cp=2", "--set", "checkpoint.interval=2",
            "--set", "eval.passkey_lengths=[]", "--set", "metrics.port=null"]


def _project_name(requirement: str) -> str:
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)[1]
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject_requirements() -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def _dry_run(*args: str) -> dict:
    """``ringray submit --dry-run`` in this process (no cluster, no --address), from the
    current directory; the JSON it printed."""
    result = CliRunner().invoke(app, ["submit", "jobs/quickstart.yaml", "--dry-run",
                                      *_small("dry"), *args])
    assert result.exit_code == 0, result.output
    assert "dry run: nothing was submitted" in result.stderr
    return json.loads(result.stdout)


# ---- --dry-run: no cluster needed ------------------------------------------------------------

def test_dry_run_prints_the_entrypoint_and_runtime_env_and_submits_nothing(tmp_path,
                                                                           monkeypatch):
    """Without --address (nothing is sent), the JSON names the entrypoint on the cluster's
    Python, the shipped directory, and pip with pyproject's dependencies minus torch, triton
    and Ray."""
    monkeypatch.chdir(ROOT)
    sent = _dry_run("--run-dir", str(tmp_path / "run"))
    assert sent["entrypoint"].startswith(
        "python -m ringray train jobs/quickstart.yaml --address auto --set name=dry ")
    assert sent["entrypoint"].endswith(f"--set train.steps=2 --set 'run_dir=\"{tmp_path}/run\"'")
    assert re.fullmatch(r"ringray-dry-\d{8}-\d{6}", sent["submission_id"])
    env = sent["runtime_env"]
    assert env["working_dir"] == str(ROOT)
    assert ".venv*" in env["excludes"] and "runs" in env["excludes"]
    assert "py_modules" not in env  # ringray/ travels inside the working directory
    expected = [r for r in _pyproject_requirements()
                if _project_name(r) not in NEVER_INSTALLED]
    assert env["pip"] == {"packages": expected, "pip_check": False}
    assert {"pydantic", "typer", "grafana-client", "matplotlib"} <= {
        _project_name(r) for r in expected}
    assert sent["metadata"]["ringray_job"] == "dry"
    assert sent["metadata"]["ringray_pip"].split("\n") == expected


def test_dry_run_with_no_pip_and_extra_packages(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert "pip" not in _dry_run("--no-pip")["runtime_env"]
    extra = _dry_run("--no-pip", "--pip", "flash-attn", "--pip", "einops")["runtime_env"]
    assert extra["pip"]["packages"] == ["flash-attn", "einops"]
    more = _dry_run("--pip", "einops")["runtime_env"]["pip"]["packages"]
    assert more[-1] == "einops" and len(more) > 1


def test_dry_run_outside_a_checkout_ships_the_package(tmp_path, monkeypatch):
    """Submitted from a directory without ringray's source, the package goes along as a
    ``py_modules`` entry, so the cluster can still run ``python -m ringray``."""
    (tmp_path / "jobs").mkdir()
    shutil.copy(ROOT / "jobs" / "quickstart.yaml", tmp_path / "jobs" / "quickstart.yaml")
    monkeypatch.chdir(tmp_path)
    env = _dry_run()["runtime_env"]
    assert env["working_dir"] == str(tmp_path)
    assert env["py_modules"] == [str(ROOT / "ringray")]


def test_submit_without_an_address_is_one_line(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    result = CliRunner().invoke(app, ["submit", "jobs/quickstart.yaml", *_small("no-address")])
    assert result.exit_code == 2
    assert "--address" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# ---- a stock cluster -------------------------------------------------------------------------

@pytest.mark.slow
def test_a_stock_cluster_runs_the_quickstart(stock_head: str, tmp_path: Path) -> None:
    address = ["--address", stock_head]
    run_dir = tmp_path / "run"
    submitted = _ok(_ringray("submit", "jobs/quickstart.yaml", *address, *_small("stock"),
                             "--run-dir", str(run_dir), "--json"))
    job = json.loads(submitted.stdout)["submission_id"]
    followed = _ok(_ringray("logs", job, "--follow", *address, timeout=420))
    assert "job 'stock' finished at step 2/2" in followed.stdout, followed.stdout[-3000:]
    assert f"{job}: SUCCEEDED" in followed.stderr
    status = json.loads(_ok(_ringray("status", job, *address, "--json")).stdout)
    assert status["status"] == "SUCCEEDED" and status["job_name"] == "stock"
    assert status["entrypoint"].startswith("python -m ringray train jobs/quickstart.yaml")
    steps = [json.loads(line)["step"] for line in
             (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    assert steps == [1, 2]
    shown = _ok(_ringray("status", job, *address)).stdout
    assert shown.startswith(f"{job}: SUCCEEDED") and "last line:" in shown


@pytest.mark.slow
def test_no_pip_on_a_stock_cluster_names_the_missing_module_in_one_line(
        stock_head: str, tmp_path: Path) -> None:
    address = ["--address", stock_head]
    job = _ok(_ringray("submit", "jobs/quickstart.yaml", *address, *_small("stock-bare"),
                       "--run-dir", str(tmp_path / "run"), "--no-pip")).stdout.strip()
    deadline = time.monotonic() + 180
    while (status := json.loads(_ok(_ringray("status", job, *address, "--json")).stdout))[
            "status"] not in {"FAILED", "SUCCEEDED", "STOPPED"}:
        assert time.monotonic() < deadline, status
        time.sleep(1)
    assert status["status"] == "FAILED"

    logs = _ok(_ringray("logs", job, *address)).stdout
    assert "Traceback" not in logs
    # Ray heads the log with lines of its own ("Runtime env is setting up.", "Running
    # entrypoint for job ..."); what the entrypoint printed follows.
    _, entrypoint_said = re.split(r"^Running entrypoint for job .*$", logs, maxsplit=1,
                                  flags=re.M)
    lines = [line for line in entrypoint_said.splitlines() if line.strip()]
    assert len(lines) == 1, logs
    line = lines[0]
    named = re.match(r"error: ringray needs the Python module '(\w+)', which (\S+) lacks: "
                     r"submit without --no-pip .* or add --pip ([\w-]+);", line)
    assert named, line
    module, python, package = named.groups()
    assert python.startswith(str(STOCK))  # the cluster's own Python ran it
    assert module not in NEVER_INSTALLED
    assert package in {_project_name(r) for r in _pyproject_requirements()}
    found = subprocess.run([python, "-c", f"import {module}"], env=_cluster_env(), cwd="/",
                           capture_output=True, text=True)
    assert found.returncode != 0  # really missing there

    shown = _ok(_ringray("status", job, *address)).stdout
    assert "Traceback" not in shown
    first, *rest = shown.splitlines()
    assert first.startswith(f"{job}: FAILED") and "exit code 2" in first
    assert f"  last line: {line}" in rest
