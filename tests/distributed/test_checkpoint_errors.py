"""A checkpoint that does not match the model fails with the tensor names, on every rank, before any training."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from converters.hf_io import HFCheckpoint
from tests.distributed import cases


def _corrupt(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((Path(src) / "config.json").read_text())
    source = HFCheckpoint(src)  # sharded: the corrupted copy is written as one file
    tensors = {name: source.get(name) for name in source.names()}
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
            r"missing tensor\(s\) \['model.layers.1.self_attn.k_proj.weight'\]",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(7, 64)}),
            r"shape mismatch: .*'model.layers.0.mlp.up_proj.weight': \(7, 64\)",
        ),
        (
            lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(1)}),
            r"unexpected tensor\(s\) .*model.layers.9.extra.weight",
        ),
    ],
)
def test_bad_checkpoint_names_the_tensor(ranks, tiny_models, tmp_path, edit, match):
    bad = _corrupt(tiny_models["Qwen2ForCausalLM"], tmp_path / "bad", edit)
    with pytest.raises(RuntimeError, match=match):
        ranks.run(cases.roundtrip, hf_dir=str(bad), layout=dict(tp=2), bucket_bytes=1 << 20)
