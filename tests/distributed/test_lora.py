"""LoRA adapters on Megatron's tensor-parallel linears (models/lora.py): under every layout the loss, the log-probs
and the adapters' whole gradients equal one rank's; the base model is the adapters switched off; each merged
shard is the shard of ``W + scale B A`` computed from whole tensors; only the adapters train; checkpoints load
under other layouts; the converter exports a PEFT adapter and a merged model that HF computes as the trainer."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from converters.gguf2hf import default_model_dir
from converters.hf_io import HFCheckpoint
from converters.plan import ADAPTERS
from converters.torch_dist import LORA_FILE, MODEL_SUBDIR, Reader
from tests.distributed import cases
from tests.distributed.test_converters import cli
from tests.tiny import MOONLIGHT, make_tiny

LAYOUTS = [dict(tp=2), dict(tp=2, sequence_parallel=True), dict(pp=2), dict(tp=2, pp=2, sequence_parallel=True)]
MOE_LAYOUTS = [dict(ep=2), dict(tp=2, ep=2, sequence_parallel=True)]
EXPERT_LAYOUTS = [dict(ep=2), dict(tp=2, ep=2, etp=1, sequence_parallel=True), dict(pp=2, ep=2)]
ATTENTION, MLP = ["linear_qkv", "linear_proj"], ["linear_fc1", "linear_fc2"]
EXPERTS = ["experts.linear_fc1", "experts.linear_fc2"]


@pytest.mark.parametrize(
    ("arch", "targets", "layouts", "grouped"),
    [
        ("LlamaForCausalLM", ATTENTION + MLP, LAYOUTS, True),
        ("Qwen3ForCausalLM", ATTENTION + MLP, LAYOUTS, True),
        ("Qwen3MoeForCausalLM", ATTENTION, MOE_LAYOUTS, True),
        ("DeepseekV3ForCausalLM", ["linear_proj", *MLP], MOE_LAYOUTS, True),  # MLA's output, dense and shared MLPs
        # the routed experts: as grouped GEMMs (adapters in their forward) and sequential (forward hooks)
        ("Qwen3MoeForCausalLM", ATTENTION + EXPERTS, EXPERT_LAYOUTS, False),
        ("DeepseekV3ForCausalLM", EXPERTS, EXPERT_LAYOUTS, True),
    ],
)
def test_lora_step_matches_one_rank_under_every_layout(ranks, tiny_models, arch, targets, layouts, grouped):
    _check_lora_step(ranks, tiny_models[arch], targets, layouts, grouped)


@pytest.mark.parametrize("q_lora", [True, False], ids=["deepseek_v3", "moonlight"])
def test_mla_adapters_match_one_rank_under_every_layout(ranks, tmp_path, q_lora):
    """Multi-latent attention's projections: the query's (direct, Moonlight's, or through a latent, DeepSeek-V3's)
    and the key/value latent's up projections column-parallel, the latents' down projections replicated (each TP
    rank's tokens under sequence parallelism, their adapters' gradients summed over TP as the weights' are)."""
    hf_dir = make_tiny("DeepseekV3ForCausalLM", tmp_path / "mla", **({} if q_lora else MOONLIGHT))
    queries = ["linear_q_down_proj", "linear_q_up_proj"] if q_lora else ["linear_q_proj"]
    targets = [*queries, "linear_kv_down_proj", "linear_kv_up_proj"]
    layouts = [dict(tp=2, sequence_parallel=True), dict(tp=2, pp=2, sequence_parallel=True)]  # MoE: TP needs SP
    _check_lora_step(ranks, str(hf_dir), targets, layouts)


def _check_lora_step(ranks, hf_dir: str, targets: list[str], layouts: list[dict], grouped: bool = True) -> None:
    tokens = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(3))
    step = dict(hf_dir=hf_dir, tokens=tokens, rank=4, targets=targets, grouped=grouped)
    # the model whole on every rank (data parallel only): the reference the model-parallel layouts must equal
    reference = ranks.run(cases.lora_sgd_step, layout={}, **step)[0]
    assert reference["merge_error"] < 1e-6
    assert (reference["lora_logp"] - reference["base_logp"]).abs().max() > 1e-3  # B is not zero: the adapters act
    assert all("lora." in n for n in reference["trained"]), reference["trained"][:4]  # only the adapters train
    slots = sorted(reference["grads"])
    assert {"experts." * ("local_experts" in s) + s.rsplit(".", 1)[1] for s in slots} == set(targets)
    assert all(g.abs().max() > 0 for pair in reference["grads"].values() for g in pair)
    for layout in layouts:
        for got in ranks.run(cases.lora_sgd_step, layout=layout, **step):
            assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5), layout
            assert got["merge_error"] < 1e-6, layout
            for key in ("base_logp", "lora_logp"):
                assert (got[key] - reference[key]).abs().max() < 1e-4, (layout, key)
            assert sorted(got["grads"]) == slots, layout
            for slot in slots:
                for want, have in zip(reference["grads"][slot], got["grads"][slot], strict=True):
                    assert (have - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), (layout, slot)


