"""The distributed optimizer's state in a checkpoint: per rank by default (every rank writes its own shards at once,
loadable under the same layout only, which a load checks by name), or gathered per parameter
(``runtime_args.save_reshardable``: loadable under any layout), which is also what checkpoints written before the
choice hold."""

import pytest

from tests.distributed import cases


def _resume(ranks, hf_dir, tmp_path, save, layout, resume_layout):
    tmp_path.mkdir(exist_ok=True)
    straight = ranks.run(cases.policy_resume, hf_dir=hf_dir, layout=layout, checkpoint_dir=str(tmp_path), save=save)
    resumed = ranks.run(cases.policy_resume, hf_dir=hf_dir, layout=resume_layout, checkpoint_dir=str(tmp_path))
    return straight[0], resumed[0]


def test_a_per_rank_checkpoint_resumes_exactly_and_another_layout_is_refused_by_name(ranks, tiny_models, tmp_path):
    hf_dir = tiny_models["Qwen3ForCausalLM"]
    straight, resumed = _resume(ranks, hf_dir, tmp_path, "per_rank", dict(tp=2), dict(tp=2))
    assert resumed == straight  # the step after the load and Adam's state after it: bit for bit
    with pytest.raises(
        RuntimeError,
        match=r"saved per rank under the layout \{'tp': 2, 'pp': 1, .*'dp': 2.*"
        r"this run's is \{'tp': 1, 'pp': 2, .*'dp': 2.*runtime_args.save_reshardable=true",
    ):
        ranks.run(cases.policy_resume, hf_dir=hf_dir, layout=dict(pp=2), checkpoint_dir=str(tmp_path))


@pytest.mark.parametrize("save", ["reshardable", "legacy"])
def test_a_gathered_checkpoint_resumes_under_another_layout(ranks, tiny_models, tmp_path, save):
    """Saved under TP 2, resumed under PP 2: the step after the load equals the uninterrupted run's, and Adam's
    state after it that of a run under PP 2 throughout (the digest sums over ranks, so it is compared under one
    layout); fp32 rounding of the two layouts apart."""
    hf_dir = tiny_models["Qwen3ForCausalLM"]
    straight, resumed = _resume(ranks, hf_dir, tmp_path / "saved", save, dict(tp=2), dict(pp=2))
    under_pp = ranks.run(
        cases.policy_resume, hf_dir=hf_dir, layout=dict(pp=2), checkpoint_dir=str(tmp_path), save="per_rank"
    )[0]
    assert resumed["step"] == pytest.approx(straight["step"], rel=1e-5, abs=1e-6)
    # the signed first moments' sum cancels to about 0.1: the layouts' rounding shows as about 4e-6 absolute there
    assert resumed["digest"] == pytest.approx(under_pp["digest"], rel=1e-5, abs=2e-5)
