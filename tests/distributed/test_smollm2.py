"""The embedded real model (SmolLM2-135M-Instruct) in Megatron greedy-decodes what HF transformers decodes."""

import torch
import transformers

from converters.gguf2hf import default_model_dir
from tests.distributed import cases

PROMPT = "The capital of France is"
NEW_TOKENS = 8


def test_smollm2_greedy_matches_hf_at_tp1_and_tp2(ranks):
    model_dir = default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer(PROMPT)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(expected)
    for layout in (dict(tp=1), dict(tp=2)):
        for got in ranks.run(
            cases.greedy, hf_dir=str(model_dir), layout=layout, prompt_ids=prompt, new_tokens=NEW_TOKENS
        ):
            assert got[: len(expected)] == expected, (layout, tokenizer.decode(got), tokenizer.decode(expected))