def test_trained_routers_match_one_rank_and_the_reference_keeps_them_as_loaded(ranks, tiny_models):
    """``lora.train_router``: the routers train beside the adapters with one rank's gradients in every layout, while
    the reference (the adapters off) still computes the model as loaded, its routers put back."""
    tokens = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(3))
    step = dict(hf_dir=tiny_models["Qwen3MoeForCausalLM"], tokens=tokens, rank=4, targets=ATTENTION, train_router=True)
    reference = ranks.run(cases.lora_sgd_step, layout={}, **step)[0]
    routers = sorted(s for s in reference["grads"] if s.endswith(".router"))
    assert routers and all(reference["grads"][s][0].abs().max() > 0 for s in routers)
    model_params = [n for n in reference["trained"] if "lora." not in n]  # the rest trains beside the adapters
    assert len(model_params) == len(routers) and all(n.endswith("router.weight") for n in model_params)
    assert torch.equal(reference["base_after"], reference["base_logp"])
    for layout in [*MOE_LAYOUTS, dict(pp=2, ep=2)]:
        for got in ranks.run(cases.lora_sgd_step, layout=layout, **step):
            assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5), layout
            assert (got["base_after"] - reference["base_logp"]).abs().max() < 1e-4, layout
            for slot in routers:
                (want,), (have,) = reference["grads"][slot], got["grads"][slot]
                assert (have - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), (layout, slot)


def test_a_policy_training_its_routers_resumes_them_and_keeps_the_reference_as_loaded(ranks, tiny_models, tmp_path):
    """The policy-trainer role with ``train_router`` on DeepSeek-V3 (its expert bias moving too), TP 2 x EP 2 with
    sequence parallelism: a step moves its routers and its policy, not its reference; resumed from its checkpoint by
    a trainer started from the HF model, both are as they were."""
    got = ranks.run(
        cases.lora_router_policy, hf_dir=tiny_models["DeepseekV3ForCausalLM"],
        layout=dict(tp=2, ep=2, sequence_parallel=True), directory=str(tmp_path),
        moe=dict(expert_bias_update_rate=0.01),
    )[0]  # fmt: skip
    assert got["moved"] > 1e-3 and got["settings"] == {"rank": 4, "alpha": 32.0, "train_router": True}
    (ref_before, policy_before), (ref_after, policy_after) = got["before"], got["after"]
    assert torch.equal(ref_before, policy_before)  # B starts at zero
    assert torch.equal(ref_after, ref_before) and (policy_after - policy_before).abs().max() > 1e-3
    for want, have in zip(got["after"], got["resumed"], strict=True):
        assert (have - want).abs().max() < 1e-6


def test_lora_dropout_acts_in_training_only_with_masks_the_tp_ranks_agree_on(ranks, tiny_models):
    """PEFT's lora_dropout: the step differs from one without it, the log-probs (scored in eval mode) do not; the
    TP ranks draw the same mask for an input they all hold, so sequence parallelism (which gathers that input
    first) takes the same step, gradient for gradient."""
    tokens = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(3))
    step = dict(hf_dir=tiny_models["LlamaForCausalLM"], tokens=tokens, rank=4, targets=ATTENTION + MLP)
    plain = ranks.run(cases.lora_sgd_step, layout=dict(tp=2), **step)[0]
    dropped, sp = (
        ranks.run(cases.lora_sgd_step, layout=layout, dropout=0.3, **step)
        for layout in (dict(tp=2), dict(tp=2, sequence_parallel=True))
    )
    assert all(r["masks_agree"] for r in (*dropped, *sp))
    dropped, sp = dropped[0], sp[0]
    assert torch.equal(dropped["lora_logp"], plain["lora_logp"]) and dropped["loss"] != plain["loss"]
    assert sp["loss"] == pytest.approx(dropped["loss"], rel=1e-6)
    for slot, pair in dropped["grads"].items():
        for want, have in zip(pair, sp["grads"][slot], strict=True):
            assert (have - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), slot


