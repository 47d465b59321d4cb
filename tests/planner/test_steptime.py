"""The step-time model against what it models: model FLOPs equal 2 x the active parameters of transformers' own
model per token (plus attention and head), each parallel dimension's exchange appears exactly when it is used and
scales with its group, decoding is bound by memory at small batches, and every dry run prints its prediction."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from mcore_rl.config.schema import load_run_config
from mcore_rl.planner.params import Architecture, stage_params
from mcore_rl.planner.steptime import (
    DEVICES,
    DeviceSpec,
    Lengths,
    forward_exchanges,
    forward_flops,
    prefill_positions,
    step_time,
)
from models.registry import get_bridge
from parallel.device import CPU_BLOCK_SIZE

REPO = Path(__file__).resolve().parents[2]
PUBLIC = REPO / "models" / "configs"
LENGTHS = Lengths(prompt=256, response=1024, longest=2048)


def _active_hf_params(model_dir: Path) -> float:
    """Parameters a token goes through in transformers' model (meta): all but the embedding and the head, routed
    experts weighted by top-k / experts."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None)
    active = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or "lm_head" in name or ".mtp" in name or "layers.61." in name:
            continue  # DeepSeek-V3's layer 61 is its MTP layer
        routed = ".experts." in name and "shared" not in name
        active += p.numel() * (config.num_experts_per_tok / experts if routed else 1)
    return active


@pytest.mark.parametrize("model", ["qwen3_8b", "qwen3_30b_a3b", "deepseek_v3"])
def test_model_flops_are_twice_the_active_parameters_of_transformers_model(model):
    a = Architecture.from_bridge(get_bridge(str(PUBLIC / model)))
    hf = _active_hf_params(PUBLIC / model)
    # the router's weights count whole (each token scores every expert), as in transformers' model
    assert forward_flops(a, tokens=1, context=0, head_tokens=0) == pytest.approx(2 * hf, rel=1e-6)
    head = forward_flops(a, 1, 0, 1) - forward_flops(a, 1, 0, 0)
    assert head == 2 * a.vocab * a.hidden
    # attention: QK^T and the weighted sum, per head and attended position
    qk, v = (a.qk_dim + a.rope_dim, a.v_dim) if a.mla else (a.head_dim, a.head_dim)
    assert forward_flops(a, 1, 100, 0) - forward_flops(a, 1, 0, 0) == 2 * a.layers * a.heads * (qk + v) * 100


@pytest.fixture(autouse=True)
def _model(monkeypatch):
    monkeypatch.setenv("MCORE_RL_MODEL", str(PUBLIC / "qwen3_30b_a3b"))


def _config(layout: dict, **runtime):
    overrides = [f"models.policy_trainer.parallel.{k}={v}" for k, v in layout.items()]
    overrides += [f"runtime_args.{k}={v}" for k, v in runtime.items()]
    return load_run_config(REPO / "scripts/configs/qwen3_30b_a3b_gspo.yaml", overrides)


def test_each_parallel_exchange_appears_where_its_dimension_is_used():
    device = DEVICES["h100"]
    base = step_time(_config(dict(tp=1, ep=1, sequence_parallel="false")), device, LENGTHS).detail
    assert base["tp"] == base["ep"] == base["cp"] == base["pp"] == base["bubble"] == 0 and base["dp"] > 0
    tp = step_time(_config(dict(tp=2, ep=1)), device, LENGTHS).detail
    assert tp["tp"] > 0 and tp["ep"] == 0 and tp["compute"] == pytest.approx(base["compute"])
    ep = step_time(_config(dict(tp=1, ep=8, sequence_parallel="false")), device, LENGTHS).detail
    assert ep["ep"] > 0 and ep["tp"] == 0 and ep["dp"] < base["dp"]  # experts no longer replicated over DP
    pp = step_time(_config(dict(tp=1, ep=1, pp=2, sequence_parallel="false")), device, LENGTHS).detail
    assert pp["bubble"] > 0 and pp["pp"] > 0
    # the same layout over twice the devices (two nodes): the gradients' exchange leaves NVLink for the network
    wide = step_time(_config(dict(tp=1, ep=1, sequence_parallel="false"), num_devices=32), device, LENGTHS).detail
    assert wide["dp"] > base["dp"] and wide["compute"] == pytest.approx(base["compute"] / 2)


