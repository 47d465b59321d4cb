"""The embedded real model (SmolLM2-135M-Instruct) in Megatron greedy-decodes what HF transformers decodes."""

import pytest
import torch
import transformers

from converters.gguf2hf import default_model_dir
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
        RuntimeError, match=r"num_attention_heads=9 is not divisible by tp=2; choose tp among \[1, 3, 9\]"
    ):
        ranks.run(cases.greedy, hf_dir=str(default_model_dir()), layout=dict(tp=2), prompt_ids=[1], new_tokens=1)
