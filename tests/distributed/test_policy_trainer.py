"""The policy-trainer role on a TP=2 x DP=2 layout: first-step invariants, and offload/onload between episodes
changes nothing (parameters, gradients' buffers and Adam state come back bit-identical)."""

from tests.distributed import cases


def test_offload_between_episodes_is_exact_and_first_ratio_is_one(ranks, tiny_models):
    hf_dir = tiny_models["Qwen3ForCausalLM"]
    plain = ranks.run(cases.policy_trainer_episodes, hf_dir=hf_dir, layout=dict(tp=2), offload=False)[0]
    offloaded = ranks.run(cases.policy_trainer_episodes, hf_dir=hf_dir, layout=dict(tp=2), offload=True)
    assert all(r["steps"] == offloaded[0]["steps"] for r in offloaded)  # every rank reports the same metrics
    assert offloaded[0]["steps"] == plain["steps"]
    assert offloaded[0]["freed"] > 0
    first = plain["steps"][0]
    assert abs(first["ratio_mean"] - 1) < 1e-6 and first["clip_fraction"] == 0 and first["grad_norm"] > 0
    # Two optimizer steps per episode: the second sees the first's update; the next episode re-scores old log-probs.
    assert plain["steps"][1]["ratio_mean"] != 1
    assert abs(plain["steps"][2]["ratio_mean"] - 1) < 1e-6
