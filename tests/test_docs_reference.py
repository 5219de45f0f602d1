"""The README's job file and CLI references are exactly what the code generates (regenerate
with ``python -m ringray.cli.reference --write README.md``), and the generators cover
every field and every command."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from ringray.cli import app
from ringray.cli.reference import CLI_MARKER, cli_reference, main
from ringray.spec import JobSpec
from ringray.spec.reference import (
    JOB_SPEC_MARKER,
    job_spec_reference,
    read_block,
    replace_block,
)

README = Path(__file__).resolve().parents[1] / "README.md"
REGENERATE = "python -m ringray.cli.reference --write README.md"


@pytest.mark.parametrize(("marker", "generate"), [(JOB_SPEC_MARKER, job_spec_reference),
                                                  (CLI_MARKER, cli_reference)])
def test_readme_block_is_generated(marker: str, generate) -> None:
    block = read_block(README.read_text(), marker)
    assert block is not None, f"README.md has no {marker} markers"
    assert block == generate(), f"README.md's {marker} is stale: run {REGENERATE}"


def test_readme_sections_are_in_order() -> None:
    """The job file reference, then the CLI reference, right before the repository layout."""
    text = README.read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    i = headings.index("## Job file reference")
    assert headings[i:i + 3] == ["## Job file reference", "## CLI reference",
                                 "## Layout of the repository"]


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
        assert f"#### `ringray {name}" in reference, name
        for sub in getattr(command, "commands", {}):
            assert f"#### `ringray {name} {sub} " in reference or \
                f"#### `ringray {name} {sub}`" in reference, f"{name} {sub}"
    assert "#### `ringray train SPEC [OPTIONS]`" in reference
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
    assert "#### `ringray hello WHO [OPTIONS]`\n\nSay hello.\n\nExample: `ringray hello world " \
           "--loud`" in reference
    assert "| `--loud` | Shout. |" in reference


def test_write_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--write`` fills the blocks and keeps the rest; ``--check`` says when one is stale."""
    readme = tmp_path / "README.md"
    body = (f"# x\n\nbefore\n\n<!-- BEGIN {JOB_SPEC_MARKER} -->\nold\n<!-- END "
            f"{JOB_SPEC_MARKER} -->\n\n<!-- BEGIN {CLI_MARKER} -->\n<!-- END {CLI_MARKER} -->"
            f"\n\nafter\n")
    readme.write_text(body)
    assert main(["--check", str(readme)]) == 1
    assert "stale: job-spec-reference, cli-reference" in capsys.readouterr().err
    assert main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert read_block(text, JOB_SPEC_MARKER) == job_spec_reference()
    assert main(["--check", str(readme)]) == 0
    with pytest.raises(ValueError, match="no <!-- BEGIN nope -->"):
        replace_block(text, "nope", "")
