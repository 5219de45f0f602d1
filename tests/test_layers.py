"""The layers of ARCHITECTURE.md are import contracts (``[tool.importlinter]`` in
pyproject.toml): the package keeps them, and a wrong import, made in a scratch copy of the
package, breaks them with a message that names the import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _lint_imports(project: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(project)}  # the copy, not the installed package
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--config", str(project / "pyproject.toml")],
        cwd=project, env=env, capture_output=True, text=True, timeout=120,
    )


def _scratch_copy(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "ringray", project / "ringray",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    return project


def test_the_package_keeps_its_contracts(tmp_path: Path) -> None:
    result = _lint_imports(_scratch_copy(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Contracts: 3 kept, 0 broken." in result.stdout


def test_a_wrong_import_breaks_the_contracts(tmp_path: Path) -> None:
    """The trainer reaching up into the service, and the model importing Ray: both named."""
    project = _scratch_copy(tmp_path)
    with (project / "ringray/train/schedule.py").open("a") as f:
        f.write("\nfrom ringray.cluster import policy  # noqa: E402,F401 - deliberately wrong\n")
    with (project / "ringray/model/config.py").open("a") as f:
        f.write("\nimport ray  # noqa: E402,F401 - deliberately wrong\n")
    result = _lint_imports(project)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "ringray.train is not allowed to import ringray.cluster" in result.stdout
    assert "ringray.train.schedule -> ringray.cluster.policy" in result.stdout
    assert "ringray.model is not allowed to import ray" in result.stdout
    assert "Contracts: 1 kept, 2 broken." in result.stdout
