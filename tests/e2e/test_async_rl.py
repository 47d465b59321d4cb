"""Disaggregated placement (trainer on one logical device, the engine on the other) and the overlapped rollout
modes, end to end on CPU: one-step-off's samples are exactly one version behind, async stays within its staleness
bound, learns, and resumes after SIGKILL without training a prompt twice."""

from __future__ import annotations

import json

import pytest

from mcore_rl import checkpoint
from mcore_rl.config.schema import load_run_config
from mcore_rl.driver import run
from mcore_rl.metrics import read_metrics
from tests.e2e.test_rl_run import (
    ROLES,
    engine_killing_reward,
    events,
    kill_at,
    run_to_end,
    train_command,
    write_config,
)

DISAGGREGATED = ["runtime_args.rollout_devices=1", *(f"{role}.parallel.tp=1" for role in ROLES)]


def _episodes(out) -> dict[int, dict]:
    """The last record of each training episode (a killed run's later episodes are logged again on resume)."""
    return {r["episode"]: r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r}


def _prompts(out, episode: int) -> set[str]:
    lines = (out / "rollouts" / f"episode_{episode}.jsonl").read_text().splitlines()
    return {json.loads(line)["id"].split("/")[0] for line in lines}


def test_one_step_off_trains_on_samples_exactly_one_version_behind(tiny_models, ray_address, tmp_path):
    path = write_config(tmp_path, tiny_models["Qwen3ForCausalLM"], "one_step_off")
    overrides = ["runtime_args.num_episode=3", "runtime_args.rollout_mode=one_step_off", *DISAGGREGATED]
    out = run(load_run_config(path, [*overrides, "runtime_args.eval_episode_interval=3"]))
    records = _episodes(out)
    assert sorted(records) == [1, 2, 3]
    first = records[1]  # the first episode's samples come from the weights it starts with: ratio 1, KL 0
    assert first["staleness/max"] == 0 and first["train/first_step_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["train/first_step_kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["train/rollout_logp_abs_diff"] < 1e-4
    for episode in (2, 3):
        assert records[episode]["staleness/lag_1_fraction"] == 1.0 and records[episode]["staleness/max"] == 1
        versions = {
            tuple(json.loads(line)["versions"]) for line in (out / "rollouts" / f"episode_{episode}.jsonl").open()
        }
        assert versions == {(episode - 2,)}
    for record in records.values():  # the engines on their own device get every sync, checked by the probe
        assert record["sync/probe_max_abs_diff"] < 1e-4 and record["sync/sync_bytes"] > 0
    # they never sleep, so they still hold the weights they loaded, which the trainer loaded too: none sent at first
    (initial,) = events(out, "initial_sync")
    assert initial["probe_max_abs_diff"] < 1e-4 and initial["sync_bytes"] == 0


def test_async_learns_within_its_staleness_bound_and_resumes_after_sigkill(tiny_models, ray_address, tmp_path):
    """The vowel task of the sync learning test, in async mode (partial rollout, max_staleness 1), killed after
    its first checkpoint and resumed by the same command; in the resumed run its one rollout engine is killed
    while it generates (at the first sample scored), replaced and loaded with the current weights from the
    producer's thread, and the run goes on."""
    path = write_config(tmp_path, tiny_models["LlamaForCausalLM"], "async")
    trigger = tmp_path / "kill_engine"
    reward = engine_killing_reward(tmp_path / "killing_reward.py", "async/policy-0", trigger)
    overrides = [
        f"models.reward.fn={reward}",
        "runtime_args.num_episode=15",
        "runtime_args.num_builtin_train=200",  # no prompt comes round twice: 15 x 8 are used
        "runtime_args.sample_per_episode=32",
        "runtime_args.eval_episode_interval=0",
        "runtime_args.save_episode_interval=5",
        "runtime_args.rollout_mode=async",
        "models.policy_trainer.algorithm.kl_coef=0",
        "models.policy_trainer.algorithm.algorithm=gspo",
        "models.policy_trainer.micro_batch_size=8",
        *DISAGGREGATED,
    ]
    command = train_command(path, overrides, ray_address)
    out = tmp_path / "runs" / "async"
    kill_at(command, out / "checkpoints" / "episode_5", tmp_path / "killed.log")
    assert checkpoint.latest_complete(out / "checkpoints")[0] == 5
    saved = checkpoint.read_meta(checkpoint.latest_complete(out / "checkpoints")[1])
    trigger.touch()
    run_to_end(command)
    (replaced,) = events(out, "engine_replaced")
    assert replaced["engine"] == 0 and replaced["episode"] == 6
    (resume,) = events(out, "resume")
    assert resume["data_position"] == saved["data_position"] and resume["optimizer"] == saved["optimizer"]

    records = _episodes(out)
    assert sorted(records) == list(range(1, 16))
    for record in records.values():
        assert record["staleness/max"] <= 1 and record["sync/probe_max_abs_diff"] < 1e-4
    # Out-of-order groups: the prompts trained before the kill are never trained again after it.
    before = set().union(*(_prompts(out, e) for e in range(1, 6)))
    after = [_prompts(out, e) for e in range(6, 16)]
    assert all(len(p) == 8 for p in after) and not before & set().union(*after)
    assert len(set().union(*after)) == 80
    rewards = [records[e]["reward/mean"] for e in range(1, 16)]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards
