"""The ``ringray`` lm_eval model's options: what ``--model_args`` may say, checked once.

    options = HarnessOptions.from_model_args({"pretrained": "ckpt/", "cp": 2,
                                              "rope.scaling": "yarn", "rope.factor": 4})

Names follow the job file where it has the setting (section prefixes dropped where they are
unambiguous): ``cp``, ``layout`` and ``attention_backend`` are ``parallel.*``'s,
``precision`` is ``train.precision``, and ``rope.<field>`` is ``model.rope.<field>``, dot
included, with the same fields and meanings (:class:`~ringray.model.RopeOptions`). The
checkpoint is ``pretrained``, lm_eval's name for it rather than the job file's
``model.from_pretrained``: lm_eval hands ``--model_args`` to tasks as metadata, and tasks that
build their data with the model's tokenizer (RULER) look for it under ``pretrained``.
``max_length``, ``add_bos_token``, ``prefix_token_id``, ``batch_size`` and ``device`` mean
what they mean for lm_eval's ``hf`` model. ``kv_cache`` (default true) decodes
``generate_until`` requests from a KV cache kept over the ring; ``kv_cache=false`` re-runs
the whole prefix for every new token (the simple reference).

Pure data: no lm_eval, no transformers, so every rank of a ring can parse the same options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ringray.attention.backends import BACKENDS
from ringray.attention.layouts import BUILTIN_LAYOUTS, DOCUMENT_LAYOUTS
from ringray.model import RopeOptions

LAYOUTS = ("auto", *BUILTIN_LAYOUTS, *DOCUMENT_LAYOUTS)
"""``parallel.layout``'s values."""

PRECISIONS = ("auto", "fp32", "bf16")
"""``train.precision``'s values."""

_ROPE_PREFIX = "rope."
_ROPE_INTS = ("original_max_position_embeddings",)

IGNORED_ARGS = ("trust_remote_code", "max_batch_size")
"""Arguments lm_eval may add that mean nothing here: no remote code is ever run (the
checkpoint and its tokenizer are read from a local directory), and the batch size is never
searched for."""


