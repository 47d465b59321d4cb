"""The ``sync`` suite: Megatron (one trainer rank) -> rollout engine (Ray actor), in memory.

For each model it times several syncs (the first one allocates the transfer buffers), reports GB/s of HF tensor
bytes delivered into the engine, and sets that against the measured memcpy bandwidth: a sync copies every byte
at least once, into the shared bucket, and the engine's loader copies it again into its own layout. The trainer
side (export + pack, overlapped with the engine through two buffers) is the time not spent waiting on the
engine. Models: SmolLM2-135M, a synthetic 0.5B Llama (random weights) and the tiny DeepSeek-V3 that the rl suite's
MoE runs train (MLA, routed and shared experts, 12 MB: its syncs are the fixed costs of its many small tensors, and
of the engine's expert repacking, more than bytes).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import single_process_world
from benchmarks.hardware import transport_gbps
from benchmarks.report import Report, pyplot, table
from mcore_rl.trainer.sync import ColocatedRoute, SyncConfig, WeightSync

# A Llama-architecture model ~4x SmolLM2 (about 0.5B parameters, 2 GB in fp32), random weights.
SYNTHETIC = dict(
    hidden_size=1536,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=4096,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


TRANSPORT_BYTES = 2 << 30


def model_dir(name: str, scratch: Path) -> Path:
    if name == "smollm2":
        from converters.gguf2hf import default_model_dir

        return default_model_dir()
    if name == "tiny_moe":
        from tests.tiny import make_tiny

        return make_tiny("DeepseekV3ForCausalLM", scratch / "tiny-deepseek-v3")
    import transformers

    from tests.tiny import save_char_tokenizer

    out = scratch / "synthetic-llama"
    config = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **SYNTHETIC)
    transformers.LlamaForCausalLM(config).float().save_pretrained(out)
    save_char_tokenizer(out)  # the engine stops at its EOS (a model directory holds a tokenizer)
    return out


def trainer_side_alone(chunks, bridge, groups, bucket_bytes: int, repeats: int) -> list[float]:
    """Seconds of the trainer's part of a sync with no engine: export, then pack into two alternating buckets, as
    the colocated route does. In a sync on 2 cores the engine's loads compete with it for the cores."""
    from converters.stream import export_hf
    from mcore_rl.rollout.transport import BucketSender
    from mcore_rl.trainer.sync import send_buckets

    senders = [BucketSender(torch.device("cpu"), bucket_bytes) for _ in range(2)]
    try:
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            for i, bucket in enumerate(
                send_buckets(export_hf(chunks, bridge, groups, bucket_bytes, stack_experts=False), bucket_bytes)
            ):
                senders[i % 2].pack(bucket)
            seconds.append(time.perf_counter() - start)
        return seconds
    finally:
        for sender in senders:
            sender.close()


def bench_model(name: str, hf_dir: Path, syncs: int, bucket_bytes: int) -> tuple[list, list[float]]:
    """The reports of ``syncs`` syncs into an engine, and the trainer side's seconds alone as many times."""
    from converters.stream import load_hf
    from mcore_rl.rollout.engine import RolloutConfig
    from mcore_rl.rollout.remote import launch_engine, stop_engine
    from mcore_rl.trainer.training import MegatronModel
    from models.bridge import INIT_SKIPPED
    from models.registry import get_bridge
    from parallel.config import ParallelConfig
    from parallel.groups import init_parallel

    parallel = ParallelConfig()
    groups = init_parallel(parallel)
    bridge = get_bridge(hf_dir)
    chunks = bridge.build_model(bridge.transformer_config(parallel, **INIT_SKIPPED))  # loaded next
    load_hf(chunks, bridge, hf_dir, groups)
    model = MegatronModel(chunks, groups)
    alone = trainer_side_alone(chunks, bridge, groups, bucket_bytes, syncs)
    # the probe's 32 tokens fit (the tiny DeepSeek-V3 allows 128)
    engine = launch_engine(hf_dir, RolloutConfig(max_model_len=128, cpu_kv_cache_bytes=64 << 20))
    route = ColocatedRoute(engine, next(chunks[0].parameters()).device, bucket_bytes)
    sync = WeightSync(chunks, bridge, groups, route, model, SyncConfig(bucket_bytes=bucket_bytes), torch.float32)
    try:
        return [sync.sync() for _ in range(syncs)], alone
    finally:
        sync.close()
        stop_engine(engine)


