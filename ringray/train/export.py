"""A ringray checkpoint as a Hugging Face checkpoint directory (``ringray export``).

    ref = export_hf(options, "out/", step=None)      # the run's newest committed checkpoint
    transformers.AutoModelForCausalLM.from_pretrained("out/")

The weights are read from the DCP checkpoint in this one process, whatever the degrees that
wrote it (replicated, or sharded by FSDP: DCP reshards on load), one safetensors shard at a
time (``max_shard_bytes``, 5 GB by default as in transformers): the process holds one shard,
not the model, so a 70B checkpoint (280 GB of float32) exports on an ordinary host. They are
written as :func:`ringray.model.save_pretrained` writes a model: config.json, safetensors,
and, for a model that started from a pretrained checkpoint, that checkpoint's tokenizer and
the config keys ringray does not model; for a preset, the byte tokenizer as a
``tokenizer.json`` that encodes to the same ids (so ``model.from_pretrained`` can continue
from the export). ``max_position_embeddings`` is set to the length the run trained at (or
the source's, if longer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringray.data import ByteTokenizer
from ringray.model import Transformer, read_model_config, save_hf_checkpoint
from ringray.model.hf import DEFAULT_MAX_SHARD_BYTES
from ringray.train.checkpoint import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointRef,
    CheckpointStore,
)
from ringray.train.checkpoint_runs import check_model_config
from ringray.train.options import TrainOptions


def choose_checkpoint(store: CheckpointStore, step: int | None, *,
                      refused: Callable[[CheckpointCorrupt], None] | None = None
                      ) -> CheckpointRef:
    """The newest committed checkpoint of the newest lineage, or its one at ``step``.

    A damaged checkpoint (its marker there but unreadable) is never passed over in silence:
    asked for by ``step``, it is refused with its reason; newer than the one chosen, it is
    told to ``refused`` (as a resume logs the checkpoints it refuses).

    Raises:
        CheckpointError: there is none, or none at ``step`` (naming the steps there are).
        CheckpointCorrupt: the checkpoint at ``step`` is damaged (naming why).
    """
    lineage = store.newest_lineage()
    refs = store.of_lineage(lineage) if lineage else []
    damaged = store.damaged()
    if step is not None:
        for ref in refs:
            if ref.step == step:
                return ref
        for ref in damaged:
            if ref.step == step:
                store.marker(ref)  # raises CheckpointCorrupt with the reason
    if not refs:
        reasons = "; ".join(_damage(store, ref) for ref in damaged)
        raise CheckpointError(f"{store.location}: no committed checkpoint to export"
                              + (f" ({reasons})" if reasons else ""))
    if step is not None:
        steps = sorted(r.step for r in refs)
        raise CheckpointError(f"--step: {step} is not a committed checkpoint of the run at "
                              f"{store.location}; its steps: {steps}")
    for ref in damaged:
        if ref.step >= refs[0].step and refused is not None:
            try:
                store.marker(ref)
            except CheckpointCorrupt as exc:
                refused(exc)
    return refs[0]


def _damage(store: CheckpointStore, ref: CheckpointRef) -> str:
    """Why a damaged checkpoint is refused (its marker's error, one line)."""
    try:
        store.marker(ref)
    except CheckpointCorrupt as exc:
        return str(exc)
    return f"checkpoint {ref.location}: readable now"


@torch.no_grad()
def export_hf(options: TrainOptions, out_dir: str, *, step: int | None = None,
              dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              refused: Callable[[CheckpointCorrupt], None] | None = None) -> CheckpointRef:
    """Write the run's checkpoint (newest, or at ``step``) as an HF checkpoint in
    ``out_dir``, reading and writing one safetensors shard of at most ``max_shard_bytes`` at
    a time; returns the checkpoint exported. ``dtype`` casts the weights (default: as
    trained, float32). ``refused`` hears of each damaged checkpoint newer than the one
    exported (:func:`choose_checkpoint`).

    Raises:
        CheckpointError: no such checkpoint, or one trained with another model than the run's
            job file describes (the marker's config is compared before any tensor is read).
        CheckpointCorrupt: the checkpoint's files or marker are damaged.
    """
    store = CheckpointStore(options.checkpoint_location)
    ref = choose_checkpoint(store, step, refused=refused)
    check_model_config(store, ref, options.model.to_dict(),
                       remedy="the run directory's job.yaml does not describe it: export the "
                              "run that wrote it, or restore the model's settings there")
    store.verify(ref)
    with torch.device("meta"):
        model = Transformer(options.model)
    shapes = dict(model.named_parameters())

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        part = {name: torch.empty_like(shapes[name], device="cpu") for name in names}
        store.load(ref, {"model": part})  # DCP reads these tensors' bytes only
        return part

    overrides = {"max_position_embeddings": exported_positions(options)}
    if options.pretrained is None:  # a preset: its tokenizer is the byte one
        tokenizer = ByteTokenizer()
        overrides.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                         pad_token_id=tokenizer.pad_id)
    save_hf_checkpoint(shapes, model.config, out_dir, source=options.pretrained, dtype=dtype,
                       max_shard_bytes=max_shard_bytes, config_overrides=overrides, load=load)
    if options.pretrained is None:
        ByteTokenizer().save_hf(out_dir)
    return ref


def exported_positions(options: TrainOptions) -> int:
    """The ``max_position_embeddings`` an export of the run declares: ``train.seq_len``, or
    the pretrained checkpoint's when larger."""
    positions = options.train.seq_len
    if options.pretrained is not None:
        positions = max(positions, read_model_config_positions(options.pretrained) or 0)
    return positions


def read_model_config_positions(path: str) -> int | None:
    """The ``max_position_embeddings`` of the checkpoint at ``path`` (None if absent)."""
    from ringray.model.safetensors_io import join, read_json

    read_model_config(path)  # the checkpoint is one ringray reads (raises otherwise)
    value = read_json(join(path, "config.json")).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None
