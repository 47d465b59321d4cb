"""The policy-trainer role on a TP=2 x DP=2 layout: first-step invariants, and offload/onload between episodes
changes nothing (parameters, gradients' buffers and Adam state come back bit-identical)."""

import pytest
import torch

from mcore_rl.planner.memory import Workload, trainer_memory
from mcore_rl.planner.params import Architecture
from models.registry import get_bridge
from parallel.config import ParallelConfig
from tests.distributed import cases


def test_offload_between_episodes_is_exact_and_first_ratio_is_one(ranks, tiny_models):
    hf_dir = tiny_models["Qwen3ForCausalLM"]
    plain = ranks.run(cases.policy_trainer_episodes, hf_dir=hf_dir, layout=dict(tp=2), offload=False)[0]
    offloaded = ranks.run(cases.policy_trainer_episodes, hf_dir=hf_dir, layout=dict(tp=2), offload=True)
    assert all(r["steps"] == offloaded[0]["steps"] for r in offloaded)  # every rank reports the same metrics
    assert offloaded[0]["steps"] == plain["steps"]
    # What the offload freed is the trainer's static memory as the planner counts it (fp32 weights, as on CPU: the
    # optimizer's main weights are views of them); Megatron pads its buffers, hence the margin.
    static = trainer_memory(
        Architecture.from_bridge(get_bridge(hf_dir)), ParallelConfig(tp=2), 4, Workload(1, 1), param_bytes=4
    ).static
    assert offloaded[0]["freed"] == pytest.approx(static, rel=0.01)
    first = plain["steps"][0]
    assert abs(first["ratio_mean"] - 1) < 1e-6 and first["clip_fraction"] == 0 and first["grad_norm"] > 0
    # Two optimizer steps per episode: the second sees the first's update; the next episode re-scores old log-probs.
    assert plain["steps"][1]["ratio_mean"] != 1
    assert abs(plain["steps"][2]["ratio_mean"] - 1) < 1e-6