def suite(out: Path, hardware, report: Report, syncs: int = 4, bucket_mb: int = SyncConfig.bucket_bytes >> 20) -> None:
    single_process_world()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from compat.ray import start_local_cluster
    from mcore_rl.rollout.remote import NAMESPACE

    start_local_cluster(num_cpus=2, log_to_driver=False, namespace=NAMESPACE)
    runs = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for name in ("smollm2", "synthetic", "tiny_moe"):
                runs.append((name, bench_model(name, model_dir(name, Path(scratch)), syncs, bucket_mb << 20)))
    finally:
        ray.shutdown()
    memcpy = hardware.memcpy_gbps
    transport = transport_gbps(TRANSPORT_BYTES, bucket_mb << 20)
    rows, summary, alone_rows = [], [], []
    for name, (reports, alone) in runs:
        best = reports[0].bytes / min(alone) / 1e9
        alone_rows.append([name, ", ".join(f"{s:.3f}" for s in alone), best, f"{100 * best / memcpy:.0f}%"])
        for r in reports:
            trainer = r.bytes / max(r.seconds - r.engine_wait_seconds, 1e-9) / 1e9
            rows.append([name, "first" if r.index == 0 else r.index, r.seconds, r.engine_wait_seconds,
                         r.probe_seconds, r.bytes / 1e6, r.buckets, r.gb_per_s, f"{100 * r.gb_per_s / memcpy:.0f}%",
                         f"{100 * trainer / memcpy:.0f}%", f"{r.probe_max_abs_diff:.2g}"])  # fmt: skip
        later = sum(r.seconds for r in reports[1:]) / max(1, len(reports) - 1)
        summary.append([name, f"{reports[0].seconds / later:.2f}x"])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    for name, (reports, _) in runs:
        ax.plot([r.index for r in reports], [r.gb_per_s for r in reports], marker="o", label=name)
    ax.axhline(memcpy, color="gray", linestyle="--", label="memcpy")
    ax.set_xlabel("sync")
    ax.set_ylabel("GB/s into the engine")
    ax.legend()
    report.add(
        "sync: trainer -> rollout engine",
        f"Trainer: 1 rank (TP=PP=1); engine: vLLM in a Ray actor, TP=1; bucket {bucket_mb} MiB; "
        f"memcpy {memcpy:.2f} GB/s. Seconds: the transfer (export, pack, the engine's loads); the trainer's "
        "forward of the probe batch before it apart. Trainer side = bytes / (seconds - waiting on the engine).",
        table(
            [
                "model",
                "sync",
                "seconds",
                "waiting on engine s",
                "probe forward s",
                "MB",
                "buckets",
                "GB/s",
                "of memcpy",
                "trainer side of memcpy",
                "probe max abs diff",
            ],
            rows,
        ),  # fmt: skip
        table(["model", "first / later syncs (time)"], summary),
        "The trainer side alone (export and pack into two alternating buckets, no engine competing for the cores), "
        "once per sync above, before the engine starts:",
        table(["model", "seconds", "best GB/s", "of memcpy"], alone_rows),
        table(
            ["transport (one bucket in flight)", "GB/s", "of memcpy"],
            [
                ["shared memory: pack, map, copy out", transport["shm"], f"{100 * transport['shm'] / memcpy:.0f}%"],
                ["gloo send/recv", transport["gloo"], f"{100 * transport['gloo'] / memcpy:.0f}%"],
            ],
        ),  # fmt: skip
        report.figure(fig, "sync_gbps", "GB/s per sync"),
    )
