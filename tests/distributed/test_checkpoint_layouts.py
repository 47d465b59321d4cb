"""The distributed optimizer's state in a checkpoint: per rank by default (every rank writes its own shards at once,
loadable under the same layout only, which a load checks by name), or gathered per parameter
(``runtime_args.save_reshardable``: loadable under any layout), which is also what checkpoints written before the
choice hold."""

import shutil

import pytest

from mcore_rl import checkpoint
from mcore_rl.config.loader import ConfigError
from mcore_rl.config.schema import load_run_config
from mcore_rl.preflight import check_resume
from tests.distributed import cases


def _resume(ranks, hf_dir, tmp_path, save, layout, resume_layout):
    tmp_path.mkdir(exist_ok=True)
    straight = ranks.run(cases.policy_resume, hf_dir=hf_dir, layout=layout, checkpoint_dir=str(tmp_path), save=save)
    resumed = ranks.run(cases.policy_resume, hf_dir=hf_dir, layout=resume_layout, checkpoint_dir=str(tmp_path))
    return straight[0], resumed[0]


def _run_with(tmp_path, hf_dir, saved, layout: str):
    """A run on 4 devices whose directory holds ``saved`` (a role checkpoint directory) as its episode-1 checkpoint,
    its trainer at ``layout`` (YAML)."""
    out = tmp_path / "run"
    shutil.copytree(saved / "policy", checkpoint.partial_dir(out / "checkpoints", 1) / "policy")
    checkpoint.commit(out / "checkpoints", 1, {})
    path = tmp_path / "run.yaml"
    path.write_text(
        f"runtime_args:\n  output_dir: {out}\n  num_devices: 4\n  sample_per_episode: 16\n"
        f"  train_global_batch_size: 8\nmodels:\n  policy_trainer:\n    load: {hf_dir}\n    parallel: {layout}\n"
        "  policy:\n    num_inference_per_prompt: 4\n"
    )
    return load_run_config(path)


def test_a_per_rank_checkpoint_resumes_exactly_and_another_layout_is_refused_by_name(ranks, tiny_models, tmp_path):
    """Resumed under its layout: the step after the load and Adam's state after it equal the uninterrupted run's bit
    for bit. Under another: the load names both layouts and the key, and so does the run's preflight, before any
    role starts."""
    hf_dir = tiny_models["Qwen3ForCausalLM"]
    saved = tmp_path / "saved"
    straight, resumed = _resume(ranks, hf_dir, saved, "per_rank", dict(tp=2), dict(tp=2))
    assert resumed == straight
    check_resume(_run_with(tmp_path / "same", hf_dir, saved, "{tp: 2}"))
    with pytest.raises(
        ConfigError,
        match=r"runtime_args.output_dir: no checkpoint there loads under this run's "
        r"layout: .*episode_1/policy: .*'dp': 2.*this run's is \{'tp': 1, 'pp': 2",
    ):
        check_resume(_run_with(tmp_path / "other", hf_dir, saved, "{pp: 2}"))
    with pytest.raises(
        RuntimeError,
        match=r"saved per rank under the layout \{'tp': 2, 'pp': 1, .*'dp': 2.*"
        r"this run's is \{'tp': 1, 'pp': 2, .*'dp': 2.*runtime_args.save_reshardable=true",
    ):
        ranks.run(cases.policy_resume, hf_dir=hf_dir, layout=dict(pp=2), checkpoint_dir=str(saved))


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
    # The two layouts' gradients round apart, and Adam's moments with them: the magnitudes' sums by 1.5e-5 of
    # themselves on an AMD EPYC's GEMMs; the signed first moments' sum, which cancels to about 0.1 of 42, by 6e-5,
    # 1.4e-6 of the magnitudes it is relative to (4e-6 on the Intel hosts)
    digest, expected = resumed["digest"], under_pp["digest"]
    assert {k: v for k, v in digest.items() if k != "exp_avg"} == pytest.approx(
        {k: v for k, v in expected.items() if k != "exp_avg"}, rel=5e-5
    )
    assert digest["exp_avg"] == pytest.approx(expected["exp_avg"], abs=1e-5 * expected["exp_avg_abs"])
