"""The ``convert`` suite: the converter CLIs (``mcore-rl-hf2mcore``, ``mcore-rl-mcore2hf``) on a generated
multi-GB sharded checkpoint: a Qwen3-MoE-shaped model with random fp32 weights (hidden 1024, 64 experts of FFN
512; layers as many as the size asks), in 1 GB safetensors shards.

Each conversion is the user's command in its own process, with the source's pages dropped from the page cache
first (so it reads from the disk where the kernel honours that). GB/s counts the source's bytes and the whole
command (the interpreter's start included); peak RSS and peak anonymous RSS (without the mapped file pages; both
sampled every 50 ms) are set against the largest tensor file plus the interpreter's own baseline (the CLI's
imports, measured by a process that only imports them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from benchmarks.report import Report, pyplot, table

SHARD = 1 << 30
SHAPE = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
             num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=2048, vocab_size=32000,
             max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip


def qwen3_moe_tensors(config) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a released Qwen3-MoE checkpoint (one tensor per expert projection)."""
    h, f, hd = config.hidden_size, config.moe_intermediate_size, config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (config.num_attention_heads * hd, h),
            f"{p}.self_attn.k_proj.weight": (config.num_key_value_heads * hd, h),
            f"{p}.self_attn.v_proj.weight": (config.num_key_value_heads * hd, h),
            f"{p}.self_attn.o_proj.weight": (h, config.num_attention_heads * hd),
            f"{p}.self_attn.q_norm.weight": (hd,),
            f"{p}.self_attn.k_norm.weight": (hd,),
            f"{p}.mlp.gate.weight": (config.num_experts, h),
        }
        for e in range(config.num_experts):
            shapes |= {f"{p}.mlp.experts.{e}.{n}_proj.weight": (f, h) for n in ("gate", "up")}
            shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (h, f)
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (config.vocab_size, h)}


def generate(out: Path, gigabytes: float) -> Path:
    """A random Qwen3-MoE checkpoint of about ``gigabytes`` (fp32), written shard by shard (never whole in memory)."""
    import transformers
    from safetensors.torch import save_file

    from tests.tiny import save_char_tokenizer

    per_layer = 4 * (SHAPE["num_experts"] * 3 * SHAPE["hidden_size"] * SHAPE["moe_intermediate_size"])
    layers = max(1, round(gigabytes * 1e9 / per_layer))
    config = transformers.Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=layers, **SHAPE)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_char_tokenizer(out)
    generator = torch.Generator().manual_seed(0)
    index, current, size, total = {}, {}, 0, 0
    shapes = qwen3_moe_tensors(config)
    for n, (name, shape) in enumerate(shapes.items()):
        current[name] = torch.randn(shape, generator=generator) * 0.02
        size += current[name].numel() * 4
        if size >= SHARD or n == len(shapes) - 1:
            file = f"shard-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(current, out / file)
            index |= dict.fromkeys(current, file)
            total += size
            current, size = {}, 0
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index})
    )
    return out


def drop_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _run(argv: list[str]) -> tuple[float, int, int]:
    """(seconds, peak RSS, peak anonymous RSS) of a command: RSS also counts the file pages a process maps
    (safetensors reads through mmap); anonymous RSS (RSS less file-backed pages) is the memory it holds itself."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    peak, anonymous, watched = 0, 0, psutil.Process(process.pid)

    def sample():
        nonlocal peak, anonymous
        while process.poll() is None:
            try:
                info = watched.memory_info()
            except psutil.NoSuchProcess:
                break
            peak, anonymous = max(peak, info.rss), max(anonymous, info.rss - info.shared)
            time.sleep(0.05)

    thread = threading.Thread(target=sample)
    thread.start()
    if process.wait() != 0:
        raise RuntimeError(f"{argv} failed with status {process.returncode}")
    seconds = time.perf_counter() - start
    thread.join()
    return seconds, peak, anonymous


def _bytes(directory: Path, suffix: str) -> tuple[int, int]:
    sizes = [p.stat().st_size for p in directory.rglob(f"*{suffix}")]
    return sum(sizes), max(sizes)


def suite(out: Path, hardware, report: Report, gigabytes: float) -> None:
    work = out / "convert"
    shutil.rmtree(work, ignore_errors=True)
    hf = generate(work / "hf", gigabytes)
    bin_dir = Path(sys.executable).parent
    baseline = _run([sys.executable, "-c", "import mcore_rl.convert, converters.convert, megatron.core, transformers"])
    disk = min(hardware.disk_read_gbps, hardware.disk_write_gbps)
    rows, timings = [], {}
    for name, argv, source, suffix in (
        ("hf2mcore", [bin_dir / "mcore-rl-hf2mcore", hf, work / "mcore", "--quiet"], hf, ".safetensors"),
        (
            "mcore2hf",
            [bin_dir / "mcore-rl-mcore2hf", work / "mcore", work / "hf_back", "--quiet", "--hf-config", hf],
            work / "mcore",
            ".distcp",
        ),  # fmt: skip
    ):
        drop_cache(source)
        total, largest = _bytes(source, suffix)
        seconds, peak, anonymous = _run([str(a) for a in argv])
        gbps = total / seconds / 1e9
        timings[name] = gbps
        rows.append([name, total / 1e9, seconds, gbps, f"{100 * gbps / disk:.0f}%", peak / 1e9, anonymous / 1e9,
                     largest / 1e9, f"{(peak - baseline[1]) / largest:.2f}",
                     f"{(anonymous - baseline[2]) / largest:.2f}"])  # fmt: skip
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(list(timings), list(timings.values()), label="conversion")
    ax.axhline(disk, color="gray", linestyle="--", label="disk (slower of read/write)")
    ax.set_ylabel("GB/s")
    ax.legend()
    report.add(
        "convert: hf2mcore and mcore2hf",
        f"A random Qwen3-MoE-shaped checkpoint of {_bytes(hf, '.safetensors')[0] / 1e9:.2f} GB (fp32, 1 GB shards); "
        f"disk {hardware.disk_read_gbps:.2f} GB/s read, {hardware.disk_write_gbps:.2f} GB/s write; the CLI's "
        f"imports alone take {baseline[1] / 1e9:.2f} GB of RSS ({baseline[2] / 1e9:.2f} GB anonymous). Target: >= 50% of the disk's bandwidth, and peak RSS "
        "minus that baseline <= 2x the largest tensor file.",
        table(
            [
                "conversion",
                "source GB",
                "seconds",
                "GB/s",
                "of disk",
                "peak RSS GB",
                "peak anonymous GB",
                "largest file GB",
                "(RSS - baseline) / largest file",
                "(anonymous - baseline) / largest file",
            ],
            rows,
        ),  # fmt: skip
        report.figure(fig, "convert_gbps", "conversion GB/s"),
    )
    shutil.rmtree(work, ignore_errors=True)
