"""HF safetensors shards written from a stream (a checkpoint's HF model, runtime_args.save_hf): HF's layout and
names, an index when there are several, every tensor read back exactly by HF's reader."""

import json

import torch

from converters.hf_io import INDEX_FILE, SINGLE_FILE, HFCheckpoint, StreamedShards


def _write(directory, tensors: dict, max_bytes: int) -> list[str]:
    writer = StreamedShards(directory, max_bytes)
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    return sorted(p.name for p in directory.iterdir())


def test_streamed_tensors_form_hf_shards_that_read_back_exactly(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.w": torch.randn(16, 8, generator=generator) for i in range(5)}  # 512 B each
    tensors["lm_head.weight"] = torch.randn(4, 8, dtype=torch.float64, generator=generator).to(torch.bfloat16)
    (tmp_path / "many").mkdir()
    files = _write(tmp_path / "many", tensors, max_bytes=1200)  # two float tensors per file
    assert files == [*(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)), INDEX_FILE]
    index = json.loads((tmp_path / "many" / INDEX_FILE).read_text())
    assert index["weight_map"]["model.layers.4.w"] == "model-00003-of-00003.safetensors"
    assert index["metadata"]["total_size"] == 5 * 512 + 64
    (tmp_path / "one").mkdir()
    assert _write(tmp_path / "one", tensors, max_bytes=10**6) == [SINGLE_FILE]
    for directory in ("many", "one"):
        read = HFCheckpoint(tmp_path / directory)
        assert read.names() == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(read.get(name), tensor) and read.get(name).dtype == tensor.dtype, (directory, name)
