"""MoE in RL: load balancing settings (aux loss, expert-bias updates) and router metrics are layout-independent,
and the expert bias a step moved is what a checkpoint gives back."""

import pytest
import torch

from tests.distributed import cases

LAYOUTS = (dict(ep=2), dict(tp=2, ep=2, sequence_parallel=True), dict(pp=2))


@pytest.mark.parametrize(
    "arch, moe",
    [
        ("DeepseekV3ForCausalLM", dict(aux_loss_coeff=0.01, expert_bias_update_rate=0.01)),
        ("Qwen3MoeForCausalLM", dict(aux_loss_coeff=0.01)),
    ],
)
def test_balancing_and_router_metrics_match_single_rank(ranks, tiny_models, tmp_path, arch, moe):
    run = lambda layout, name: ranks.run(  # noqa: E731
        cases.moe_balancing_step, hf_dir=tiny_models[arch], layout=layout, moe=moe, checkpoint_dir=str(tmp_path / name)
    )
    reference = run({}, "reference")[0]
    off = ranks.run(
        cases.moe_balancing_step, hf_dir=tiny_models[arch], layout={}, moe={}, checkpoint_dir=str(tmp_path / "off")
    )[0]
    # The aux loss reaches the gradient; the loss metric is the policy loss alone, which it does not change.
    assert reference["step"]["grad_norm"] != pytest.approx(off["step"]["grad_norm"], rel=1e-6)
    assert reference["step"]["loss"] == pytest.approx(off["step"]["loss"], rel=1e-6)

    router = reference["router"]
    layers = [k for k in router if k.endswith("/tokens_per_expert")]
    assert layers and router["moe/max_over_mean"] >= 1.0
    for key in layers:  # every token of the step is routed to top-k experts in each layer: 8 rows x 12 positions
        assert sum(router[key]) == 8 * 12 * (4 if arch.startswith("Deepseek") else 2)
    if "expert_bias_update_rate" in moe:
        assert reference["trained"] != reference["initial"] and reference["loaded"] == reference["trained"]
        assert off["trained"] == off["initial"]  # rate 0: the bias stays as loaded

    for layout in LAYOUTS:
        for result in run(layout, str(layout)):
            assert result["step"]["loss"] == pytest.approx(reference["step"]["loss"], rel=1e-5), layout
            assert result["step"]["grad_norm"] == pytest.approx(reference["step"]["grad_norm"], rel=1e-5), layout
            assert result["router"] == reference["router"], layout
            assert result["trained"] == reference["trained"] and result["loaded"] == result["trained"], layout


def _episodes(ranks, hf_dir, layout, routing=None, packing=0):
    return ranks.run(
        cases.policy_trainer_episodes,
        hf_dir=hf_dir,
        layout=layout,
        max_token_in_packing=packing,
        moe=dict(routing_replay=routing is not None),
        routing=routing,
    )


def _assert_same(result, reference, what):
    for logp, expected in zip(result["logprobs"], reference["logprobs"], strict=True):
        assert (logp - expected).abs().max().item() <= 1e-5, what
    for step, expected in zip(result["steps"], reference["steps"], strict=True):
        for key in ("loss", "grad_norm", "ratio_mean"):
            assert step[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (what, key)


def test_routing_replay_follows_the_given_experts_in_every_layout(ranks, tiny_models):
    """Replaying the routing the model itself computes (HF's, for the weights the rollout had) changes nothing until
    an update: old log-probs and the first step are the plain run's. Replaying random routing changes the model's
    outputs, and identically in every layout (ids follow their tokens through packing, CP, sequence parallelism,
    PP and EP)."""
    hf_dir = tiny_models["Qwen3MoeForCausalLM"]
    plain = _episodes(ranks, hf_dir, {})[0]
    replayed = _episodes(ranks, hf_dir, {}, routing="hf")[0]
    assert torch.equal(replayed["logprobs"][0], plain["logprobs"][0])
    for key in ("loss", "grad_norm", "ratio_mean"):
        assert replayed["steps"][0][key] == pytest.approx(plain["steps"][0][key], rel=1e-6), key
    # After an update the replayed routing is the rollout's, no longer the model's own.
    assert not torch.equal(replayed["logprobs"][1], plain["logprobs"][1])
    forced = _episodes(ranks, hf_dir, {}, routing="random")[0]
    assert (forced["logprobs"][0] - plain["logprobs"][0]).abs().max().item() > 1e-2
    for layout in (dict(tp=2, ep=2, sequence_parallel=True), dict(cp=2), dict(pp=2, ep=2)):
        for packing in (0, 24):
            for result in _episodes(ranks, hf_dir, layout, routing="random", packing=packing):
                _assert_same(result, forced, (layout, packing))