def test_scoring_exchanges_what_one_forward_of_its_rows_does_and_training_that_per_pass():
    """The old log-probs' call pays its layout's TP and EP exchanges for the rows it scores, once (a forward);
    training pays them for each pass but one (forward, recomputation, and the backward's once more)."""
    device = DEVICES["h100"]
    config = _config(dict(tp=2, ep=8))  # full recomputation: four passes
    a = Architecture.from_bridge(get_bridge(config.models.policy_trainer.load))
    rt = config.runtime_args
    positions = rt.sample_per_episode * (LENGTHS.prompt + LENGTHS.response)  # no shared prompts
    once = forward_exchanges(a, config.models.policy_trainer.parallel, device, positions, rt.trainer_devices)
    assert once["tp"] > 0 and once["ep"] > 0 and once["cp"] == once["pp"] == 0
    t = step_time(config, device, LENGTHS, a)
    assert (t.detail["tp"], t.detail["ep"]) == pytest.approx((3 * once["tp"], 3 * once["ep"]))
    plain = step_time(_config(dict(tp=1, ep=1, sequence_parallel="false")), device, LENGTHS, a)
    old_rows = 1 - rt.train_global_batch_size / rt.sample_per_episode
    exchanged = t.phases["old_logprobs"] - plain.phases["old_logprobs"]  # the same compute on the same devices
    assert exchanged == pytest.approx(old_rows * (once["tp"] + once["ep"]))


def test_a_cpu_node_s_data_parallel_buckets_go_through_shared_memory():
    """On the CPU the buckets' reduce-scatter and all-gather run through shared memory (parallel.shm: each byte
    copied into a window and out of it, at the memcpy rate), the other exchanges over gloo; GPUs' buckets take the
    link."""
    config = _config(dict(tp=2, ep=1))
    gloo, memcpy = 1e9, 8e9
    cpu = DeviceSpec.cpu(1e12, memcpy, gloo, cores=16)
    detail = step_time(config, cpu, LENGTHS).detail
    slow = step_time(config, dataclasses.replace(cpu, bucket_bw=gloo), LENGTHS).detail
    assert detail["dp"] == pytest.approx(slow["dp"] * gloo / (memcpy / 2)) and detail["tp"] == slow["tp"] > 0
    h100 = DEVICES["h100"]
    linked = step_time(config, dataclasses.replace(h100, bucket_bw=h100.link_bw), LENGTHS).detail
    assert step_time(config, h100, LENGTHS).detail["dp"] == linked["dp"] > 0


def test_an_optimizer_step_s_fixed_cost_is_per_parameter_tensor_of_the_busiest_stage():
    """Qwen3-30B-A3B: 48 MoE layers of 9 tensors and 2 per local expert, the embedding, the final norm and the LM
    head; expert parallelism divides the experts' tensors, pipeline parallelism the layers."""
    device = dataclasses.replace(DEVICES["h100"], tensor_update_latency=0.001)
    config = _config(dict(tp=1, ep=1, sequence_parallel="false"))
    steps = config.runtime_args.sample_per_episode // config.runtime_args.train_global_batch_size
    a = Architecture.from_bridge(get_bridge(config.models.policy_trainer.load))
    assert (a.layers, a.experts, a.qk_norm, a.tied) == (48, 128, True, False)
    per_layer = 1 + 1 + 2 + 1 + 1 + 1  # norm, QKV, query and key norms, output; norm and router
    for layout, tensors in (
        (dict(tp=1, ep=1), 48 * (per_layer + 2 * 128) + 3),
        (dict(tp=1, ep=8), 48 * (per_layer + 2 * 16) + 3),
        (dict(tp=1, ep=8, pp=2), 24 * (per_layer + 2 * 16) + 2),  # the last stage: its norm and head
    ):
        detail = step_time(_config(dict(layout, sequence_parallel="false")), device, LENGTHS).detail
        assert detail["latency"] == pytest.approx(steps * tensors * 0.001), layout