def test_trajectories_of_several_rows_train_alike_on_every_data_parallel_layout(ranks, tiny_models):
    """Ten rows of eight samples (rewritten multi-turn histories): scored over 4, 2 and 1 data-parallel ranks (the
    last row repeated to even shares, then dropped) and trained in two steps of four samples each, the same."""
    hf_dir = tiny_models["Qwen3ForCausalLM"]
    reference = ranks.run(cases.policy_trainer_segments, hf_dir=hf_dir, layout=dict(tp=2, pp=2))[0]
    assert len(reference["logprobs"]) == 10 and len(reference["steps"]) == 2
    assert abs(reference["steps"][0]["ratio_mean"] - 1) < 1e-6  # the first step's rows are their own old policy
    assert reference["steps"][1]["ratio_mean"] != 1  # the second's were scored before the first step
    for layout in (dict(), dict(tp=2)):
        for result in ranks.run(cases.policy_trainer_segments, hf_dir=hf_dir, layout=layout):
            assert (result["logprobs"] - reference["logprobs"]).abs().max().item() <= 2e-5, layout
            for step, expected in zip(result["steps"], reference["steps"], strict=True):
                for key in ("loss", "grad_norm", "ratio_mean"):
                    assert step[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (layout, key)


@pytest.mark.parametrize(
    "arch, layouts",
    [
        ("Qwen3ForCausalLM", [dict(cp=2), dict(cp=4), dict(cp=2, tp=2, sequence_parallel=True)]),
        ("DeepseekV3ForCausalLM", [dict(cp=2, ep=2), dict(cp=2, pp=2)]),
    ],
)
def test_context_parallel_episodes_match_single_rank(ranks, tiny_models, arch, layouts):
    """The role under context parallelism (rows shared by the CP ranks of a DP rank, sequences split over them,
    per-token outputs gathered for the loss): old log-probs and every step's metrics equal the CP=1 run's, for
    padded and packed micro-batches; and packed equals padded (the loss is a batch mean, whatever the grouping)."""
    references = {}
    for packing in (0, 24):
        references[packing] = reference = ranks.run(
            cases.policy_trainer_episodes, hf_dir=tiny_models[arch], layout={}, max_token_in_packing=packing
        )[0]
        for step, padded in zip(reference["steps"], references[0]["steps"], strict=True):
            assert step["loss"] == pytest.approx(padded["loss"], rel=1e-5)
            assert step["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
        for layout in layouts:
            for result in ranks.run(
                cases.policy_trainer_episodes, hf_dir=tiny_models[arch], layout=layout, max_token_in_packing=packing
            ):
                for logp, expected in zip(result["logprobs"], reference["logprobs"], strict=True):
                    # fp32 sums in another order (CP x EP), then an update: a few ulps of log-probs near -5
                    assert (logp - expected).abs().max().item() <= 2e-5, (layout, packing)
                for step, expected in zip(result["steps"], reference["steps"], strict=True):
                    assert step.keys() == expected.keys()
                    for key in ("loss", "grad_norm", "ratio_mean", "kl", "entropy"):
                        if key in expected:
                            assert step[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (layout, key)


@pytest.mark.parametrize(
    ("arch", "layout", "packing"),
    [
        ("Qwen3ForCausalLM", dict(tp=2, sequence_parallel=True), 0),
        ("DeepseekV3ForCausalLM", dict(pp=2, ep=2), 24),
    ],
)
def test_full_recompute_trains_exactly_as_kept_activations(ranks, tiny_models, arch, layout, packing):
    """``recompute: full`` re-runs each layer's forward in the backward instead of keeping its activations: the
    same gradients, so the same steps."""
    runs = {
        mode: ranks.run(
            cases.policy_trainer_episodes,
            hf_dir=tiny_models[arch],
            layout=layout,
            max_token_in_packing=packing,
            recompute=mode,
        )[0]
        for mode in ("none", "full")
    }
    for step, expected in zip(runs["full"]["steps"], runs["none"]["steps"], strict=True):
        for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
            assert step[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-8), key


@pytest.mark.parametrize(
    "arch, layout",
    [("LlamaForCausalLM", dict()), ("Qwen2ForCausalLM", dict(tp=2)), ("LlamaForCausalLM", dict(pp=2))],
    ids=["tied-dp4", "untied-tp2", "tied-pp2"],
)
def test_weight_gradients_written_into_the_buffers_match_autograds(ranks, tiny_models, arch, layout):
    """The trained roles' linears add their weight gradients into DDP's buffers in the GEMM and their embeddings
    add their rows there (compat.megatron_core.accumulate_in_main_grads): the buffers, loss, grad norm and updated
    parameters of a step over two micro-batches per rank are autograd's to fp32 rounding, with a tied embedding
    and LM head on one stage (whose zeroed dummy gradient is skipped), on two, and vocab-parallel."""
    tokens = torch.randint(0, 100, (8, 9), generator=torch.Generator().manual_seed(3))
    kwargs = dict(hf_dir=tiny_models[arch], layout=layout, tokens=tokens)
    plain = ranks.run(cases.accumulated_weight_grads_step, accumulate=False, **kwargs)
    accumulated = ranks.run(cases.accumulated_weight_grads_step, accumulate=True, **kwargs)
    assert any(got["accumulating"] for got in accumulated)
    for expected, got in zip(plain, accumulated, strict=True):
        assert expected["accumulating"] == []  # the embeddings switch with the linears
        assert got["accumulating"] == [name for name in got["params"] if "word_embeddings" in name]
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
        for part in ("grads", "params"):
            assert got[part].keys() == expected[part].keys()
            for name, value in got[part].items():
                torch.testing.assert_close(value, expected[part][name], rtol=1e-6, atol=1e-7, msg=f"{part} {name}")
