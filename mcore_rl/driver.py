"""The RL driver behind ``python -m mcore_rl.train CONFIG.yaml [dotted.key=value ...]`` (:mod:`mcore_rl.train`).

One loop per ``runtime_args.rollout_mode``, each reading like the algorithm: generate -> reward -> reference/old
log-probs -> advantages -> train -> sync weights -> log/save. They share the episode's pieces and differ only in
what overlaps: ``sync`` runs them in turn; ``one_step_off`` generates the next episode's samples while this one
trains; ``async`` takes each episode's samples from engines that never stop generating. Each concern is an
object (:class:`~mcore_rl.roles.system.System` holds the roles, :class:`~mcore_rl.data.run_data.Data` the
prompts, the sampler (:mod:`mcore_rl.rollout.sampler`) makes and scores samples, :class:`Run` keeps the episode's
bookkeeping); re-running the same command resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import shutil
import threading
import time
from pathlib import Path

import yaml

from compat.ray import object_store_created_bytes
from converters.hf_io import copy_model_files
from mcore_rl import checkpoint
from mcore_rl.agent.trajectory import Trajectory
from mcore_rl.algorithms.ppo import explained_variance
from mcore_rl.batch import (
    add_advantages,
    fill_with_spares,
    filter_truncated,
    first_rows,
    partition_groups,
    reward_part_stats,
    rollout_stats,
    shape_overlong,
    staleness_stats,
    step_starts,
    training_batch,
)
from mcore_rl.config.loader import to_dict
from mcore_rl.config.schema import RunConfig
from mcore_rl.console import setup_driver
from mcore_rl.data.progress import DataProgress
from mcore_rl.data.run_data import Data
from mcore_rl.evaluation import accuracy_metrics, eval_table
from mcore_rl.loggers import flat_params
from mcore_rl.metrics import MetricsLogger, plot_curves
from mcore_rl.preflight import check_inputs
from mcore_rl.roles.system import System, connect_ray, engines_hold_loaded_weights
from mcore_rl.rollout.sampler import make_sampler
from mcore_rl.watchdog import Watchdog

log = logging.getLogger("mcore_rl")

# Dynamic sampling's refills per episode; a batch still short after them is filled with constant-reward groups.
REFILL_ROUNDS = 3


def save_resolved_config(config: RunConfig, out: Path) -> None:
    """``config.yaml`` in the output dir; a resumed run with different settings adds ``config.<n>.yaml``."""
    text = yaml.safe_dump(to_dict(config), sort_keys=False)
    path, n = out / "config.yaml", 1
    while path.exists() and path.read_text() != text:
        path, n = out / f"config.{n}.yaml", n + 1
    path.write_text(text)


class Timer:
    """Seconds of each phase of an episode (``time/<name>``): ``with timer("train"): ...``; the hang watchdog
    watches each phase while it runs. Also the bytes the episode put through Ray's object store."""

    def __init__(self, watchdog: Watchdog, episode: int):
        self.watchdog, self.episode = watchdog, episode
        self.metrics: dict[str, float] = {}
        self.start, self.stored = time.perf_counter(), object_store_created_bytes()

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        with self.watchdog.phase(name, self.episode):
            yield
        self.metrics[f"time/{name}"] = self.metrics.get(f"time/{name}", 0.0) + time.perf_counter() - start

    def throughput(self, metrics: dict) -> dict:
        """The phases' times, the episode's and its response tokens per second."""
        seconds = time.perf_counter() - self.start
        return self.metrics | {
            "time/episode": seconds,
            "throughput/response_tokens_per_s": metrics["batch/response_tokens"] / seconds,
            "throughput/object_store_bytes": object_store_created_bytes() - self.stored,
        }


