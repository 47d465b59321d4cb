"""Seconds per phase of an episode, from the model's shapes, the run config and a device's numbers: the planner's
step-time model, printed beside the memory plan in every dry run.

Every phase is its compute (model FLOPs at the device's matmul rate times the fraction the run's kernels reach:
one for forward and backward, one for forward-only passes), or its memory traffic where that is larger (decoding
reads every weight and the KV cache for each token), plus its communication, counted as not overlapped (mcore-rl's
Megatron layouts keep the overlap options off), plus a fixed cost per unit of work that does not scale with its size
(a scoring call, a layer's share of an optimizer step, a decoding step, a weight sync: the calls, launches and
Python around the kernels, which decide the phases of small models):

* rollout: prefill of each prompt's whole KV blocks once (prefix caching shares them among the prompt's samples)
  and of its last, partial block per sample, then decoding the responses in waves of what the KV cache holds, over
  the engines;
* scoring (reference, old log-probs): one forward over the positions the trainer computes (a prompt once per group
  where samples share it) with its layout's exchanges; train: forward and backward (plus a forward where layers
  are recomputed) with the pipeline's bubble, the tensor-, sequence-, context- and expert-parallel exchanges of
  every layer, and the data-parallel gradient reduce-scatter and parameter all-gather of the distributed optimizer,
  then Adam and the gradient buffer's zeroing;
* sync: the trainer scores the probe batch, its ranks gather the weights and the engines load them (colocated:
  device copies; else a broadcast over the network), then the engines score the probe; offload: the trainer's
  state out to the host and back, where colocated roles take turns on GPUs.

A device is its datasheet (:data:`DEVICES`: dense bf16 FLOP/s, HBM, NVLink and per-GPU network bandwidth) or, for
the CPU, what the benchmark suite measures (``python -m benchmarks``; :meth:`DeviceSpec.cpu`); ``efficiency`` is
the fraction of the matmul rate whole layers reach, measured for mcore-rl's trainer (its sources are named). The
CPU's efficiencies and fixed costs are fitted by the rl suite to two of its runs and checked on the others
(``benchmarks/rl.py``); on GPUs the fixed costs are not measured yet (vLLM cannot travel to a lent GPU) and count 0.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mcore_rl.planner.memory import Workload, engine_memory
from mcore_rl.planner.params import Architecture, layer_params, optimizer_shards, stage_params, stage_tensors
from mcore_rl.trainer.sync import engine_probe_rows
from parallel.config import ParallelConfig
from parallel.device import CPU_BLOCK_SIZE


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    flops: float  # dense matmul FLOP/s in the training dtype (bf16 on GPUs; fp32 on the CPU)
    memory_bw: float  # device memory traffic, bytes read and written per second (a copy of n bytes moves 2n)
    link_bw: float  # bytes/s from one device to a peer of its node, one way (NVLink; CPU: shared memory)
    network_bw: float  # bytes/s per device to other nodes (InfiniBand)
    host_bw: float  # device <-> host bytes/s (offload)
    per_node: int  # devices per node
    memory_bytes: int  # per device (the engines' KV cache is what their share leaves)
    efficiency: float  # fraction of ``flops`` whole transformer layers reach in mcore-rl (forward and backward)
    forward_efficiency: float  # the same for forward-only passes (scoring, prefill, the sync's probe)
    memory_efficiency: float  # fraction of ``memory_bw`` decoding reaches
    param_bytes: int  # bytes per parameter in training and in the engines (bf16: 2; the CPU build: fp32)
    source: str
    # Fixed seconds beyond the work each unit does (calls, launches, Python): a scoring call over the trainer's
    # ranks, each parameter tensor (of the busiest pipeline stage's devices) in an optimizer step (beyond its
    # compute, Adam's traffic and the gradients' exchange: the gradient hooks, the optimizer, the clipping and the
    # buffers walk every parameter tensor; an MoE layer has two per local expert, a dense layer a handful), an
    # engine's decoding step (scheduling, inputs, sampling), a weight sync (the engines' update calls, their wake-up).
    call_latency: float = 0.0
    tensor_update_latency: float = 0.0
    step_latency: float = 0.0
    sync_latency: float = 0.0
    copy_efficiency: float = 1.0  # fraction of ``memory_bw`` the sync's copies (pack, the engines' loads) reach
    # bytes/s of the data-parallel gradient and parameter buckets between devices of a node (0: ``link_bw``; the
    # CPU: through shared memory, :mod:`parallel.shm`, at half its memcpy rate)
    bucket_bw: float = 0.0
    kv_block: int = 16  # tokens of the engines' KV-cache blocks (vLLM's on GPUs; the CPU engine's CPU_BLOCK_SIZE)

    @classmethod
    def cpu(cls, matmul_flops: float, memcpy_bw: float, link_bw: float, cores: int, **fitted: float) -> DeviceSpec:
        """This machine as the suite measures it: one node whose logical devices share the cores and exchange over
        gloo (``link_bw``), their data-parallel buckets through shared memory (each byte a ring would send copied
        into a window and out of it, at ``memcpy_bw``: bytes copied per second, twice that in memory traffic);
        ``fitted``: the efficiencies and fixed costs the rl suite fits (default: none, every efficiency 1)."""
        measured = cls("cpu", matmul_flops, 2 * memcpy_bw, link_bw, link_bw, memcpy_bw, cores, 0, 1.0, 1.0, 1.0, 4,
                       "measured by python -m benchmarks", bucket_bw=memcpy_bw / 2, kv_block=CPU_BLOCK_SIZE)  # fmt: skip
        return dataclasses.replace(measured, **fitted)


# Datasheets (dense bf16 without sparsity; NVLink: half the bidirectional figure; one 400 Gb/s NIC per GPU on the
# reference nodes; PCIe Gen5 x16). ``efficiency``: 0.255, mcore-rl's measured model FLOP/s of a 4-layer
# Qwen3-30B-A3B step on an H200 over its datasheet peak (benchmarks/reports/2026-11-26_gpu_h200); the same kernels
# on an H100 and a B200 are assumed to reach the same fraction, and forward-only passes too (on the CPU they reach
# more; the GPU self-check's mfu step measures them, ``forward_mfu``, from its next run on). ``memory_efficiency``:
# 0.7 of HBM for decoding.
DEVICES = {
    "h100": DeviceSpec("H100 SXM", 989e12, 3.35e12, 450e9, 50e9, 55e9, 8, 80 << 30, 0.255, 0.255, 0.7, 2,
                       "NVIDIA H100 datasheet: 989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 900 GB/s"),
    "h200": DeviceSpec("H200 SXM", 989e12, 4.8e12, 450e9, 50e9, 55e9, 8, 141 << 30, 0.255, 0.255, 0.7, 2,
                       "NVIDIA H200 datasheet: 989 TFLOP/s bf16, 4.8 TB/s HBM3e, NVLink 900 GB/s"),
    "b200": DeviceSpec("B200", 2250e12, 8e12, 900e9, 50e9, 55e9, 8, 180 << 30, 0.255, 0.255, 0.7, 2,
                       "NVIDIA DGX B200 datasheet: 2.25 PFLOP/s bf16 per GPU, 8 TB/s HBM3e, NVLink 1.8 TB/s"),
}  # fmt: skip


@dataclass(frozen=True)
class Lengths:
    """Mean tokens of a prompt and of a response, and the longest response (a wave of decoding lasts until its
    longest sample ends; the rollout's ``max_new_tokens`` where the samples are unknown)."""

    prompt: float
    response: float
    longest: float


def forward_flops(a: Architecture, tokens: float, context: float, head_tokens: float) -> float:
    """FLOPs of one forward over ``tokens`` positions with ``context`` mean attended positions each, the LM head on
    ``head_tokens`` of them: 2 per multiply-add of the active weights (MoE: the top-k routed and the shared
    experts), the attention's scores and weighted sums, and a Gated DeltaNet layer's state update and read per
    position (two [key dim x value dim] products per value head; its chunked form's intra-chunk terms are left out)."""
    one = ParallelConfig()
    active = 0.0
    for i, moe in enumerate(a.moe_layers):
        params, experts = layer_params(a, moe, one, a.linear(i))
        active += params - experts + (a.topk * 3 * a.moe_ffn * a.hidden if moe else 0)
    qk = (a.qk_dim + a.rope_dim) if a.mla else a.head_dim
    v = a.v_dim if a.mla else a.head_dim
    linear = sum(a.linear_layers)
    attention = 2 * (a.layers - linear) * a.heads * (qk + v) * context
    recurrence = 4 * linear * a.linear_value_heads * a.linear_key_dim * a.linear_value_dim
    return tokens * (2 * active + attention + recurrence) + head_tokens * 2 * a.vocab * a.hidden


def _bandwidth(device: DeviceSpec, group_span: int, within: float = 0.0) -> float:
    """A group's collectives run over NVLink (or ``within``'s rate, where given) where the group's devices
    (``group_span`` consecutive ones) share a node, else over the network."""
    return (within or device.link_bw) if group_span <= device.per_node else device.network_bw


def _ring(size: int, nbytes: float, bw: float) -> float:
    """Seconds of a ring all-gather or reduce-scatter of ``nbytes`` (the whole tensor) over ``size`` devices."""
    return (size - 1) / size * nbytes / bw if size > 1 else 0.0


@dataclass(frozen=True)
class StepTime:
    """Seconds of each phase of one episode (0: the run has no such phase), and what the episode processes."""

    phases: dict[str, float]
    detail: dict[str, float]  # train's parts: compute, bubble, tp, cp, ep, pp, dp, optimizer, latency
    tokens: float  # prompt + response tokens of the episode's samples
    devices: int

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    @property
    def tokens_per_device_second(self) -> float:
        return self.tokens / self.seconds / self.devices


def step_time(config, device: DeviceSpec, lengths: Lengths, arch: Architecture | None = None) -> StepTime:
    """The phases of one on-policy (``sync`` mode) episode of ``config`` on ``device``s at ``lengths``."""
    from models.registry import get_bridge

    rt, m = config.runtime_args, config.models
    a = arch or Architecture.from_bridge(get_bridge(m.policy_trainer.load))
    trainer = m.policy_trainer
    n, samples = m.policy.num_inference_per_prompt, rt.sample_per_episode
    prompts, seq = samples / n, lengths.prompt + lengths.response
    shared = trainer.share_prompts
    # Positions the trainer computes: a prompt once per group where samples share it; the head only where a
    # response token is predicted there, else everywhere.
    positions = samples * lengths.response + prompts * lengths.prompt if shared else samples * seq
    head = samples * lengths.response if shared else positions
    forward = forward_flops(a, positions, seq / 2, head)
    phases = {"rollout": rollout_seconds(a, config, device, lengths)}

    def score(parallel: ParallelConfig, rows: float) -> float:
        exchanges = sum(forward_exchanges(a, parallel, device, positions * rows, rt.trainer_devices).values())
        return score_seconds(forward * rows, rt.trainer_devices, device) + exchanges

    phases["ref_logprobs"] = sum(
        score(getattr(m, role).parallel, 1.0) for role in ("ref_policy", "teacher") if m.uses(role)
    )
    old_rows = 1.0 if (trainer.reward_kl_coef or trainer.distill_coef) else 1 - rt.train_global_batch_size / samples
    phases["old_logprobs"] = score(trainer.parallel, old_rows)
    train, detail = train_seconds(a, config, device, forward, positions)
    phases["train"] = train
    phases["sync"] = sync_seconds(a, config, device)
    phases["offload"] = offload_seconds(a, config, device)
    return StepTime(phases, detail, samples * seq, rt.num_devices)


def score_seconds(forward: float, devices: int, device: DeviceSpec) -> float:
    """The compute of a call scoring ``forward`` FLOPs over the role's devices (its exchanges apart:
    :func:`forward_exchanges`)."""
    return forward / (devices * device.flops * device.forward_efficiency) + (device.call_latency if forward else 0.0)


def train_seconds(a: Architecture, config, device: DeviceSpec, forward: float, positions: float):
    """Forward and backward of every optimizer step, the pipeline's bubble, each parallel dimension's exchanges and
    Adam; and those parts."""
    rt, trainer = config.runtime_args, config.models.policy_trainer
    p, world = trainer.parallel, rt.trainer_devices
    work = Workload.from_config(config)
    passes = 3 + (1 if trainer.recompute == "full" else 0)  # backward = 2 forwards; recomputation one more
    # the busiest pipeline stage sets the pace (DeepSeek-V3's 61 layers do not split evenly)
    stage_layers = max(p.stage_layers(a.layers))
    compute = passes * forward / (world * device.flops * device.efficiency) * stage_layers * p.pp / a.layers
    bubble = compute * (p.pp - 1) / (work.micro_batches * p.vpp) if p.pp > 1 else 0.0
    act = device.param_bytes
    # activations are exchanged by the forward (and the recomputation) once each and by the backward once more
    # (passes - 1: the backward computes two forwards' worth); the stage boundaries, forward and backward
    exchanges = forward_exchanges(a, p, device, positions, world)
    tp, cp, ep = ((passes - 1) * exchanges[k] for k in ("tp", "cp", "ep"))
    pipeline = 2 * exchanges["pp"]
    # DP: the distributed optimizer reduce-scatters fp32 gradients and all-gathers the parameters, each step
    params, experts = max(stage_params(a, p), key=lambda s: s[0])
    steps = rt.sample_per_episode // rt.train_global_batch_size
    dense_dp, expert_dp = optimizer_shards(p, world)
    wide = _bandwidth(device, world, device.bucket_bw)
    grads = _ring(dense_dp, (params - experts) * (4 + act), wide) + _ring(expert_dp, experts * (4 + act), wide)
    data = steps * grads
    # Adam over this device's shard: fp32 weights, gradients and moments read, weights and moments written (28
    # bytes; below fp32 also the main weights' copy into the model's: 36), and the step's zeroing of the whole fp32
    # gradient buffer (4 bytes a parameter), in memory traffic
    adam = 28 if act == 4 else 36
    shard = (params - experts) / dense_dp + experts / expert_dp
    optimizer = steps * (adam * shard + 4 * params) / device.memory_bw
    latency = steps * max(stage_tensors(a, p)) * device.tensor_update_latency
    parts = dict(compute=compute, bubble=bubble, tp=tp, cp=cp, ep=ep, pp=pipeline, dp=data, optimizer=optimizer,
                 latency=latency)  # fmt: skip
    return sum(parts.values()), parts


def forward_exchanges(a: Architecture, p: ParallelConfig, device: DeviceSpec, positions: float, world: int) -> dict:
    """Seconds of one forward pass's exchanges over ``positions`` (all data-parallel ranks'), by parallel dimension:
    TP's two all-gather/reduce-scatter pairs (or all-reduces) per layer, CP's key/value ring per layer, EP's
    dispatch and combine per MoE layer, PP's activations across every stage boundary (the busiest stage's layers
    set the pace)."""
    stage_layers = max(p.stage_layers(a.layers))
    per_rank = positions / p.dp(world)  # positions one data-parallel rank (its TP x CP x PP devices) computes
    act = device.param_bytes
    tp = stage_layers * 2 * 2 * _ring(p.tp, per_rank / p.cp * a.hidden * act, _bandwidth(device, p.tp))
    kv = (2 * a.kv_lora if a.mla else 2 * a.kv_heads * a.head_dim) * act
    cp = stage_layers * (p.cp - 1) * per_rank / p.cp * kv / _bandwidth(device, p.tp * p.cp)
    moe_layers = sum(a.moe_layers) / a.layers * stage_layers
    routed = per_rank / (p.tp * p.cp) * a.topk * a.hidden * act  # sent by one device (all-to-all: (ep-1)/ep leave)
    ep = moe_layers * 2 * _ring(p.ep, routed, _bandwidth(device, p.ep * p.expert_tp))
    pipeline = per_rank / p.cp / p.tp * a.hidden * act / _bandwidth(device, p.tp * p.cp * p.pp) if p.pp > 1 else 0
    return dict(tp=tp, cp=cp, ep=ep, pp=pipeline)


def rollout_seconds(a: Architecture, config, device: DeviceSpec, lengths: Lengths) -> float:
    """Prefill (a prompt's whole KV blocks once, see :func:`prefill_positions`) and decoding over the engines, in
    waves of the sequences the KV cache holds."""
    rt, m = config.runtime_args, config.models
    rollout = m.policy.rollout
    tp = rollout.tensor_parallel_size
    engines = max(1, len(rt.devices("rollout")) // tp)
    samples = rt.sample_per_episode
    prompts = samples / m.policy.num_inference_per_prompt
    positions = prefill_positions(prompts, samples, lengths.prompt, device.kv_block)
    prefill = forward_flops(a, positions, lengths.prompt / 2, samples)
    prefill /= engines * tp * device.flops * device.forward_efficiency
    per_engine = samples / engines
    memory = engine_memory(a, rollout, device.memory_bytes)
    kv_bytes = memory.kv_bytes_per_token * device.param_bytes / 2  # one device's, counted in bf16 there
    kv_tokens = rollout.cpu_kv_cache_bytes / kv_bytes if not device.memory_bytes else max(memory.kv_tokens, 1)
    seq = lengths.prompt + lengths.response
    waves = math.ceil(per_engine / max(1.0, min(per_engine, kv_tokens / seq)))
    batch = per_engine / waves
    weights = a.engine_params() * device.param_bytes / tp
    if a.experts:  # the experts a decoding step's batch reaches
        touched = 1 - (1 - a.topk / a.experts) ** batch
        routed = 3 * a.moe_ffn * a.hidden * a.experts * sum(a.moe_layers) * device.param_bytes / tp
        weights -= routed * (1 - touched)
    one_token = forward_flops(a, batch, lengths.prompt + lengths.response / 2, batch)
    step = max(
        (weights + batch * (lengths.prompt + lengths.response / 2) * kv_bytes)
        / (device.memory_bw * device.memory_efficiency),
        one_token / (tp * device.flops * device.forward_efficiency),
    )
    return prefill + waves * lengths.longest * (step + device.step_latency)


def prefill_positions(prompts: float, samples: float, prompt: float, block: int) -> float:
    """Positions the engines prefill for ``samples`` of ``prompts`` prompts of ``prompt`` tokens: vLLM's prefix
    cache shares a prompt's whole KV blocks among its samples (prefilled in one step too), and each sample computes
    the prompt's last, partial block itself."""
    tail = prompt % block
    return prompts * (prompt - tail) + samples * tail


def sync_seconds(a: Architecture, config, device: DeviceSpec) -> float:
    """The weights into the engines: the trainer scores the probe batch (each data-parallel replica its share of
    the rows, at least as many as its pipeline schedule's micro-batches); colocated, its ranks gather each engine's
    share over their links and hand it over as a device copy the engine loads (two copies); on devices of their
    own, one broadcast over the network; then the engines score the probe, each its share of the rows."""
    rt, m = config.runtime_args, config.models
    nbytes = a.engine_params() * device.param_bytes
    p, tp = m.policy_trainer.parallel, m.policy.rollout.tensor_parallel_size
    gather = _ring(p.tp * p.pp * p.ep, nbytes, _bandwidth(device, p.tp * p.pp * p.ep))
    if rt.colocated:
        transfer = gather + 2 * 2 * nbytes / tp / (device.memory_bw * device.copy_efficiency)  # each reads, writes
    else:
        transfer = gather + nbytes / device.network_bw
    probe = 0.0
    if m.policy.sync.probe:
        rows, length = m.policy.sync.probe_sequences, m.policy.sync.probe_length
        flops = forward_flops(a, rows * length, length / 2, rows * length)
        share = max(math.ceil(rows / p.dp(rt.trainer_devices)), p.pp if p.vpp > 1 else 1) / rows
        trainer_probe = score_seconds(flops * share, p.tp * p.cp * p.pp, device)
        engines = max(1, len(rt.devices("rollout")) // tp)
        engine_share = len(engine_probe_rows(rows, engines, 0)) / rows
        probe = trainer_probe + flops * engine_share / (tp * device.flops * device.forward_efficiency)
    return transfer + probe + device.sync_latency


def offload_seconds(a: Architecture, config, device: DeviceSpec) -> float:
    """Colocated on GPUs with offload: the trainer's weights and optimizer state out to the host and back once an
    episode (CPU roles never move)."""
    rt, trainer = config.runtime_args, config.models.policy_trainer
    if not device.memory_bytes or not (rt.colocated and trainer.offload):
        return 0.0
    p = trainer.parallel
    params, experts = max(stage_params(a, p), key=lambda s: s[0])
    dense_dp, expert_dp = optimizer_shards(p, rt.trainer_devices)
    state = params * device.param_bytes + 12 * (params - experts) / dense_dp + 12 * experts / expert_dp
    return 2 * state / device.host_bw


def describe(t: StepTime, device: DeviceSpec) -> list[str]:
    """The dry run's lines: each phase's seconds, the episode's, and its tokens per device-second."""
    phases = ", ".join(f"{name} {s:.3g}" for name, s in t.phases.items() if s)
    train = ", ".join(f"{name} {s:.3g}" for name, s in t.detail.items() if s)
    return [
        f"step time on {device.name} ({device.source}; {device.efficiency:.3g} of peak in layers, "
        f"{device.forward_efficiency:.3g} forward-only):",
        f"  {t.seconds:.3g} s per episode: {phases}",
        f"  train: {train}",
        f"  {t.tokens_per_device_second:.4g} tokens per device-second ({t.tokens:.4g} tokens per episode)",
    ]
