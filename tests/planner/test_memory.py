"""The memory planner against what it models: parameter counts equal Megatron's built models, activation estimates
equal what autograd saves on tiny models of every family and layout (the local build, within 2%), KV cache sizes
are the known per-token numbers, and the phases and layout suggestions agree with them."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

from mcore_rl.config.schema import load_run_config
from mcore_rl.planner.activations import head_activation_bytes, layer_activation_bytes
from mcore_rl.planner.memory import (
    GiB,
    Workload,
    engine_memory,
    in_flight,
    plan_memory,
    remedies,
    suggest_layouts,
    trainer_memory,
)
from mcore_rl.planner.meta import hf_tensors
from mcore_rl.planner.params import (
    Architecture,
    lora_params,
    mtp_params,
    rank_layers,
    stage_params,
    stage_tensors,
    trained_router,
)
from mcore_rl.rollout.engine import RolloutConfig
from models.lora import LINEARS, MLA, LoRAConfig
from models.registry import get_bridge
from parallel.config import ParallelConfig
from tests.planner import activations
from tests.tiny import MOONLIGHT, make_tiny

REPO = Path(__file__).resolve().parents[2]
PUBLIC = REPO / "models" / "configs"
SP = dict(tp=2, sequence_parallel=True)


@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("Qwen3ForCausalLM", {}),
        ("Qwen3ForCausalLM", SP),
        ("Qwen3ForCausalLM", dict(cp=2)),
        ("Qwen3ForCausalLM", dict(cp=2, **SP)),
        ("LlamaForCausalLM", dict(tp=2)),  # TP without sequence parallelism: hidden-sized tensors are whole
        ("Qwen2ForCausalLM", {}),
        ("Qwen3MoeForCausalLM", dict(ep=2)),
        ("Qwen3MoeForCausalLM", dict(ep=2, etp=1, **SP)),
        ("DeepseekV3ForCausalLM", dict(ep=4)),
        ("DeepseekV3ForCausalLM", dict(ep=2, etp=1, **SP)),
    ],
)
def test_activation_estimate_matches_saved_tensors(ranks, tiny_models, arch, layout):
    lengths = [40, 25, 31, 33]  # a packed micro-batch of uneven sequences
    measured = ranks.run(activations.saved_bytes, hf_dir=tiny_models[arch], layout=layout, lengths=lengths)
    a, parallel = Architecture.from_bridge(get_bridge(tiny_models[arch])), ParallelConfig(**layout)
    tokens = measured[0]["tokens"]
    sequence = measured[0]["sequence"]
    for owner in [k for k in measured[0] if k.startswith("layer")] + ["head"]:
        # Routed experts take different token counts per rank; their mean is what balanced routing assumes.
        mean = sum(m[owner] for m in measured) / len(measured)
        if owner == "head":
            estimate = head_activation_bytes(a, parallel, tokens, "local", 4)
        else:
            moe = a.moe_layers[int(owner[5:])]
            estimate = layer_activation_bytes(a, moe, parallel, tokens, "local", 4, sequence)
        assert estimate == pytest.approx(mean, rel=0.02), owner


@pytest.fixture(scope="module")
def moonlight(tmp_path_factory):
    return str(make_tiny("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("moonlight"), **MOONLIGHT))


@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("LlamaForCausalLM", dict(pp=2, tp=2)),  # tied embeddings: the last stage holds a copy
        ("LlamaForCausalLM", dict(pp=2, vpp=2)),
        ("Qwen2ForCausalLM", dict(tp=2)),  # QKV bias
        ("Qwen3ForCausalLM", dict(pp=4)),
        ("Qwen3MoeForCausalLM", dict(ep=2, etp=2, **SP)),
        ("DeepseekV3ForCausalLM", dict(pp=2, ep=2, last_stage_layers=1)),  # the dense first layer on stage 0
        ("Glm4MoeForCausalLM", dict(pp=2, ep=2)),  # q/k/v biases, shared expert, the MTP layer on the last stage
        ("Qwen3NextForCausalLM", dict(ep=2, **SP)),  # Gated DeltaNet, gated queries, the shared expert's gate
        # sinks split by head, biases of the output projection, the router and every expert
        ("GptOssForCausalLM", dict(ep=2, etp=1, **SP)),
        ("moonlight", dict(tp=2, ep=2, etp=1, sequence_parallel=True)),  # MLA without a query projection rank
    ],
)
def test_stage_params_equal_megatron_models(ranks, tiny_models, moonlight, arch, layout):
    hf_dir = moonlight if arch == "moonlight" else tiny_models[arch]
    a, parallel = Architecture.from_bridge(get_bridge(hf_dir)), ParallelConfig(**layout)
    expected, tensors = stage_params(a, parallel), stage_tensors(a, parallel)
    for stage, params, experts, count in ranks.run(activations.params_per_rank, hf_dir=hf_dir, layout=layout):
        assert (params, experts, count) == (*expected[stage], tensors[stage])


@pytest.mark.parametrize(
    ("arch", "layout", "targets", "train_router"),
    [
        ("LlamaForCausalLM", dict(pp=2, tp=2), list(LINEARS), False),
        (
            "DeepseekV3ForCausalLM",
            dict(pp=2, ep=2, tp=2, etp=1, sequence_parallel=True, last_stage_layers=1),
            ["linear_proj", "linear_fc1", "experts.linear_fc1", "experts.linear_fc2", *MLA[1:]],
            True,
        ),
    ],
)
def test_lora_params_equal_the_adapters_megatron_models_hold(ranks, tiny_models, arch, layout, targets, train_router):
    """Dense layers and DeepSeek's MoE layers (MLA's projections, replicated and TP-split, the shared experts' MLP,
    the routed experts' linears: expert-parallel parameters, as the model's experts; the routers trained beside
    them, and their copies with the expert bias)."""
    a = Architecture.from_bridge(get_bridge(tiny_models[arch]))
    parallel, lora = ParallelConfig(**layout), LoRAConfig(rank=8, targets=targets, train_router=train_router)
    stages = rank_layers(parallel, a.layers)

    def per_stage(count) -> list[tuple[int, int]]:
        return [tuple(map(sum, zip(*(count(a.moe_layers[i]) for i in ls), strict=True))) for ls in stages]

    adapters = per_stage(lambda moe: lora_params(a, moe, parallel, lora))
    routers = per_stage(lambda moe: trained_router(a, moe, lora))
    results = ranks.run(
        activations.lora_params_per_rank, hf_dir=tiny_models[arch], layout=layout, targets=targets,
        train_router=train_router,
    )  # fmt: skip
    for stage, count, router in results:
        assert count == adapters[stage] and count[0] > 0, (stage, count, adapters)
        assert router == routers[stage], (stage, router, routers)
    assert any(router[0] for _, _, router in results) == train_router


@pytest.mark.parametrize(
    ("model", "billions"),
    [
        ("qwen3_8b", 8.19),
        ("qwen3_30b_a3b", 30.53),
        ("moonlight_16b_a3b", 15.96),
        ("qwen3_235b_a22b", 235.09),
        # the released "685B": 671.03 B and its multi-token-prediction layer's 13.46 B (an MoE layer and copies of
        # the embedding and the head), which the rollout engines leave out
        ("deepseek_v3", 684.49),
        ("gpt_oss_120b", 116.83),  # as its model card says
    ],
)
def test_checkpoint_parameter_counts_of_the_public_configs(model, billions):
    bridge = get_bridge(str(PUBLIC / model))
    a = Architecture.from_bridge(bridge)
    counted = a.hf_params()
    assert counted / 1e9 == pytest.approx(billions, abs=0.005)
    assert a.engine_params() / 1e9 == pytest.approx(671.03 if model == "deepseek_v3" else billions, abs=0.005)
    # an engine drafting with the MTP layer holds it too, its copies of the embedding and head the model's own
    drafting = 684.49 - 2 * 129280 * 7168 / 1e9 if model == "deepseek_v3" else billions
    assert a.engine_params(drafts=True) / 1e9 == pytest.approx(drafting, abs=0.005)
    if billions < 100:  # exactly what transformers' own model of the config holds (on meta; the large ones are slow)
        assert counted == sum(shape.numel() for shape in hf_tensors(bridge.hf).values())


def test_kv_cache_per_token_is_the_known_size():
    qwen3_8b = Architecture.from_bridge(get_bridge(str(PUBLIC / "qwen3_8b")))
    dsv3 = Architecture.from_bridge(get_bridge(str(PUBLIC / "deepseek_v3")))
    per_token = {
        (qwen3_8b, 1): 2 * 36 * 8 * 128 * 2,  # K and V of 8 KV heads per layer, bf16: 144 KiB
        (qwen3_8b, 4): 2 * 36 * 2 * 128 * 2,  # the heads split over TP
        (qwen3_8b, 16): 2 * 36 * 1 * 128 * 2,  # fewer KV heads than ranks: each rank keeps one
        (dsv3, 1): 61 * (512 + 64) * 2,  # MLA's latent and rotary key, the same on every TP rank
        (dsv3, 8): 61 * (512 + 64) * 2,
    }
    for (arch, tp), expected in per_token.items():
        assert engine_memory(arch, RolloutConfig(tensor_parallel_size=tp), 80 * GiB).kv_bytes_per_token == expected


def test_pipeline_micro_batches_in_flight():
    assert [in_flight(ParallelConfig(pp=4), r, 8) for r in range(4)] == [4, 3, 2, 1]  # 1F1B
    assert in_flight(ParallelConfig(pp=4), 0, 2) == 2  # fewer micro-batches than stages
    # Interleaved, PP 2 x VPP 2: rank 0 warms up (2-1)*2 + (2-1)*2 + 1 = 5 chunk-micro-batches = 2.5 stages.
    assert in_flight(ParallelConfig(pp=2, vpp=2), 0, 8) == 2.5


def _config(name: str, model: str, *overrides: str):
    os.environ["MCORE_RL_MODEL"] = str(PUBLIC / model)
    return load_run_config(REPO / "scripts" / "configs" / f"{name}.yaml", list(overrides))


def test_plan_explains_what_does_not_fit_and_suggests_layouts_that_do():
    config = _config(
        "qwen3_8b_grpo",
        "qwen3_8b",
        "models.policy_trainer.parallel.tp=1",
        "models.policy_trainer.parallel.sequence_parallel=false",
    )
    plan = plan_memory(config, 40 * GiB)
    assert not plan.fits
    assert any(p.startswith("train:") and "activations" in p for p in plan.problems), plan.problems
    suggestions = suggest_layouts(config, 40 * GiB)
    assert suggestions, "8 devices of 40 GiB hold Qwen3-8B with enough model parallelism"
    sizes = [(p.tp * p.pp, p.pp, peak) for p, peak in suggestions]
    assert sizes == sorted(sizes)
    assert all(peak <= 40 * GiB for _, peak in suggestions)
    # Without offload the engine's share meets the trainer's whole state in the rollout (and the sync's probe,
    # for which the KV caches wake); offload is what makes it fit. The sync itself needs the engine's weights only.
    assert plan_memory(_config("qwen3_8b_grpo", "qwen3_8b"), 80 * GiB).fits
    kept = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b", "models.policy_trainer.offload=false"), 80 * GiB)
    assert [p.split(":")[0] for p in kept.problems] == ["rollout"]


def test_full_recompute_keeps_layer_inputs_only():
    base = _config("qwen3_8b_grpo", "qwen3_8b", "models.policy_trainer.recompute=none")
    full = _config("qwen3_8b_grpo", "qwen3_8b", "models.policy_trainer.recompute=full")
    kept, recomputed = plan_memory(base, 80 * GiB).trainer, plan_memory(full, 80 * GiB).trainer
    assert recomputed.static == kept.static
    # 36 layers of one 16k-token pack at TP 2 + SP: all activations kept, or 36 layer inputs and one layer's during
    # its recomputation (the loss head is the same in both)
    a, parallel, tokens = (
        Architecture.from_bridge(get_bridge(str(PUBLIC / "qwen3_8b"))),
        base.models.policy_trainer.parallel,
        16384,
    )
    layer = layer_activation_bytes(a, False, parallel, tokens, "te", 2)
    layer_input = tokens // 2 * a.hidden * 2
    assert kept.activations - recomputed.activations == pytest.approx(36 * layer - (36 * layer_input + layer), abs=2)


def test_remedies_suggest_only_what_the_config_does_not_already_do():
    """No layout of 8 devices holds Qwen3-8B in 4 GiB each: the advice names what is left to change, and full
    recompute only while the config keeps activations."""
    for recompute, suggested in (("none", True), ("full", False)):
        config = _config("qwen3_8b_grpo", "qwen3_8b", f"models.policy_trainer.recompute={recompute}")
        (advice,) = remedies(config, 4 * GiB)
        assert advice.startswith("  no trainer layout fits: add devices"), advice
        assert ("recompute=full" in advice) == suggested, advice
        assert advice.endswith("or lower models.policy_trainer.max_token_in_packing"), advice


def test_a_disaggregated_plan_counts_each_pool_apart():
    """Qwen3-8B on 8 GPUs, 4 of them the engines': the trainer's layout gets half the data parallelism (its
    optimizer shards double), it never shares a device with the engine (no offload needed: its whole state stays),
    and an engine device holds the engine's share alone."""
    colocated = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b"), 80 * GiB)
    split = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b", "runtime_args.rollout_devices=4"), 80 * GiB)
    assert split.trainer.optimizer == pytest.approx(2 * colocated.trainer.optimizer, rel=1e-3)
    phases = {p.name: p for p in split.phases}
    assert set(phases["rollout (rollout devices)"].parts) == {"engine share", "reserve"}
    assert phases["train"].parts["trainer weights+grads+optimizer"] == split.trainer.static
    assert "engine share" not in phases["train"].parts and split.fits


