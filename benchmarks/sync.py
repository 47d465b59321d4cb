"""Weight-sync benchmark: Megatron (one trainer rank) -> rollout engine (Ray actor), in memory.

For each model it times several syncs (the first one allocates the transfer buffers), reports GB/s of HF tensor
bytes delivered into the engine, and sets that against this machine's memcpy bandwidth (a sync has to copy every
byte at least once: into the shared bucket; the engine's loader copies it again into its own layout).

    python benchmarks/bench_weight_sync.py                      # SmolLM2-135M and a synthetic 0.5B Llama
    python benchmarks/bench_weight_sync.py --models smollm2 --syncs 5 --bucket-mb 256

Writes ``benchmarks/reports/weight_sync_<hardware>_<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mcore_rl.sync import SyncConfig, WeightSync  # noqa: E402 - after the repository is on the path

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


def memcpy_gbps(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Best-of-``repeats`` bandwidth of one tensor copy (bytes copied / s), the yardstick for the sync."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _transport_rank(rank: int, port: int, total: int, bucket: int, results) -> None:
    """One side of a two-process transfer of ``total`` bytes in ``bucket``-sized pieces, by shm and by gloo."""
    import torch.distributed as dist

    from mcore_rl.rollout.transport import BucketSender, open_bucket

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    data = torch.ones(bucket // 4)
    cpu = torch.device("cpu")
    sender = BucketSender(cpu, bucket) if rank == 0 else None
    timings = {}
    for method in ("shm", "gloo"):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(total // bucket):
            if method == "gloo":
                (dist.send if rank == 0 else dist.recv)(data, 1 - rank)
                continue
            box = [sender.pack([("x", data)]) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)  # the handle: a few hundred bytes
            if rank == 1:
                _, views = open_bucket(box[0], cpu)
                data.copy_(views[0][1])  # what the engine's loader does: copy into its own memory
            dist.barrier()  # the sender may reuse the buffer
        timings[method] = time.perf_counter() - start
    if sender is not None:
        sender.close()
    if rank == 1:
        results.put({m: total / t / 1e9 for m, t in timings.items()})
    dist.destroy_process_group()


def transport_gbps(total: int, bucket: int) -> dict[str, float]:
    """GB/s of moving buckets between two processes: shared memory (pack + map + copy out) vs gloo send/recv."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_transport_rank, args=(r, port, total, bucket, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = results.get(timeout=600)
    for p in procs:
        p.join()
    return out


def model_dir(name: str, scratch: Path) -> Path:
    if name == "smollm2":
        from converters.gguf2hf import default_model_dir

        return default_model_dir()
    import transformers

    out = scratch / "synthetic-llama"
    config = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **SYNTHETIC)
    transformers.LlamaForCausalLM(config).float().save_pretrained(out)
    return out


def bench_model(name: str, hf_dir: Path, syncs: int, bucket_bytes: int) -> list:
    from converters.stream import load_hf
    from mcore_rl.rollout.engine import RolloutConfig
    from mcore_rl.rollout.remote import launch_engine, stop_engine
    from mcore_rl.training import MegatronModel
    from models.registry import get_bridge
    from parallel.config import ParallelConfig
    from parallel.groups import init_parallel

    parallel = ParallelConfig()
    groups = init_parallel(parallel)
    bridge = get_bridge(hf_dir)
    chunks = bridge.build_model(bridge.transformer_config(parallel))
    load_hf(chunks, bridge, hf_dir, groups)
    model = MegatronModel(chunks, groups)
    engine = launch_engine(hf_dir, RolloutConfig(load_tokenizer=False, max_model_len=256, cpu_kv_cache_bytes=64 << 20))
    sync = WeightSync(
        chunks,
        bridge,
        groups,
        engine,
        model,
        SyncConfig(bucket_bytes=bucket_bytes),
        torch.float32,
    )
    try:
        return [sync.sync() for _ in range(syncs)]
    finally:
        sync.close()
        stop_engine(engine)


def report(rows: list[tuple[str, list]], memcpy: float, transport: dict[str, float], args, started: str) -> str:
    lines = [
        f"# Weight sync, {platform.node()} ({os.cpu_count()} CPUs), {started}",
        "",
        f"Command: `python benchmarks/bench_weight_sync.py {' '.join(sys.argv[1:])}`  ",
        f"torch {torch.__version__}; trainer: 1 rank (TP=PP=1), fp32; engine: vLLM in a Ray actor, TP=1, fp32; "
        f"bucket {args.bucket_mb} MiB; memcpy bandwidth (one tensor copy, best of 5): **{memcpy:.2f} GB/s**.",
        "",
        "| model | sync | seconds | waiting on engine (s) | MB | buckets | GB/s | % of memcpy | probe max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, reports in rows:
        for r in reports:
            lines.append(
                f"| {name} | {'first' if r.index == 0 else r.index} | {r.seconds:.3f} | {r.engine_wait_seconds:.3f} | "
                f"{r.bytes / 1e6:.0f} | "
                f"{r.buckets} | {r.gb_per_s:.2f} | {100 * r.gb_per_s / memcpy:.0f}% | {r.probe_max_abs_diff:.2g} |"
            )
    lines += ["", "| model | first / later syncs (time) |", "|---|---|"]
    for name, reports in rows:
        later = sum(r.seconds for r in reports[1:]) / max(1, len(reports) - 1)
        lines.append(f"| {name} | {reports[0].seconds / later:.2f}x |")
    lines += [
        "",
        f"Transport alone, trainer process -> engine process, {TRANSPORT_BYTES >> 20} MiB in "
        f"{args.bucket_mb} MiB buckets, one bucket in flight (what the CPU choice of shared memory rests on):",
        "",
        "| transport | GB/s | % of memcpy |",
        "|---|---|---|",
    ]
    for method, label in (("shm", "shared memory: pack, map, copy out"), ("gloo", "gloo send/recv")):
        lines.append(f"| {label} | {transport[method]:.2f} | {100 * transport[method] / memcpy:.0f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,synthetic", help="comma-separated: smollm2, synthetic")
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument("--bucket-mb", type=int, default=SyncConfig.bucket_bytes >> 20)
    parser.add_argument("--out", type=Path, default=None, help="report path (default: benchmarks/reports/...)")
    args = parser.parse_args()
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from mcore_rl.rollout.remote import NAMESPACE

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            rows.append((name, bench_model(name, model_dir(name, Path(scratch)), args.syncs, args.bucket_mb << 20)))
    ray.shutdown()
    memcpy = memcpy_gbps()
    transport = transport_gbps(TRANSPORT_BYTES, args.bucket_mb << 20)
    text = report(rows, memcpy, transport, args, started)
    hardware = "cuda" if torch.cuda.is_available() else f"cpu{os.cpu_count()}"
    out = args.out or REPO / "benchmarks" / "reports" / f"weight_sync_{hardware}_{started[:10]}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"report written to {out}")


if __name__ == "__main__":
    main()