def test_lora_checkpoints_and_merged_exports_are_layout_free(ranks, tmp_path):
    """Adapters saved under TP 2 with sequence parallelism load under PP 2 and one rank alike (a gated MLP's B
    stored gate and up apart, as its weight is); the merged HF tensors exported are the same in all three, and
    differ from the base model's where adapters act."""
    # a vocabulary that TP 1 and TP 2 pad alike (a checkpoint loads under another TP size only then)
    hf_dir, directory = str(make_tiny("LlamaForCausalLM", tmp_path / "llama", vocab_size=256)), tmp_path / "ckpt"
    directory.mkdir()
    saved = ranks.run(
        cases.lora_checkpoint_export, hf_dir=hf_dir, layout=dict(tp=2, sequence_parallel=True), directory=str(directory),
        load=False,
    )[0]  # fmt: skip
    base = HFCheckpoint(hf_dir)
    changed = {n for n, t in saved.items() if not torch.equal(t, base.get(n))}
    assert any("mlp.gate_proj" in n for n in changed) and any("self_attn.o_proj" in n for n in changed)
    for layout in (dict(pp=2), dict()):
        loaded = ranks.run(
            cases.lora_checkpoint_export, hf_dir=hf_dir, layout=layout, directory=str(directory), load=True
        )
        assert loaded[0].keys() == saved.keys()
        for name, tensor in saved.items():
            assert (loaded[0][name] - tensor).abs().max() < 1e-6, (layout, name)
    with pytest.raises(Exception, match="holds LoRA adapters .* and this model has none"):
        ranks.run(cases.load_plain, hf_dir=hf_dir, layout=dict(), directory=str(directory))


def test_expert_adapters_checkpoint_under_their_global_experts(ranks, tmp_path):
    """DeepSeek-V3's routed experts' adapters saved under EP 2 (TP 2, expert-TP 1, SP) load under one rank and under
    PP 2 x EP 2: each expert's adapter is stored under its global expert, and the merged export is the same."""
    # a vocabulary that TP 1 and TP 2 pad alike
    hf_dir = str(make_tiny("DeepseekV3ForCausalLM", tmp_path / "deepseek", vocab_size=256))
    directory = tmp_path / "ckpt"
    directory.mkdir()
    targets = ["linear_proj", "experts.linear_fc1", "experts.linear_fc2"]
    run = lambda layout, load: ranks.run(  # noqa: E731
        cases.lora_checkpoint_export, hf_dir=hf_dir, layout=layout, directory=str(directory), load=load, targets=targets
    )[0]
    saved = run(dict(tp=2, ep=2, etp=1, sequence_parallel=True), False)
    base = HFCheckpoint(hf_dir)
    changed = {n for n, t in saved.items() if not torch.equal(t, base.get(n))}
    assert {n for n in changed if ".mlp.experts." in n} == {
        n for n in saved if ".mlp.experts." in n and not n.startswith("model.layers.4.")
    }  # every routed expert of the decoder's MoE layers (the MTP layer is not adapted)
    for layout in (dict(), dict(pp=2, ep=2)):
        loaded = run(layout, True)
        assert loaded.keys() == saved.keys()
        for name, tensor in saved.items():
            assert (loaded[name] - tensor).abs().max() < 1e-6, (layout, name)
    # mcore-rl-mcore2hf: the merged model, the trainer's; no PEFT adapter (PEFT has no place for them on
    # transformers' fused experts)
    (directory / "lora.json").write_text(json.dumps({"rank": 4, "alpha": 8.0}))
    refused = cli("mcore2hf", directory, tmp_path / "peft", "--hf-config", hf_dir)
    assert refused.returncode == 2 and "adapters on routed experts" in refused.stderr and "--merge" in refused.stderr
    assert cli("mcore2hf", directory, tmp_path / "merged", "--hf-config", hf_dir, "--merge").returncode == 0
    exported = HFCheckpoint(tmp_path / "merged")
    for name, tensor in saved.items():
        assert (exported.get(name) - tensor).abs().max() < 1e-6, name