def _flag(name: str, value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{name}: {value!r} is not true or false")


def _int(name: str, value: object, *, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {value!r} is not a whole number") from None
    if isinstance(value, float) and value != number:
        raise ValueError(f"{name}: {value!r} is not a whole number")
    if number < minimum:
        raise ValueError(f"{name}: {number} must be >= {minimum}")
    return number


def _rope_options(values: Mapping[str, object]) -> RopeOptions:
    known = {f.name for f in fields(RopeOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"rope.{unknown[0]}: not a RoPE option; valid: "
                         f"{', '.join('rope.' + name for name in sorted(known))}")
    parsed: dict[str, Any] = {}
    for name, value in values.items():
        if name == "scaling":
            parsed[name] = str(value)
        elif name in _ROPE_INTS:
            parsed[name] = _int(f"rope.{name}", value, minimum=1)
        else:
            try:
                parsed[name] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"rope.{name}: {value!r} is not a number") from None
    return RopeOptions(**parsed)


@dataclass(frozen=True, kw_only=True)
class HarnessOptions:
    """What the ``ringray`` lm_eval model was asked for (see the module docstring)."""

    pretrained: str
    """A Hugging Face checkpoint directory (config.json, *.safetensors, the tokenizer's
    files), read locally: nothing is downloaded."""
    cp: int = 1
    """Ranks in the ring (parallel.cp): 1 runs in this process; more needs a process group of
    exactly that many ranks (``python -m ringray.harness --cp N -- ...`` starts one). The
    lm_eval model's default is the process group's size (1 without one)."""
    layout: str = "auto"
    """How each sequence is split over the ring (parallel.layout). auto, balanced and whole
    run zigzag, as the job's passkey evaluation does (a request is one document, so there is
    nothing to balance)."""
    attention_backend: str = "auto"
    """Local attention kernel (parallel.attention_backend)."""
    precision: str = "auto"
    """auto: bf16 autocast on CUDA, fp32 on CPU; fp32; bf16 (train.precision)."""
    rope: RopeOptions = field(default_factory=RopeOptions)
    """RoPE overrides (model.rope), e.g. ``rope.scaling=yarn,rope.factor=4``."""
    tokenizer: str | None = None
    """Tokenizer directory, if not the checkpoint's."""
    max_length: int | None = None
    """Longest input in tokens (default: as lm_eval's hf model, the checkpoint's
    max_position_embeddings). Longer inputs are cut from the left, as hf cuts them; set it
    to the extended length after a RoPE extension."""
    add_bos_token: bool | None = None
    """Passed to the tokenizer, as hf does (None: the tokenizer's own default)."""
    prefix_token_id: int | None = None
    """The token an empty context and rolling windows start from (default: BOS, else EOS)."""
    batch_size: int = 1
    """Requests per forward pass. lm_eval passes its own ``--batch_size`` (so it cannot also
    be in ``--model_args``); 'auto' means 1 here."""
    kv_cache: bool = True
    """generate_until decodes from a KV cache: the prompt runs over the ring once, each rank
    keeps its share of every layer's K/V, and each new token runs alone
    (:mod:`ringray.harness.kv_cache`). False: every new token re-runs the whole prefix over
    the ring (the simple reference; the same texts, far slower on long contexts)."""
    device: str | None = None
    """cpu, or cuda[:N]: each rank's own GPU in a ring of several (rank modulo the GPUs
    visible), the CPU where CUDA is not available (as hf falls back). Default: cuda."""

    def __post_init__(self) -> None:
        if not self.pretrained:
            raise ValueError("pretrained: required (a local Hugging Face checkpoint directory)")
        if self.cp < 1:
            raise ValueError(f"cp: {self.cp} must be >= 1")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        backends = ("auto", *BACKENDS)
        if self.attention_backend not in backends:
            raise ValueError(f"attention_backend: {self.attention_backend!r} is not one of "
                             f"{', '.join(backends)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: {self.precision!r} is not one of "
                             f"{', '.join(PRECISIONS)}")

    @property
    def layout_kind(self) -> str:
        """The layout a request runs: ``layout`` with auto, balanced and whole as zigzag."""
        return "zigzag" if self.layout in ("auto", *DOCUMENT_LAYOUTS) else self.layout

    @classmethod
    def from_model_args(cls, args: Mapping[str, object]) -> HarnessOptions:
        """Options from lm_eval's parsed ``--model_args`` (plus the batch_size, device and
        max_batch_size it adds); ``ValueError`` in one line naming an unknown or bad one."""
        args = {k: v for k, v in args.items() if k not in IGNORED_ARGS}
        rope = {k[len(_ROPE_PREFIX):]: v for k, v in args.items() if k.startswith(_ROPE_PREFIX)}
        plain = {k: v for k, v in args.items() if not k.startswith(_ROPE_PREFIX)}
        names = [f.name for f in fields(cls) if f.name != "rope"]
        unknown = sorted(set(plain) - set(names))
        if unknown:
            raise ValueError(f"{unknown[0]}: not an argument of the ringray model; valid: "
                             f"{', '.join(names)}, rope.<field>")
        if "pretrained" not in plain:
            raise ValueError("pretrained: required (a local Hugging Face checkpoint directory)")
        parsed: dict[str, Any] = {"rope": _rope_options(rope)}
        for name, value in plain.items():
            if value is None:
                continue
            if name == "cp":
                parsed[name] = _int(name, value, minimum=1)
            elif name == "max_length":
                parsed[name] = _int(name, value, minimum=2)
            elif name == "prefix_token_id":
                parsed[name] = _int(name, value, minimum=0)
            elif name == "batch_size":
                text = str(value)
                parsed[name] = 1 if text.startswith("auto") else _int(name, value, minimum=1)
            elif name in ("add_bos_token", "kv_cache"):
                parsed[name] = _flag(name, value)
            else:
                parsed[name] = str(value)
        return cls(**parsed)