def test_the_teacher_and_the_critic_are_counted():
    """PPO with a critic started from the policy, and a teacher: colocated with offload, each comes onto the device
    for its own phase only (the critic whole, for its step); kept, both stay through every phase; disaggregated,
    both are resident beside the trainer."""
    model = str(PUBLIC / "qwen3_8b")
    ppo = [
        "models.policy_trainer.advantage_estimator=gae",
        f"models.critic.load={model}",
        "models.critic.parallel.tp=2",
        "models.critic.parallel.sequence_parallel=true",
        "models.policy_trainer.distill_coef=0.1",
        f"models.teacher.load={model}",
        "models.teacher.parallel.tp=2",
    ]
    base = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b"), 80 * GiB)
    plan = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b", *ppo), 80 * GiB)
    phases = {p.name: p for p in plan.phases}
    assert [p.name for p in plan.phases] == ["rollout", "log-probs", "critic", "train", "sync"]
    critic = phases["critic"].parts["critic weights+grads+optimizer"]
    # the trainer's architecture and layout, without Qwen3-8B's untied LM head (a [1, hidden] value head instead)
    lm_head = 151936 * 4096 // 2  # its vocabulary (a multiple of 256) over TP 2
    assert critic == pytest.approx(base.trainer.static - lm_head * (2 + 4 + 12 / 4), rel=1e-3)
    assert phases["critic"].total > critic + phases["critic"].parts["activations"]
    teacher = phases["log-probs"].parts["largest scoring role"]
    assert teacher == base.trainer.weights  # bf16 weights of the same model at the same layout
    assert phases["rollout"].total == {p.name: p for p in base.phases}["rollout"].total  # all offloaded
    kept = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b", *ppo, "models.policy_trainer.offload=false"), 80 * GiB)
    for phase in kept.phases:
        assert phase.parts["critic weights+grads+optimizer"] == critic and phase.parts["teacher weights"] == teacher
    split = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b", *ppo, "runtime_args.rollout_devices=4"), 80 * GiB)
    train = {p.name: p for p in split.phases}["train"].parts
    assert train["teacher weights"] > 0 and train["critic weights+grads+optimizer"] > critic  # half the DP


