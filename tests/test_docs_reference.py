"""The generated pages, ``docs/job-file.md`` and ``docs/cli.md``, hold exactly what the code
generates (``python -m ringray.cli.reference --check``; regenerate with ``--write``), and the
generators cover every field and every command."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from ringray.cli import app
from ringray.cli.reference import CLI_MARKER, PAGES, cli_reference, main
from ringray.spec import JobSpec
from ringray.spec.reference import (
    JOB_SPEC_MARKER,
    job_spec_reference,
    read_block,
    replace_block,
)

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "python -m ringray.cli.reference --write"


def test_docs_pages_pass_check(capsys: pytest.CaptureFixture[str]) -> None:
    """``--check`` on this repository passes: both pages are current."""
    assert main(["--check", "--root", str(ROOT)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(("marker", "generate"), [(JOB_SPEC_MARKER, job_spec_reference),
                                                  (CLI_MARKER, cli_reference)])
def test_page_block_is_generated(marker: str, generate) -> None:
    """Each block lives in its own page (the diff of a stale one is shown here)."""
    page = ROOT / PAGES[marker]
    block = read_block(page.read_text(), marker)
    assert block is not None, f"{PAGES[marker]} has no {marker} markers"
    assert block == generate(), f"{PAGES[marker]}'s {marker} is stale: run {REGENERATE}"


def _dotted_fields(model: type, prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and hasattr(info.annotation, "model_fields"):
            out.extend(_dotted_fields(info.annotation, f"{prefix}{name}."))
        else:
            out.append(prefix + name)
    return out


def test_job_spec_reference_lists_every_field_with_its_description() -> None:
    reference = job_spec_reference()
    for dotted in _dotted_fields(JobSpec):
        assert f"| `{dotted}` |" in reference, dotted
    assert "| `train.optimizer.lr` | float (> 0) | `0.003` | Peak learning rate (AdamW). |" \
        in reference
    assert "| `eval.passkey_depths` | list of float (≥ 0, ≤ 1) | `[0.1, 0.5, 0.9]` |" in reference
    assert "| `cluster.accelerator` | 'cpu' or 'gpu' | `cpu` |" in reference
    assert "runs/&lt;name>" in reference  # not swallowed as an HTML tag


def test_cli_reference_lists_every_command() -> None:
    reference = cli_reference()
    root = typer.main.get_command(app)
    for name, command in root.commands.items():
        assert f"## `ringray {name}" in reference, name
        for sub in getattr(command, "commands", {}):
            assert f"## `ringray {name} {sub} " in reference or \
                f"## `ringray {name} {sub}`" in reference, f"{name} {sub}"
    assert "## `ringray train SPEC [OPTIONS]`" in reference
    assert "| `--set <list[str]>` | Override a spec field (repeatable)" in reference


def test_cli_reference_follows_the_app() -> None:
    """A command added to the app appears without touching the generator."""
    extra = typer.Typer()

    @extra.command("hello")
    def hello(who: str = typer.Argument(..., metavar="WHO"),
              loud: bool = typer.Option(False, "--loud", help="Shout.")) -> None:
        """Say hello.

        Example: ringray hello world --loud
        """

    @extra.command("bye")
    def bye() -> None:
        """Say bye."""

    reference = cli_reference(extra)
    assert "## `ringray hello WHO [OPTIONS]`\n\nSay hello.\n\nExample: `ringray hello world " \
           "--loud`" in reference
    assert "| `--loud` | Shout. |" in reference


def test_write_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--write`` fills each page's block and keeps the prose around it; ``--check`` names
    each stale page, and a page without its markers."""
    pages = {}
    for marker, relative in PAGES.items():
        pages[marker] = tmp_path / relative
        pages[marker].parent.mkdir(parents=True, exist_ok=True)
        pages[marker].write_text(f"# x\n\nbefore\n\n<!-- BEGIN {marker} -->\nold\n"
                                 f"<!-- END {marker} -->\n\nafter\n")
    root = ["--root", str(tmp_path)]
    assert main(["--check", *root]) == 1
    err = capsys.readouterr().err
    assert f"{PAGES[JOB_SPEC_MARKER]}: {JOB_SPEC_MARKER} is stale" in err
    assert f"{PAGES[CLI_MARKER]}: {CLI_MARKER} is stale" in err
    assert main(["--write", *root]) == 0
    for marker, generate in [(JOB_SPEC_MARKER, job_spec_reference),
                             (CLI_MARKER, cli_reference)]:
        text = pages[marker].read_text()
        assert text.startswith("# x\n\nbefore\n\n") and text.endswith("\n\nafter\n")
        assert read_block(text, marker) == generate()
    assert main(["--check", *root]) == 0

    pages[CLI_MARKER].write_text("# CLI reference, markers lost\n")
    assert main(["--check", *root]) == 1
    assert f"no <!-- BEGIN {CLI_MARKER} -->" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no <!-- BEGIN nope -->"):
        replace_block("text", "nope", "")
