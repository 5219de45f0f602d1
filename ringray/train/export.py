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

import torch

from ringray.data import ByteTokenizer
from ringray.model import Transformer, read_model_config, save_hf_checkpoint
from ringray.model.hf import DEFAULT_MAX_SHARD_BYTES
from ringray.train.checkpoint import CheckpointError, CheckpointRef, CheckpointStore
from ringray.train.options import TrainOptions


def choose_checkpoint(store: CheckpointStore, step: int | None) -> CheckpointRef:
    """The newest committed checkpoint of the newest lineage, or its one at ``step``.

    Raises:
        CheckpointError: there is none, or none at ``step`` (naming the steps there are).
    """
    lineage = store.newest_lineage()
    refs = store.of_lineage(lineage) if lineage else []
    if not refs:
        raise CheckpointError(f"{store.location}: no committed checkpoint to export")
    if step is None:
        return refs[0]
    for ref in refs:
        if ref.step == step:
            return ref
    steps = sorted(r.step for r in refs)
    raise CheckpointError(f"--step: {step} is not a committed checkpoint of the run at "
                          f"{store.location}; its steps: {steps}")


@torch.no_grad()
def export_hf(options: TrainOptions, out_dir: str, *, step: int | None = None,
              dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> CheckpointRef:
    """Write the run's checkpoint (newest, or at ``step``) as an HF checkpoint in
    ``out_dir``, reading and writing one safetensors shard of at most ``max_shard_bytes`` at
    a time; returns the checkpoint exported. ``dtype`` casts the weights (default: as
    trained, float32)."""
    store = CheckpointStore(options.checkpoint_location)
    ref = choose_checkpoint(store, step)
    store.verify(ref)
    with torch.device("meta"):
        model = Transformer(options.model)
    shapes = dict(model.named_parameters())

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        part = {name: torch.empty_like(shapes[name], device="cpu") for name in names}
        store.load(ref, {"model": part})  # DCP reads these tensors' bytes only
        return part

    positions = options.train.seq_len
    if options.pretrained is not None:
        source_positions = read_model_config_positions(options.pretrained)
        positions = max(positions, source_positions or 0)
    overrides = {"max_position_embeddings": positions}
    if options.pretrained is None:  # a preset: its tokenizer is the byte one
        tokenizer = ByteTokenizer()
        overrides.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                         pad_token_id=tokenizer.pad_id)
    save_hf_checkpoint(shapes, model.config, out_dir, source=options.pretrained, dtype=dtype,
                       max_shard_bytes=max_shard_bytes, config_overrides=overrides, load=load)
    if options.pretrained is None:
        ByteTokenizer().save_hf(out_dir)
    return ref


def read_model_config_positions(path: str) -> int | None:
    """The ``max_position_embeddings`` of the checkpoint at ``path`` (None if absent)."""
    from ringray.model.safetensors_io import join, read_json

    read_model_config(path)  # the checkpoint is one ringray reads (raises otherwise)
    value = read_json(join(path, "config.json")).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None