def test_a_reward_model_and_a_judge_are_counted_where_they_run(tmp_path):
    """Qwen3-8B with a full-size Qwen3 reward model and a Qwen3-8B judge of its own: beside the trainer, the reward
    model's weights are there while the engines roll out, and the judge's engine share beside the policy's; on
    devices of their own, each pool has a phase of its own and the trainer's phases hold neither. A judge whose
    share leaves its KV cache too small for its context is a problem named with the fix."""
    rm = tmp_path / "rm"
    rm.mkdir()
    config = json.loads((PUBLIC / "qwen3_8b" / "config.json").read_text())
    config |= {"architectures": ["Qwen3ForSequenceClassification"], "id2label": {"0": "LABEL_0"}}
    (rm / "config.json").write_text(json.dumps(config))
    roles = [f"models.reward_model.load={rm}", f"models.judge.load={PUBLIC / 'qwen3_8b'}"]
    roles += ["models.judge.template='{response}'", "models.judge.max_model_len=8192"]
    beside = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b", *roles), 80 * GiB)
    phases = {p.name: p.parts for p in beside.phases}
    rm_weights, judge_share = phases["rollout"]["reward model weights"], phases["rollout"]["judge engine share"]
    assert judge_share == int(0.3 * 80 * GiB) and 14 * GiB < rm_weights < 15 * GiB  # bf16, no LM head, tp 1
    assert "judge engine share" not in phases["train"]
    # all three beside the engines' 0.6 overflow the rollout; on pools of their own they fit
    assert [p.split(" (")[0] for p in beside.problems] == ["rollout: 91.2 GiB needed > 80.0 GiB"]
    pools = ["runtime_args.reward_model_devices=2", "runtime_args.judge_devices=2"]
    own = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b", *roles, *pools), 80 * GiB)
    phases = {p.name: p.parts for p in own.phases}
    assert phases["score (reward model devices)"]["reward model weights"] == rm_weights
    assert phases["judge (judge devices)"]["judge engine share"] == judge_share
    assert not {"reward model weights", "judge engine share"} & {k for p in own.phases[:-2] for k in p.parts}
    assert own.fits, own.problems
    small = plan_memory(
        _config("qwen3_8b_grpo", "qwen3_8b", *roles, "models.judge.gpu_memory_utilization=0.2"), 80 * GiB
    )
    assert any(
        p.startswith("judge: the KV cache holds") and "models.judge.gpu_memory_utilization" in p for p in small.problems
    )


