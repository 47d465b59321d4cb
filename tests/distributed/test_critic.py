"""PPO's critic role (:class:`mcore_rl.trainer.value.ValueTrainer`): its values equal HF's (from a causal LM with
a fresh head, and from a reward model's score head); its values and value-loss steps under every parallel layout
equal the data-parallel run's (the loss is a batch mean, so the layout cannot change it), in padded, packed and
shared-prompt micro-batches; a run resumed from its checkpoint continues exactly."""

import pytest
import torch
import transformers

from tests.distributed import cases
from tests.tiny import make_tiny_reward_model

KEYS = ("loss", "grad_norm", "value_loss", "value_clip_fraction", "values_mean", "lr")


def _same(result: dict, expected: dict, what) -> None:
    for values, want in zip(result["values"], expected["values"], strict=True):
        assert (values - want).abs().max().item() <= 1e-5, what
    assert len(result["steps"]) == len(expected["steps"])
    for step, want in zip(result["steps"], expected["steps"], strict=True):
        for key in KEYS:
            assert step[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (what, key)


@pytest.mark.parametrize(
    "arch, layouts",
    [
        # tied embeddings (the critic unties them), under TP with sequence parallelism and under PP
        ("LlamaForCausalLM", [dict(tp=2, sequence_parallel=True), dict(pp=2, tp=2)]),
        ("DeepseekV3ForCausalLM", [dict(ep=2), dict(pp=2, ep=2)]),
    ],
)
def test_critic_layouts_match_data_parallel(ranks, tiny_models, arch, layouts):
    hf_dir = tiny_models[arch]
    padded = ranks.run(cases.critic_episodes, hf_dir=hf_dir, layout={})[0]
    # the critic learns: its loss falls over the two episodes' steps towards the same returns
    assert padded["steps"][2]["value_loss"] < padded["steps"][0]["value_loss"]
    assert padded["steps"][0]["value_clip_fraction"] == 0  # the first step starts at the old values
    variants = [dict(max_token_in_packing=24)]
    if arch == "LlamaForCausalLM":  # shared-prompt rows: not with MLA
        variants.append(dict(share_prompts=True))
    for variant in variants:
        _same(ranks.run(cases.critic_episodes, hf_dir=hf_dir, layout={}, **variant)[0], padded, variant)
    for layout in layouts:
        for result in ranks.run(cases.critic_episodes, hf_dir=hf_dir, layout=layout):
            _same(result, padded, layout)
    if arch == "LlamaForCausalLM":  # shared-prompt rows gather the sequence-parallel hidden states before the head
        layout = dict(tp=2, sequence_parallel=True)
        for result in ranks.run(cases.critic_episodes, hf_dir=hf_dir, layout=layout, share_prompts=True):
            _same(result, padded, "shared prompts, TP 2 + SP")


def test_critic_resumes_exactly_from_its_checkpoint(ranks, tiny_models, tmp_path):
    """Saved after one episode under one layout, loaded under another: the second episode's values and steps
    (warm-up and cosine LR schedule included) and the Adam state equal the uninterrupted run's (its sums over ranks
    compared under one layout: replicated parameters count once per TP rank). Adam runs torch's fused kernel, also
    after the load, and steps as Megatron-Core's own per-tensor Adam does."""
    hf_dir = tiny_models["Qwen3ForCausalLM"]
    straight = ranks.run(cases.critic_episodes, hf_dir=hf_dir, layout=dict(tp=2))[0]
    assert straight["fused"]
    per_tensor = ranks.run(cases.critic_episodes, hf_dir=hf_dir, layout=dict(tp=2), fused_adam=False)[0]
    assert not per_tensor["fused"]
    _same(straight, per_tensor, "fused vs per-tensor Adam")
    ranks.run(  # saved by Megatron-Core's own Adam, as before the fused kernel: the load switches to it
        cases.critic_episodes, hf_dir=hf_dir, layout=dict(tp=2), checkpoint_dir=str(tmp_path), episodes=1,
        fused_adam=False,
    )  # fmt: skip
    resumed = ranks.run(
        cases.critic_episodes, hf_dir=hf_dir, layout=dict(pp=2), checkpoint_dir=str(tmp_path), resume=True, episodes=1
    )
    second = dict(values=straight["values"][1:], steps=straight["steps"][2:])
    for result in resumed:
        _same(result, second, "resumed")
        assert result["fused"]
    digest = ranks.run(cases.critic_episodes, hf_dir=hf_dir, layout=dict(pp=2))[0]["digest"]
    for result in resumed:
        for key, value in digest.items():
            # the first episode ran under TP 2 there and PP 2 here: fp32 rounding, which the sum of the signed first
            # moments (about 0.05 from cancelling terms) turns into about 1e-7 absolute
            assert result["digest"][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def _hf_values(hf_dir: str, tokens: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
    """Per-position values from HF: its reward model's score head at every position, or ``head`` on a causal
    LM's last hidden states."""
    with torch.no_grad():
        if head is None:
            model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir)
            return model.score(model.model(tokens[:, :-1]).last_hidden_state).squeeze(-1)
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
        return (model.model(tokens[:, :-1]).last_hidden_state @ head.T).squeeze(-1)


def test_critic_values_match_hf_from_a_causal_lm_and_from_a_reward_model(ranks, tiny_models, tmp_path):
    """Started from the policy, the value head is the seeded OpenRLHF initialisation (std 1 / (hidden + 1)) on the
    policy's last hidden states; from a reward model, its score head. Both under TP with sequence parallelism and
    under PP, against HF's forward."""
    causal = tiny_models["LlamaForCausalLM"]
    hidden = transformers.AutoConfig.from_pretrained(causal).hidden_size
    head = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0)) / (hidden + 1)
    tokens = torch.randint(4, 100, (4, 10), generator=torch.Generator().manual_seed(1))
    for hf_dir, want in (
        (causal, _hf_values(causal, tokens, head)),
        (rm := make_tiny_reward_model(causal, tmp_path / "rm"), _hf_values(rm, tokens)),
    ):
        assert want.abs().mean() > 1e-3
        for layout in (dict(tp=2, sequence_parallel=True), dict(pp=2)):
            for values in ranks.run(cases.critic_values, hf_dir=hf_dir, layout=layout, tokens=tokens):
                assert (values - want).abs().max().item() < 1e-5, (hf_dir, layout)