class Run:
    """What every loop shares: the roles, the data and its progress, the logger, and the episode's end (log,
    samples, eval, checkpoint)."""

    def __init__(self, config: RunConfig, data: Data, system: System, logger: MetricsLogger, progress: DataProgress,
                 watchdog: Watchdog):  # fmt: skip
        self.config, self.data, self.system, self.logger, self.progress = config, data, system, logger, progress
        self.watchdog = watchdog
        self.sampler = make_sampler(system, data.tokenizer)
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

    def evaluate(self, episode: int) -> dict[str, float]:
        """Each eval set's numbers (the main set's under ``eval/``, the others' under ``eval/<name>/``), logged with
        their table."""
        metrics = {}
        for name, prompts in self.data.eval.items():
            start = time.perf_counter()
            found = self._evaluate(prompts.prompts) | {"time_s": time.perf_counter() - start}
            metrics |= {(f"eval/{name}/" if name else "eval/") + key: value for key, value in found.items()}
        log.info("%s", eval_table(episode, metrics, list(self.data.eval)))
        return metrics

    def _evaluate(self, prompts) -> dict[str, float]:
        """Eval-sampling completions of ``prompts`` (``models.policy.rollout.eval.n`` each): ``accuracy`` (mean@n),
        the fraction whose ``models.reward.fn`` reward is positive (of the weighted sum without one), ``pass_at_<k>``,
        and each weighted reward's mean."""
        sampling = self.config.models.policy.rollout.eval
        samples, rewards = self.sampler.generate(prompts, sampling)
        # the eval's reward numbers (its judge's failures); its waits and trajectory statistics are no episode's
        parts = {k: v for k, v in self.sampler.take_metrics(samples).items() if k.startswith("reward/")}
        return (
            parts
            | reward_part_stats(samples)
            | accuracy_metrics(self.sampler.solved(samples, rewards), sampling.n)
            | {"reward_mean": sum(rewards) / len(rewards)}
        )

    def end_episode(self, episode: int, samples, rewards, metrics: dict) -> None:
        rt = self.config.runtime_args
        metrics |= rollout_stats(samples, rewards, self.config.models.policy.num_inference_per_prompt)
        metrics |= self.sampler.take_metrics(samples)
        if self.config.models.policy.rollout.speculative_tokens:  # drafts since the last episode (evals included)
            drafts = self.system.rollout.take_speculative_stats()
            metrics["rollout/draft_tokens"] = drafts["draft_tokens"]
            metrics["rollout/draft_acceptance"] = drafts["accepted_tokens"] / max(drafts["draft_tokens"], 1.0)
        replaced = self.system.rollout.take_replacements()
        for record in replaced:
            self.logger.event("engine_replaced", episode=episode, **record)
        metrics["rollout/engine_replacements"] = float(len(replaced))
        metrics |= process_metrics(self.system) | {"data/position": self.progress.position}
        self.logger.log(episode, metrics)
        write_samples(self.out / "rollouts" / f"episode_{episode}.jsonl", samples, rewards)
        if rt.eval_episode_interval and (episode % rt.eval_episode_interval == 0 or episode == rt.num_episode):
            with self.watchdog.phase("eval", episode):
                self.logger.log(episode, self.evaluate(episode), advance=False)
        if rt.save_episode_interval and (episode % rt.save_episode_interval == 0 or episode == rt.num_episode):
            with self.watchdog.phase("save", episode):
                self.save(episode)

    def save(self, episode: int) -> None:
        system, root = self.system, self.out / "checkpoints"
        start = time.perf_counter()
        try:
            partial = checkpoint.partial_dir(root, episode)
            meta = self.progress.meta()
            for key, role in system.trained_roles():
                with system.on_device(role):
                    role.save(str(partial), self.config.runtime_args.save_reshardable)
                    meta[key] = role.optimizer_digest()
            copy_model_files(self.config.models.policy_trainer.load, partial, skip=(checkpoint.MARKER,))
            path = checkpoint.commit(root, episode, meta)
        except Exception as err:  # noqa: BLE001 - a full disk reaches here as OSError or wrapped by Ray
            free = shutil.disk_usage(root).free  # before the partial directory goes: what the save left
            checkpoint.abandon(root, episode)
            kept = ", ".join(p.name for _, p in checkpoint.complete(root, report=False)) or "none"
            raise checkpoint.CheckpointError(
                f"saving the checkpoint of episode {episode} under {root} failed ({_last_line(err)}; "
                f"{free / 2**20:.1f} MiB were left free on its file system); the run stopped, and the complete "
                f"checkpoints are as they were ({kept}): free space and run the same command to resume"
            ) from err
        self.logger.event("checkpoint", path=str(path), seconds=round(time.perf_counter() - start, 2), **meta)
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
    samples, _ = fill_with_spares(kept, spare, need)  # after the refill rounds, constant groups fill the batch
    rewards, _ = fill_with_spares(kept_rewards, spare_rewards, need)
    return samples, rewards, positions