def test_trained_routers_checkpoint_with_their_copies_and_export_merged_only(ranks, tmp_path):
    """Routers trained beside the adapters, saved under TP 2 x EP 2 with sequence parallelism, load under one rank
    with their copies as loaded (the reference's); mcore2hf exports the trained routers merged and refuses a PEFT
    adapter, which cannot carry them to vLLM."""
    hf_dir = str(make_tiny("Qwen3MoeForCausalLM", tmp_path / "moe", vocab_size=256))
    directory = tmp_path / "ckpt"
    directory.mkdir()
    run = lambda layout, load: ranks.run(  # noqa: E731
        cases.lora_checkpoint_export, hf_dir=hf_dir, layout=layout, directory=str(directory), load=load,
        targets=ATTENTION, train_router=True,
    )[0]  # fmt: skip
    saved, base = run(dict(tp=2, ep=2, sequence_parallel=True), False), HFCheckpoint(hf_dir)
    copies = {n: t for n, t in saved.items() if n.startswith("lora.")}
    assert copies and len(copies) == len([n for n in saved if n.endswith("mlp.gate.weight")])
    for name, copy in copies.items():  # lora.decoder.layers.<i>.mlp.router.weight: model.layers.<i>.mlp.gate's
        hf = name.removeprefix("lora.decoder.").replace(".router.", ".gate.")
        assert torch.equal(copy, base.get(f"model.{hf}")) and not torch.equal(saved[f"model.{hf}"], copy), name
    loaded = run(dict(), True)
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert (loaded[name] - tensor).abs().max() < 1e-6, name
    (directory / "lora.json").write_text(json.dumps({"rank": 4, "alpha": 8.0, "train_router": True}))
    refused = cli("mcore2hf", directory, tmp_path / "peft", "--hf-config", hf_dir)
    assert refused.returncode == 2 and "routers trained beside the adapters" in refused.stderr, refused.stderr
    assert cli("mcore2hf", directory, tmp_path / "merged", "--hf-config", hf_dir, "--merge").returncode == 0
    exported = HFCheckpoint(tmp_path / "merged")
    for name, tensor in saved.items():
        if not name.startswith("lora."):
            assert (exported.get(name) - tensor).abs().max() < 1e-6, name


def test_mla_adapters_export_as_a_peft_adapter_that_hf_computes_as_the_merged_model(ranks, tmp_path):
    """DeepSeek-V3's multi-latent attention adapted (its rotary rows in HF's rotate-half order, which the mappings
    permute, B's rows with them), saved under TP 2 x EP 2 with sequence parallelism: mcore2hf's PEFT adapter over
    the base gives HF's log-probs of the merged export (itself the trainer's merged weights), and hf2mcore --peft
    brings the same adapter tensors back."""
    import peft

    hf_dir = make_tiny("DeepseekV3ForCausalLM", tmp_path / "mla", vocab_size=256, rope_interleave=False)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    targets = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    saved = ranks.run(
        cases.lora_checkpoint_export, hf_dir=str(hf_dir), layout=dict(tp=2, ep=2, sequence_parallel=True),
        directory=str(checkpoint), load=False, targets=targets,
    )[0]  # fmt: skip
    (checkpoint / LORA_FILE).write_text(json.dumps({"rank": 4, "alpha": 8.0}))
    for args in ([], ["--merge"]):
        out = tmp_path / ("merged" if args else "peft")
        assert cli("mcore2hf", checkpoint, out, "--hf-config", hf_dir, *args).returncode == 0
    merged = HFCheckpoint(tmp_path / "merged")
    assert all(torch.equal(merged.get(name), tensor) for name, tensor in saved.items())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]

    load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    model = peft.PeftModel.from_pretrained(load(hf_dir), tmp_path / "peft")
    assert sorted(model.peft_config["default"].target_modules) == [
        "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj",
    ]  # fmt: skip
    want, base = logprobs(load(tmp_path / "merged")), logprobs(load(hf_dir))
    assert (want - base).abs().max() > 1e-3 and (logprobs(model) - want).abs().max() < 1e-5
    converted = tmp_path / "converted"
    assert cli("hf2mcore", hf_dir, converted, "--peft", tmp_path / "peft").returncode == 0
    original, back = Reader(checkpoint), Reader(converted / MODEL_SUBDIR)
    keys = sorted(k for k in original.tensors if k.startswith(ADAPTERS))
    assert keys and keys == sorted(k for k in back.tensors if k.startswith(ADAPTERS))
    for key in keys:
        assert torch.equal(original.whole(key), back.whole(key)), key