def test_adam_s_traffic_is_per_shard_and_the_gradient_buffer_s_zeroing_per_replica():
    """Each optimizer step Adam reads and writes its data-parallel shard of the fp32 state (28 bytes a parameter
    when the parameters are fp32, 36 with a bf16 model's weights to refresh), and every rank zeroes its whole fp32
    gradient buffer: twice the devices halve the first, not the second. A CPU's memory traffic is twice its memcpy
    rate (a copy reads and writes each byte)."""
    memcpy = 5e9
    cpu = DeviceSpec.cpu(1e12, memcpy, 1e9, cores=16)
    assert cpu.memory_bw == 2 * memcpy
    layout = dict(tp=1, ep=1, sequence_parallel="false")
    config, wider = _config(layout), _config(layout, num_devices=32)
    steps = config.runtime_args.sample_per_episode // config.runtime_args.train_global_batch_size
    arch = Architecture.from_bridge(get_bridge(config.models.policy_trainer.load))
    params = max(stage_params(arch, config.models.policy_trainer.parallel))[0]  # ep 1: experts shard over DP too
    for device, adam in ((cpu, 28), (DEVICES["h100"], 36)):
        narrow = step_time(config, device, LENGTHS).detail["optimizer"]
        wide = step_time(wider, device, LENGTHS).detail["optimizer"]
        assert narrow - wide == pytest.approx(steps * adam * params / 32 / device.memory_bw)  # 16 -> 32 shards
        assert wide == pytest.approx(steps * (adam * params / 32 + 4 * params) / device.memory_bw)


def test_decoding_a_few_samples_is_bound_by_memory_and_many_by_compute():
    config = _config(dict(tp=2, ep=8), sample_per_episode=16, train_global_batch_size=16)
    h100 = DEVICES["h100"]
    faster_memory = dataclasses.replace(h100, memory_bw=2 * h100.memory_bw)
    faster_math = dataclasses.replace(h100, flops=2 * h100.flops)
    few = [step_time(config, d, LENGTHS).phases["rollout"] for d in (h100, faster_memory, faster_math)]
    assert few[1] < 0.6 * few[0] and few[2] > 0.9 * few[0]


def test_a_group_s_samples_prefill_only_their_prompt_s_last_partial_kv_block():
    """As measured on the CPU engine (SmolLM2, 4 prompts of 45 tokens x 4 samples): 720 positions prefilled in
    blocks of 128 tokens (none whole, nothing shared), 336 in blocks of 32."""
    assert prefill_positions(prompts=4, samples=16, prompt=45, block=128) == 720
    assert prefill_positions(prompts=4, samples=16, prompt=45, block=32) == 4 * 45 + 12 * 13 == 336
    assert prefill_positions(prompts=4, samples=64, prompt=256, block=16) == 4 * 256  # whole blocks: once a prompt
    assert DeviceSpec.cpu(1e12, 1e10, 1e9, 2).kv_block == CPU_BLOCK_SIZE and DEVICES["h100"].kv_block == 16


def test_a_dry_run_prints_and_writes_the_step_time(tmp_path):
    from mcore_rl.planner.dry_run import dry_run

    out = tmp_path / "plan.json"
    config = _config(dict(tp=2, ep=8))
    assert dry_run(config, 80, out, DEVICES["h200"], (128, 512, 1024)) == 0
    report = json.loads(out.read_text())["step_time"]
    assert report["device"] == "H200 SXM" and report["lengths"] == dict(prompt=128, response=512, longest=1024)
    assert all(report["phases"][p] > 0 for p in ("rollout", "old_logprobs", "train", "sync", "offload"))


def test_an_unknown_device_is_refused_by_name(capsys):
    from mcore_rl.planner.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([str(REPO / "scripts/configs/qwen3_30b_a3b_gspo.yaml"), "--device", "a100"])
    assert exit_.value.code == 2 and "--device a100: expected one of b200, h100, h200" in capsys.readouterr().err