def learn(run: Run, samples, rewards, version: int, timer: Timer, before_sync=None) -> dict:
    """Reference, teacher and old log-probs, values -> advantages -> critic and policy steps -> ``before_sync()``
    (what the mode waits for before the weights change) -> the weights into the engines as policy ``version``,
    checked by the probe."""
    system, m = run.system, run.config.models
    rewards, metrics = shape_overlong(samples, rewards, m.policy_trainer, m.policy.rollout.train.max_new_tokens)
    batch = training_batch(samples, rewards)
    if m.policy_trainer.overlong_filter:
        metrics |= filter_truncated(batch, samples)
    with system.on_device(system.trainer, ["weights"]) as weights:  # the sync needs no optimizer state
        with timer("ref_logprobs"):
            score_references(run, batch)
        with timer("old_logprobs"):
            score_old(run, batch)
        if system.critic is not None:
            with timer("critic"), system.on_device(system.critic):
                batch["values"] = system.critic.values(scored(batch), m.critic.micro_batch_size) * batch["mask"]
        metrics |= add_advantages(batch, m.policy_trainer, m.policy.num_inference_per_prompt)
        if system.critic is not None:
            with timer("critic"), system.on_device(system.critic):
                steps = system.critic.train(
                    batch, run.config.runtime_args.train_global_batch_size, m.critic.micro_batch_size
                )
                metrics |= critic_metrics(steps, batch)
        trains = system.critic is None or version > m.critic.warmup_episodes  # the critic's warm-up: it alone
        if trains:
            with timer("train"), system.updating(version):
                metrics |= train_policy(run, batch)
        if before_sync is not None:
            with timer("wait_for_rollout"):
                before_sync()
        with timer("sync"):
            system.push_weights(version)
    with timer("sync"):
        sync = system.verify_sync()  # the engines' KV caches return after the trainer's weights left
    if trains:
        metrics["memory/trainer_offloaded_bytes"] += weights.offloaded
    return metrics | {f"sync/{k}": v for k, v in sync.items()} | batch_sizes(batch, m.policy.num_inference_per_prompt)


# What scoring reads of a batch (the rest stays here): the rows, their lengths, and the rollout's routing.
SCORED = ("tokens", "lengths", "prompt_lengths", "routed_experts")


def scored(batch: dict, first: int = 0) -> dict:
    """The part of ``batch`` a scoring call sends to the ranks, from row ``first`` on."""
    return {k: v[first:] for k, v in batch.items() if k in SCORED}


def score_references(run: Run, batch: dict) -> None:
    """The reference's and the teacher's log-probs where the run uses them (``ref_logp``, ``teacher_logp``)."""
    system, m = run.system, run.config.models
    for role, key, section in ((system.ref, "ref_logp", m.ref_policy), (system.teacher, "teacher_logp", m.teacher)):
        if role is not None:
            with system.on_device(role):
                batch[key] = role.logprobs(scored(batch), section.micro_batch_size)
    if m.needs_reference and m.policy_trainer.lora.rank:  # the reference is the trainer's model without adapters
        batch["ref_logp"] = system.trainer.base_logprobs(scored(batch), m.policy_trainer.micro_batch_size)


def score_old(run: Run, batch: dict) -> None:
    """The policy's log-probs before its steps, kept on its ranks for its steps: the first step's rows score their
    own, unless the advantages read them (``old_logp``) before any step."""
    trainer = run.config.models.policy_trainer
    reads = bool(trainer.reward_kl_coef or trainer.distill_coef)
    starts = step_starts(batch, run.config.runtime_args.train_global_batch_size) + [batch["tokens"].shape[0]]
    first = 0 if reads else starts[1]
    old = run.system.trainer.score_old(scored(batch, first), trainer.micro_batch_size, fetch=reads)
    if reads:
        batch["old_logp"] = old


