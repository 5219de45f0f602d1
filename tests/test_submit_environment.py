"""What `ringray submit` asks of a cluster, without one: the job's pip packages, requirement
names, the one-line error of ``python -m ringray`` when a dependency is missing, and the
one-line status message. (tests/test_cli_submit_stock.py runs all of it on a real stock
cluster.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ringray.__main__ import missing_module_line
from ringray.cli.jobs import _short_message
from ringray.cluster.jobs import (
    CLUSTER_PROVIDED,
    job_requirements,
    requirement_name,
    runtime_env,
    submission_request,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("requirement", "name"), [
    ("torch>=2.5", "torch"),
    ("triton; platform_system == 'Linux'", "triton"),
    ("ray[default]", "ray"),
    ("Prometheus_Client>=0.7", "prometheus-client"),
    ("grafana-foundation-sdk==1769699379!11.6.0", "grafana-foundation-sdk"),
    ("zope.interface", "zope-interface"),
])
def test_requirement_names_are_normalised_as_pypi_does(requirement, name):
    assert requirement_name(requirement) == name


def test_the_job_never_installs_torch_triton_or_ray():
    packages = job_requirements()
    assert packages, "ringray has dependencies a stock Ray image lacks"
    assert not {requirement_name(p) for p in packages} & CLUSTER_PROVIDED
    assert CLUSTER_PROVIDED == {"torch", "triton", "ray"}


def test_the_service_page_names_what_a_job_installs():
    """docs/service.md lists the packages a submission installs: a user building an image for
    `--no-pip` from that list must not miss one (crc32c and torchft once were)."""
    text = (ROOT / "docs" / "service.md").read_text()
    start = text.index("**What\n`submit` brings:**")
    listed = text[start:text.index(")", start)].split("(", 1)[1].replace("\n", " ")
    assert {n.strip() for n in listed.split(",")} == {
        requirement_name(r) for r in job_requirements()}


def test_an_installed_ringray_reads_its_metadata(tmp_path, monkeypatch):
    """Without a checkout's pyproject.toml beside the package, the installed distribution's
    requirements count, optional extras left out."""
    import ringray
    from ringray.cluster import jobs

    monkeypatch.setattr(ringray, "__file__", str(tmp_path / "site" / "ringray" / "__init__.py"))
    monkeypatch.setattr(jobs.metadata, "requires", lambda name: [
        "torch>=2.5", 'triton; platform_system == "Linux"', "typer", "ray[default]",
        'flash-attn; extra == "flash"', 'pytest; extra=="dev"', "grafana-client>=5"])
    assert job_requirements() == ["typer", "grafana-client>=5"]


def test_runtime_env_without_packages_has_no_pip_step():
    env = runtime_env(working_dir=str(ROOT), pip=[])
    assert "pip" not in env and "py_modules" not in env
    assert env["env_vars"] == {"RAY_JOB_STOP_WAIT_TIME_S": "120"}


def test_a_request_replaces_the_run_dir_override_and_records_its_packages():
    request = submission_request(spec_path="jobs/quickstart.yaml", job_name="q",
                                 overrides=["run_dir=/old", "train.steps=3"],
                                 run_dir="/new", working_dir=str(ROOT), pip=["einops"],
                                 submission_id="ringray-q-1")
    assert request.entrypoint == ("python -m ringray train jobs/quickstart.yaml --address auto "
                                  "--set train.steps=3 --set 'run_dir=\"/new\"'")
    assert request.metadata["ringray_overrides"] == 'train.steps=3\nrun_dir="/new"'
    assert request.metadata["ringray_pip"] == "einops"
    assert request.runtime_env["pip"]["packages"] == ["einops"]
    assert request.to_dict()["submission_id"] == "ringray-q-1"


@pytest.mark.parametrize("run_dir", ["~", "null", "#x", "123", "[a]", "/runs/a: b"])
def test_the_run_dir_reaches_the_cluster_as_the_string_given(run_dir: str) -> None:
    """It travelled as YAML: '~', 'null' and '#x' became None (the job wrote into Ray's
    temporary working directory, lost to resume), '123' a number the cluster refused."""
    from ringray.spec.load import apply_overrides

    request = submission_request(spec_path="jobs/quickstart.yaml", job_name="q",
                                 overrides=[], run_dir=run_dir, working_dir=str(ROOT), pip=[])
    (override,) = request.metadata["ringray_overrides"].splitlines()
    assert apply_overrides({}, [override]) == {"run_dir": run_dir}


def test_submit_refuses_a_relative_or_empty_run_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from ringray.cli import app

    monkeypatch.chdir(ROOT)
    for run_dir in ("runs/q", ""):
        result = CliRunner().invoke(app, ["submit", str(ROOT / "jobs/quickstart.yaml"),
                                          "--run-dir", run_dir, "--dry-run"])
        assert result.exit_code == 2, result.output
        assert f"error: --run-dir: {run_dir!r} is not an absolute path" in \
            " ".join(result.output.split())


def test_missing_module_lines_name_the_module_and_the_fix():
    line = missing_module_line("yaml.loader", "/opt/py/bin/python")
    assert line.startswith("error: ringray needs the Python module 'yaml', which "
                           "/opt/py/bin/python lacks: submit without --no-pip")
    assert "--pip pyyaml" in line and "pip install pyyaml" in line
    assert "--pip prometheus-client" in missing_module_line("prometheus_client", "p")
    torch = missing_module_line("torch", "p")
    assert "the cluster must provide torch itself" in torch and "--pip" not in torch


def test_python_m_ringray_with_a_missing_dependency_is_one_line():
    """The entrypoint a job runs, with ``typer`` made unimportable: one line on stderr, exit
    code 2, no traceback."""
    code = ("import runpy, sys; sys.modules['typer'] = None; "
            "runpy.run_module('ringray', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code, "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [missing_module_line("typer", sys.executable)]
    assert result.stdout == ""


def test_status_shows_rays_message_in_one_line():
    failed = ("Job entrypoint command failed with exit code 2, last available logs (truncated "
              "to 20,000 chars):\nerror: ringray needs the Python module 'typer' ...\n")
    assert _short_message(failed) == "Job entrypoint command failed with exit code 2"
    assert _short_message("Job finished successfully.") == "Job finished successfully."
    assert _short_message("") == ""


@pytest.mark.parametrize(("package", "message"), [
    ("torch", "error: --pip 'torch': the cluster's own (a job never installs ray, torch, "
              "triton"),
    ("foo; rm -rf /", "error: --pip 'foo; rm -rf /': not a pip requirement (Expected"),
])
def test_submit_refuses_a_pip_package_it_must_not_install(
        package: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both were sent: torch against the docs' promise, and a line pip fails on the cluster."""
    from typer.testing import CliRunner

    from ringray.cli import app

    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, ["submit", "jobs/quickstart.yaml", "--dry-run",
                                      "--pip", package])
    assert result.exit_code == 2, result.output
    assert " ".join(result.output.split()).startswith(message), result.output