def test_a_lora_plan_trains_the_adapters_alone():
    """Qwen3-8B with rank-16 adapters: the frozen weights stay, the adapters join them, and only the adapters have
    gradients and Adam's state (sharded over the data-parallel ranks)."""
    full = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b"), 80 * GiB)
    plan = plan_memory(_config("qwen3_8b_grpo", "qwen3_8b", "models.policy_trainer.lora.rank=16"), 80 * GiB)
    a, parallel = Architecture.from_bridge(get_bridge(str(PUBLIC / "qwen3_8b"))), ParallelConfig(tp=2)
    adapters = sum(lora_params(a, False, parallel, LoRAConfig(rank=16))[0] for _ in range(a.layers))
    assert plan.trainer.weights == full.trainer.weights + 2 * adapters
    assert plan.trainer.grads == 4 * adapters and plan.trainer.optimizer == 12 * adapters // 4  # DP 4
    assert plan.trainer.static < full.trainer.static / 2


def test_mtp_layers_train_only_with_their_loss():
    """DeepSeek-V3 671B: its MTP layer (an MoE layer, its norms and projection, the embedding's copy) sits on the
    last pipeline stage; without mtp_loss_coef it is frozen (weights only), with it it gains gradients, Adam's state
    and one more layer's activations and logits."""
    a = Architecture.from_bridge(get_bridge(str(PUBLIC / "deepseek_v3")))
    parallel = ParallelConfig(tp=8, pp=8, ep=32, sequence_parallel=True, last_stage_layers=5)
    plain = dataclasses.replace(a, mtp_layers=0)
    mtp, mtp_experts = mtp_params(a, parallel)
    vocab_copy = a.padded_vocab(8) * a.hidden // 8
    with_mtp, without = stage_params(a, parallel), stage_params(plain, parallel)
    assert with_mtp[:-1] == without[:-1]
    assert with_mtp[-1] == (without[-1][0] + mtp + vocab_copy, without[-1][1] + mtp_experts)
    assert mtp_experts == 256 // 32 * 3 * 2048 * 7168 // 8  # its routed experts over EP 32, expert-TP 8 (the TP)

    config = _config("deepseek_v3_671b_grpo", "deepseek_v3", "models.policy_trainer.mtp_loss_coef=0.3")
    assert plan_memory(config, 80 * GiB).fits  # the script's layout trains it too
    work, one_stage = Workload.from_config(config), ParallelConfig(tp=8, ep=32, sequence_parallel=True)
    frozen = trainer_memory(a, one_stage, 256, work)
    trained = trainer_memory(a, one_stage, 256, work, mtp_loss_coef=0.3)
    mtp, _ = mtp_params(a, one_stage)
    assert trained.weights == frozen.weights
    assert trained.grads == frozen.grads + 4 * mtp
    assert trained.optimizer > frozen.optimizer and trained.activations > frozen.activations
