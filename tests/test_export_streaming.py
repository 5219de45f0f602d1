"""``ringray export`` holds one safetensors shard at a time, not the model (issue 25: every
phase of a large job counts, the export included).

A 143 MB float32 model is checkpointed by :class:`CheckpointStore` in one fresh process and
exported by :func:`export_hf` in another, with 8 MB shards. The export's peak resident memory
(``VmHWM``) above what the process held once torch, ringray and what building a model imports
were loaded must stay under half the model: a reader that materialised the model first would
need all of it (and its serialised bytes besides). The files must also be the model: every
tensor equal, read back by transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringray.model.safetensors_io import write_safetensors

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, re, sys
from dataclasses import replace
sys.path.insert(0, {root!r})
import torch
from tests.train_cases import tiny_options
from ringray.model import Transformer
from ringray.train import CheckpointStore
from ringray.train.export import export_hf

def rss(field):
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1))

options = tiny_options({run!r})
options = replace(options, model=replace(options.model, dim=512, n_layers=8, n_heads=8,
                                         n_kv_heads=8, ffn_hidden=1536, vocab_size=8192))
if sys.argv[1] == "save":
    torch.manual_seed(0)
    model = Transformer(options.model)
    CheckpointStore(options.checkpoint_location).save(1, {{"model": model.state_dict()}}, keep=1)
    torch.save({{n: p.detach() for n, p in model.named_parameters()}}, {weights!r})
    print(json.dumps({{"bytes": sum(p.numel() * 4 for p in model.parameters())}}))
else:
    with torch.device("meta"):  # what building any model imports (Triton: ~100 MB)
        Transformer(options.model)
    base = rss("VmRSS")
    export_hf(options, {out!r}, max_shard_bytes=8 * 10**6)
    print(json.dumps({{"base_kib": base, "hwm_kib": rss("VmHWM")}}))
"""


def _child(tmp_path: Path, mode: str) -> dict:
    script = _CHILD.format(root=str(ROOT), run=str(tmp_path / "run"),
                           weights=str(tmp_path / "weights.pt"), out=str(tmp_path / "hf"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_export_holds_one_shard_not_the_model(tmp_path: Path) -> None:
    model_bytes = _child(tmp_path, "save")["bytes"]
    assert model_bytes > 120 * 10**6  # the model the bound below is measured against
    measured = _child(tmp_path, "export")
    grew = (measured["hwm_kib"] - measured["base_kib"]) * 1024
    assert grew < model_bytes / 2, (grew, model_bytes)

    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 10
    tensors_in = {f: sum(v == f for v in index["weight_map"].values()) for f in files}
    for f in files:  # at most 8 MB (+ the header), unless one tensor is larger by itself
        assert (out / f).stat().st_size <= 8 * 10**6 + 10**5 or tensors_in[f] == 1, f
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf = dict(loaded.named_parameters())
    want = torch.load(tmp_path / "weights.pt")
    assert torch.equal(hf["model.embed_tokens.weight"], want["tok_embeddings.weight"])
    assert torch.equal(hf["model.norm.weight"], want["norm.weight"])
    assert torch.equal(hf["model.layers.7.mlp.down_proj.weight"],
                       want["layers.7.feed_forward.w2.weight"])
    assert sum(t.numel() for t in hf.values()) * 4 == model_bytes


def test_exported_files_have_the_permissions_of_any_new_file(tmp_path: Path) -> None:
    """safetensors' save_file makes its file 0600, so an inference service running as
    another user could not read an export whose other files are 0644 (issue 40): every
    file written has the mode a new file gets here (0644 under the usual umask)."""
    reference = tmp_path / "any-new-file"
    reference.write_text("")
    want = reference.stat().st_mode & 0o777
    tensors = {f"w{i}": torch.full((64, 64), float(i)) for i in range(3)}
    for max_shard_bytes in (10**9, 64 * 64 * 4):  # one file, then a shard per tensor
        out = tmp_path / f"out-{max_shard_bytes}"
        names = write_safetensors(tensors, str(out), max_shard_bytes=max_shard_bytes)
        assert {name: (out / name).stat().st_mode & 0o777 for name in names} == \
            dict.fromkeys(names, want)


def test_a_stream_that_fails_under_a_read_is_an_os_error(tmp_path: Path, monkeypatch) -> None:
    """A ValueError a library raises while reading a stream ("I/O operation on closed file")
    said nothing about the file: it is an OSError naming the file (retried by the service),
    not a ValueError (taken as bad input, never retried; issue 40)."""
    import io

    import fsspec

    from ringray.model.safetensors_io import SafetensorsCheckpoint

    root = f"memory://{tmp_path.name}"  # a remote store: read by byte ranges
    write_safetensors({"w": torch.ones(4, 4)}, root, max_shard_bytes=10**9)
    checkpoint = SafetensorsCheckpoint(root)
    memory = fsspec.implementations.memory.MemoryFileSystem
    real_open = memory.open

    def closed_under_the_read(self, path, mode="rb", **kwargs):
        if "r" not in mode:
            return real_open(self, path, mode, **kwargs)
        stream = io.BytesIO(b"bytes")  # a stream its library closed before the read
        stream.close()
        return stream

    monkeypatch.setattr(memory, "open", closed_under_the_read)
    with pytest.raises(OSError, match=r"model\.safetensors: reading bytes \d+-\d+ failed: "
                                      r"ValueError: I/O operation on closed file") as info:
        checkpoint.read("w")
    assert not isinstance(info.value, ValueError)
