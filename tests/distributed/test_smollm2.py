"""The embedded real model (SmolLM2-135M-Instruct) in Megatron greedy-decodes what HF transformers decodes."""

import pytest
import ray
import torch
import transformers

from converters.gguf2hf import default_model_dir
from mcore_rl.rollout.engine import RolloutConfig, SamplingConfig
from mcore_rl.rollout.remote import launch_engine, stop_engine
from tests.distributed import cases

PROMPT = "The capital of France is"
NEW_TOKENS = 8


def test_smollm2_greedy_matches_hf_at_tp1_and_tp3(ranks, ranks3):
    model_dir = default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer(PROMPT)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(expected)
    # 9 query / 3 KV heads: TP must divide 3, so TP=2 is refused up front (next test) and TP=3 runs on 3 ranks.
    for pool, layout in ((ranks, dict(tp=1)), (ranks3, dict(tp=3))):
        for got in pool.run(
            cases.greedy, hf_dir=str(model_dir), layout=layout, prompt_ids=prompt, new_tokens=NEW_TOKENS
        ):
            assert got[: len(expected)] == expected, (layout, tokenizer.decode(got), tokenizer.decode(expected))


def test_smollm2_tp2_is_refused_with_the_fix(ranks):
    with pytest.raises(
        RuntimeError, match=r"num_attention_heads=9 is not divisible by tp=2; choose tp among \[1, 3\]\n"
    ):
        ranks.run(cases.greedy, hf_dir=str(default_model_dir()), layout=dict(tp=2), prompt_ids=[1], new_tokens=1)


def test_smollm2_sync_changes_engine_output_exactly_as_megatron(ranks3, ray_address):
    """Load, generate, perturb the weights in Megatron (TP=3), sync: the engine now decodes what Megatron does."""
    model_dir = default_model_dir()
    prompt = transformers.AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS)
    engine = launch_engine(model_dir, RolloutConfig(max_model_len=256, cpu_kv_cache_bytes=64 << 20), name="smollm2")
    try:
        engine_before = ray.get(engine.generate.remote([prompt], greedy))[0][0].token_ids
        results = ranks3.run(
            cases.perturb_and_sync,
            hf_dir=str(model_dir),
            layout=dict(tp=3),
            ray_address=ray_address,
            engine_name="smollm2",
            prompt_ids=prompt,
            new_tokens=NEW_TOKENS,
        )
        engine_after = ray.get(engine.generate.remote([prompt], greedy))[0][0].token_ids
    finally:
        stop_engine(engine)
    megatron = results[0]
    assert engine_before == megatron["before"]
    assert megatron["after"] != megatron["before"], "the perturbation did not change Megatron's greedy output"
    assert engine_after == megatron["after"]
    # Random probe tokens get log-probs down to about -30 from a 135M model: 1e-3 is ~3e-5 relative (fp32).
    assert megatron["report"]["probe_max_abs_diff"] <= 1e-3
