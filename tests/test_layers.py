"""The package's layers are import contracts (``[tool.importlinter]`` in pyproject.toml):
the package keeps them, and a wrong import, made in a scratch copy of the package, breaks them
with a message that names the import. And no module of ringray takes part in an import
circle, counting every import statement (lazy ones inside functions and type-only ones too)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import grimp

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
    import tomllib

    result = _lint_imports(_scratch_copy(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:]
    count = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"])
    assert f"Contracts: {count} kept, 0 broken." in result.stdout


def test_a_wrong_import_breaks_the_contracts(tmp_path: Path) -> None:
    """The trainer reaching up into the service, the model importing Ray, the model's
    shapes reaching up to the checkpoint reader (the circle issue 23 removed), and the
    layouts reaching up to the pieces of a block pair (the planner's order): all named."""
    project = _scratch_copy(tmp_path)
    with (project / "ringray/train/schedule.py").open("a") as f:
        f.write("\nfrom ringray.cluster import policy  # noqa: E402,F401 - deliberately wrong\n")
    with (project / "ringray/model/config.py").open("a") as f:
        f.write("\nimport ray  # noqa: E402,F401 - deliberately wrong\n")
        f.write("\ndef _read():\n    from ringray.model.hf import read_model_config  # wrong\n")
    with (project / "ringray/attention/layouts.py").open("a") as f:
        f.write("\nfrom ringray.attention import pieces  # noqa: E402,F401 - deliberately wrong\n")
    result = _lint_imports(project)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "ringray.train is not allowed to import ringray.cluster" in result.stdout
    assert "ringray.train.schedule -> ringray.cluster.policy" in result.stdout
    assert "ringray.model is not allowed to import ray" in result.stdout
    assert "ringray.model.config is not allowed to import ringray.model.hf" in result.stdout
    assert "ringray.attention.layouts is not allowed to import ringray.attention.pieces" \
        in result.stdout
    assert "Contracts: 2 kept, 4 broken." in result.stdout


def import_circles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Every import circle among ``package``'s modules: the strongly connected components
    (Tarjan) of the module graph that hold more than one module, or one importing itself."""
    imports: Mapping[str, list[str]] = {
        module: sorted(m for m in graph.find_modules_directly_imported_by(module)
                       if m == package or m.startswith(package + "."))
        for module in sorted(graph.modules) if module == package or module.startswith(package + ".")
    }
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for imported in imports[module]:
            if imported not in order:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:  # module roots a component: pop it off the stack
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1 or module in imports[module]:
                circles.append(sorted(component))

    for module in imports:
        if module not in order:
            visit(module)
    return circles


def _describe(graph: grimp.ImportGraph, circle: list[str]) -> str:
    lines = []
    for importer in circle:
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if imported in circle:
                details = graph.get_import_details(importer=importer, imported=imported)
                where = ", ".join(str(d["line_number"]) for d in details)
                lines.append(f"{importer} -> {imported} (line {where})")
    return "\n".join(lines)


def test_no_import_circle_anywhere_in_ringray() -> None:
    """No module of ringray imports, through any chain, a module that imports it back (in
    ringray.model this held only through a lazy import, which this check counts)."""
    graph = grimp.build_graph("ringray", cache_dir=None)
    circles = import_circles(graph, "ringray")
    assert not circles, "\n\n".join(_describe(graph, circle) for circle in circles)


def test_the_circle_check_finds_a_circle() -> None:
    """The check above can fail: a three-module circle and a self-import are found, a chain
    and a package importing its own modules are not."""
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e"):
        graph.add_module(module)
    for importer, imported in [("pkg", "pkg.a"), ("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"),
                               ("pkg.c", "pkg.a"), ("pkg.d", "pkg.d"), ("pkg.e", "pkg.a")]:
        graph.add_import(importer=importer, imported=imported)
    assert import_circles(graph, "pkg") == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d"]]


def test_the_architecture_page_states_the_contracts_pyproject_holds() -> None:
    """docs/architecture.md names every contract of pyproject.toml beyond `layers` (their
    count in words) and gives `model-order`'s layers as pyproject.toml orders them."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    page = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    words = {3: "Three", 4: "Four", 5: "Five", 6: "Six"}
    assert f"{words[len(contracts) - 1]} more contracts:" in page
    for contract in contracts:
        if contract["id"] != "layers":
            assert f"**{contract['id']}" in page.lower() or f"`{contract['id']}`" in page, \
                contract["id"]
    order = next(c for c in contracts if c["id"] == "model-order")["layers"]
    assert f"`{' < '.join(reversed(order))}`" in page