def train_policy(run: Run, batch: dict) -> dict[str, float]:
    """The policy's optimizer steps on the batch; ``train/*`` (means over the steps), router and memory metrics."""
    system, trainer = run.system, run.config.models.policy_trainer
    with system.on_device(system.trainer, ["optimizer"]) as optimizer:
        sent = {k: v for k, v in batch.items() if k != "old_logp"}  # the ranks kept theirs
        steps = system.trainer.train(sent, run.config.runtime_args.train_global_batch_size, trainer.micro_batch_size)
        memory = system.trainer.memory_bytes()
    metrics = {f"train/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]}
    metrics |= {f"train/first_step_{k}": steps[0][k] for k in ("ratio_mean", "kl") if k in steps[0]}
    return (
        metrics
        | system.trainer.router_metrics()
        | {
            "memory/trainer_bytes": memory,
            "memory/trainer_offloaded_bytes": optimizer.offloaded,  # the weights' are added once they have left
        }
    )


def batch_sizes(batch: dict, n: int) -> dict[str, float]:
    """Tokens trained on: all, the response tokens, and all with each group's shared prompt counted once; the
    rows per sample (a multi-turn trajectory whose history was rewritten is several)."""
    tokens, prompts, first = float(batch["mask"].sum()), batch["prompt_lengths"], first_rows(batch)
    return {
        "batch/tokens": float(batch["lengths"].sum()),
        "batch/response_tokens": tokens,
        "batch/tokens_prompts_once": tokens + float(prompts[first][::n].sum() + prompts[~first].sum()),
        "batch/rows_per_sample": len(first) / float(first.sum()),
    }


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
        timer = Timer(run.watchdog, episode)
        with timer("rollout_and_reward"):
            samples, rewards, positions = rollout_phase(run)
        with timer("sleep_engines"):
            freed = run.system.sleep_engines()
        metrics = learn(run, samples, rewards, episode, timer)
        run.consume(positions)
        metrics |= staleness_stats(samples, episode - 1) | {"memory/engine_freed_bytes": freed}
        run.end_episode(episode, samples, rewards, metrics | timer.throughput(metrics))


def one_step_off_loop(run: Run, start: int) -> None:
    """The next episode's rollout runs while this one trains, with the weights before this episode's update: the
    samples trained on are exactly one policy version behind (the first episode's are current)."""
    last = run.config.runtime_args.num_episode
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout") as pool:
        generating = pool.submit(rollout_phase, run)
        for episode in range(start + 1, last + 1):
            timer = Timer(run.watchdog, episode)
            with timer("wait_for_rollout"):
                samples, rewards, positions = generating.result()
            generating = pool.submit(rollout_phase, run) if episode < last else None  # beside the training below
            # The weights change between whole batches only.
            metrics = learn(run, samples, rewards, episode, timer, generating and generating.exception)
            run.consume(positions)
            metrics |= staleness_stats(samples, episode - 1)
            run.end_episode(episode, samples, rewards, metrics | timer.throughput(metrics))


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
            timer = Timer(run.watchdog, episode)
            with timer("wait_for_rollout"):
                groups, stale, spares = buffer.take(need, version=episode - 1)
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
            run.end_episode(episode, samples, rewards, metrics | timer.throughput(metrics))
    finally:
        producer.stop()


LOOPS = {"sync": sync_loop, "one_step_off": one_step_off_loop, "async": async_loop}


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
    import ray

    rt = config.runtime_args
    # Missing or truncated weights, tokenizers the roles cannot share, bad data, or a reward function that returns no
    # number: stopped before any write, while Ray starts (seconds of waiting for its processes).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        checked = pool.submit(check_inputs, config)
        started_ray = connect_ray(config)
        try:
            data = checked.result()
        except BaseException:
            if started_ray:
                ray.shutdown()
            raise
    out = Path(rt.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_resolved_config(config, out)
    ckpt_root = out / "checkpoints"
    system = System(config, started_ray)
    log_file = setup_driver(out / "logs")
    watchdog = Watchdog(rt.watchdog, out / "logs")
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
            with watchdog.phase("initial_sync", start):
                # the engines loaded the HF weights: the trainer's are sent unless they are those (a resume's never
                # are); the probe checks both
                system.push_weights(start, send=bool(found) or not engines_hold_loaded_weights(config, system.machine))
        with watchdog.phase("initial_sync", start):
            logger.event("initial_sync", **system.verify_sync())
        job = Run(config, data, system, logger, progress, watchdog)
        if rt.eval_episode_interval and not found:
            with watchdog.phase("eval", 0):
                logger.log(0, job.evaluate(0), advance=False)
        LOOPS[rt.rollout_mode](job, start)
    except Exception as err:
        watchdog.raise_if_stopped(err)
        raise
    finally:
        watchdog.close()
        if logger is not None:
            logger.close()
        system.close()
        logging.getLogger().removeHandler(log_file)
    png = plot_curves(out / "metrics.jsonl", out / "curves.png")
    log.info("metrics: %s ; curves: %s", out / "metrics.jsonl", png)
    return out


def process_metrics(system: System) -> dict[str, float]:
    """Threads and resident memory of the busiest trainer rank and rollout engine (``process/*``)."""
    out = {}
    for role, stats in (("trainer", system.trainer.process_stats()), ("engine", system.rollout.process_stats())):
        out |= {f"process/{role}_{key}": max(s[key] for s in stats) for key in stats[0]} if stats else {}
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
                if s.completion.segments:  # training samples, where the template rewrote the history
                    record["segments"] = 1 + len(s.completion.segments)
            f.write(json.dumps(record) + "\n")