def test_a_smollm2_lora_checkpoint_exports_a_peft_adapter_and_a_merged_model_as_the_trainer_computes(ranks3, tmp_path):
    """SmolLM2 (tied embeddings, 9 heads / 3 KV heads, TP 3): mcore-rl-mcore2hf turns a LoRA checkpoint into a
    PEFT adapter that HF's peft loads over the base model, and with --merge into a merged model; both give the
    trainer's log-probs as closely as HF gives the frozen model's (fp32: about 1e-5 on average, under 1e-4 per
    token; Megatron at TP 3 and HF sum in different orders). Either way the adapter's A is shared by q/k/v and by gate/up, whose
    rows of B the weights' own mappings split."""
    import peft

    model_dir = default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = ["The capital of France is Paris.", "2 + 3 = 5, and 7 * 6 = 42; the sum is 47."]
    ids = tokenizer(texts, padding="longest", return_tensors="pt")["input_ids"]
    checkpoint = tmp_path / "policy"
    checkpoint.mkdir()
    trainer, trainer_base = ranks3.run(
        cases.lora_checkpoint_logprobs, hf_dir=str(model_dir), layout=dict(tp=3), directory=str(checkpoint),
        tokens=ids,
    )[0]  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            logits = model(ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    assert (logprobs(base) - trainer).abs().max() > 1e-3  # the adapters act
    base_diff = (logprobs(base) - trainer_base).abs()  # the frozen model's own: measured 1.1e-5 mean, 2.6e-5 max
    for args in ([], ["--merge"]):
        out = tmp_path / ("merged" if args else "peft")
        assert cli("mcore2hf", checkpoint, out, "--hf-config", model_dir, *args).returncode == 0
        if args:
            model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        else:
            fresh = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model = peft.PeftModel.from_pretrained(fresh, out)
            assert sorted(model.peft_config["default"].target_modules) == [
                "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj",
            ]  # fmt: skip
        diff = (logprobs(model) - trainer).abs()  # measured 0.9e-5 / 1.0e-5 mean, 2.1e-5 max
        assert diff.max() < 1e-4 and diff.mean() < 1.5 * base_diff.mean(), (args, diff.mean(), base_diff.mean())
    # hf2mcore --peft brings the adapter back: the same tensors, and a LoRA run starting from the conversion
    # computes what the trainer did
    converted = tmp_path / "converted"
    assert cli("hf2mcore", model_dir, converted, "--peft", tmp_path / "peft", "--tp", "3").returncode == 0
    original, back = Reader(checkpoint), Reader(converted / MODEL_SUBDIR)
    keys = sorted(k for k in original.tensors if k.startswith(ADAPTERS))
    assert keys and keys == sorted(k for k in back.tensors if k.startswith(ADAPTERS))
    for key in keys:
        assert torch.equal(original.whole(key), back.whole(key)), key
    assert json.loads((converted / MODEL_SUBDIR / LORA_FILE).read_text()) == {"rank": 8, "alpha": 16.0}
    resumed = ranks3.run(
        cases.lora_logprobs_from, hf_dir=str(model_dir), layout=dict(tp=3), directory=str(converted), tokens=ids
    )[0]
    assert torch.equal(resumed, trainer)
    # from a model without adapters (plain hf2mcore), the adapters start fresh: the base model's log-probs
    plain = tmp_path / "plain"
    assert cli("hf2mcore", model_dir, plain, "--tp", "3").returncode == 0
    fresh = ranks3.run(
        cases.lora_logprobs_from, hf_dir=str(model_dir), layout=dict(tp=3), directory=str(plain), tokens=ids
    )[0]
    assert torch.equal(fresh, trainer_base)
