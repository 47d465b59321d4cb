"""What makes a run's configuration valid beyond each field's type: counts and batch sizes, device placement and
layouts, the loss and its estimator, rewards and judges, multi-turn limits, data files; the model directories' checks
are :mod:`mcore_rl.config.model_checks`. Each error names the key and says how to fix it. The schema
(:mod:`mcore_rl.config.schema`) says what a run is, these modules what a runnable one is."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_rl.agent.envs import BUILTIN_ENVS
from mcore_rl.agent.sandbox import Sandbox, SandboxUnavailableError
from mcore_rl.agent.tools import BUILTIN_TOOLS
from mcore_rl.algorithms.advantages import ESTIMATORS, TOKEN_ESTIMATORS
from mcore_rl.config import model_checks
from mcore_rl.config.loader import ConfigError, check_bounds
from mcore_rl.data.arithmetic import BUILTIN_SPLITS
from mcore_rl.rewards.judge import PARSERS, JudgeError, load_template
from mcore_rl.userfile import is_user_file

if TYPE_CHECKING:
    from mcore_rl.config.schema import RunConfig


def validate(config: RunConfig) -> None:
    """Each section's checks, in an order where a later one may rely on an earlier."""
    _counts(config)
    _reward_terms(config)
    if config.models.reward.multi_turn:
        _multi_turn(config)
    _packing(config)
    _placement(config)
    _layouts(config)
    _training(config)
    model_checks.models(config)
    model_checks.lora(config)
    model_checks.roles(config)
    _data(config)


def _counts(config: RunConfig) -> None:
    """Counts, batch divisibility, keys set by others, lengths."""
    rt, m = config.runtime_args, config.models
    rt.log.validate()
    rt.watchdog.validate()
    positive = {
        "runtime_args.num_episode": rt.num_episode,
        "runtime_args.sample_per_episode": rt.sample_per_episode,
        "runtime_args.train_global_batch_size": rt.train_global_batch_size,
        "runtime_args.num_devices": rt.num_devices,
        "models.policy_trainer.micro_batch_size": m.policy_trainer.micro_batch_size,
        "models.policy.num_inference_per_prompt": m.policy.num_inference_per_prompt,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value}: expected at least 1")
    n = m.policy.num_inference_per_prompt
    if rt.sample_per_episode % n:
        raise ConfigError(
            f"runtime_args.sample_per_episode={rt.sample_per_episode} is not a multiple of "
            f"models.policy.num_inference_per_prompt={n}: whole prompt groups are sampled"
        )
    if rt.sample_per_episode % rt.train_global_batch_size:
        raise ConfigError(
            f"runtime_args.sample_per_episode={rt.sample_per_episode} is not a multiple of "
            f"runtime_args.train_global_batch_size={rt.train_global_batch_size}"
        )
    if m.policy.rollout.return_routed_experts:
        raise ConfigError(
            "models.policy.rollout.return_routed_experts: set by models.policy_trainer.moe.routing_replay; "
            "remove it (set routing_replay: true to replay the rollout's routing)"
        )
    if m.policy.rollout.lora_rank:
        raise ConfigError(
            "models.policy.rollout.lora_rank: set from models.policy_trainer.lora.rank when "
            "models.policy.sync.lora is 'adapter'; remove it"
        )
    train = m.policy.rollout.train
    if train.n not in (1, n):
        raise ConfigError(
            f"models.policy.rollout.train.n={train.n}: samples per prompt are set by "
            f"models.policy.num_inference_per_prompt={n}; remove rollout.train.n"
        )
    longest = m.policy.max_prompt_tokens + max(train.max_new_tokens, m.policy.rollout.eval.max_new_tokens)
    if longest > m.policy.rollout.max_model_len:
        raise ConfigError(
            f"models.policy.max_prompt_tokens + max_new_tokens = {longest} exceeds "
            f"models.policy.rollout.max_model_len={m.policy.rollout.max_model_len}; raise it or shorten either"
        )
    check_bounds("models.reward", m.reward, ("timeout_s",), 0, "a positive number of seconds", strict=True)


def _packing(config: RunConfig) -> None:
    """Packing budgets that hold the longest sample."""
    m = config.models
    what = "a multi-turn trajectory's max_total_tokens" if m.reward.multi_turn else "max_prompt_tokens + max_new_tokens"
    for role in m.checked_roles:
        packing = getattr(m, role).max_token_in_packing
        if packing and packing < config.longest_sample:
            raise ConfigError(
                f"models.{role}.max_token_in_packing={packing} is below the longest sample ({config.longest_sample} "
                f"tokens: {what}); raise it, or set 0 for padded micro-batches"
            )


def _training(config: RunConfig) -> None:
    """Recompute, memory, the LR schedule, the loss, the estimator and its shaping, the engines' settings."""
    rt, m = config.runtime_args, config.models
    check_bounds("runtime_args", rt, ("device_memory_gb",), 0, ">= 0 (0: detect)")
    m.policy_trainer.algorithm.validate("models.policy_trainer.algorithm")
    _estimator(config)
    _overlong(config)
    if m.policy_trainer.advantage_estimator == "rloo" and m.policy.num_inference_per_prompt < 2:
        raise ConfigError(
            "models.policy_trainer.advantage_estimator='rloo' needs models.policy.num_inference_per_prompt >= 2 "
            "(the baseline is the other samples of the prompt)"
        )
    m.policy.rollout.validate("models.policy.rollout")
    m.policy.sync.validate("models.policy.sync")


def _data(config: RunConfig) -> None:
    """The train and eval data files."""
    rt = config.runtime_args
    paths = {"runtime_args.data_path": rt.data_path, "runtime_args.eval_data_path": rt.eval_data_path}
    for name, path in rt.eval_sets.items():
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ConfigError(f"runtime_args.eval_sets.{name}: name a set with letters, digits, '_', '.' or '-'")
        paths[f"runtime_args.eval_sets.{name}"] = path
    for key, path in paths.items():
        if path not in BUILTIN_SPLITS and not Path(path).is_file():
            raise ConfigError(f"{key}={path!r}: file not found (or use one of {list(BUILTIN_SPLITS)})")


def _placement(config: RunConfig) -> None:
    rt, m = config.runtime_args, config.models
    pools = {"rollout_devices": rt.rollout_devices, "reward_model_devices": rt.reward_model_devices}
    pools["judge_devices"] = rt.judge_devices
    if min(pools.values()) < 0 or rt.trainer_devices < 1:
        given = ", ".join(f"{k}={v}" for k, v in pools.items() if v)
        raise ConfigError(
            f"runtime_args.{given}: expected 0 (shared) or more, leaving the trainer at least one of "
            f"num_devices={rt.num_devices}"
        )
    for key, role, what in (
        ("reward_model_devices", "reward_model", "models.reward_model.load"),
        ("judge_devices", "judge", "models.judge.load (a model directory)"),
    ):
        if pools[key] and not (m.uses(role) if role == "reward_model" else m.judge.load):
            raise ConfigError(f"runtime_args.{key}={pools[key]}: devices for a role the run has not; set {what}")
    if rt.rollout_mode != "sync" and rt.colocated:
        raise ConfigError(
            f"runtime_args.rollout_mode={rt.rollout_mode!r} overlaps rollout with training, which colocated roles "
            "cannot (they take turns on every device); give the engines devices of their own with "
            "runtime_args.rollout_devices > 0, or set rollout_mode: sync"
        )
    if rt.max_engine_replacements < 0:
        raise ConfigError(
            f"runtime_args.max_engine_replacements={rt.max_engine_replacements}: expected 0 (a dead engine stops "
            "the run) or more"
        )
    if rt.rollout_mode == "async" and rt.max_staleness < 1:
        raise ConfigError(
            f"runtime_args.max_staleness={rt.max_staleness}: async rollout needs at least 1 (samples generated "
            "while the trainer trains are a version behind); for on-policy batches use rollout_mode: sync"
        )
    if rt.rollout_mode == "async" and m.policy_trainer.moe.routing_replay and rt.partial_rollout:
        raise ConfigError(
            "runtime_args.partial_rollout: a partial rollout recomputes its context with new weights, so the "
            "routing of its earlier tokens is not the routing that sampled them; set partial_rollout: false "
            "or models.policy_trainer.moe.routing_replay: false"
        )


def _estimator(config: RunConfig) -> None:
    m, prefix = config.models, "models.policy_trainer"
    trainer = m.policy_trainer
    estimator = trainer.advantage_estimator
    known = sorted(ESTIMATORS) + list(TOKEN_ESTIMATORS) + ["none"]
    if estimator not in known:
        raise ConfigError(f"{prefix}.advantage_estimator={estimator!r}: expected one of {known}")
    if estimator == "rloo" and m.policy.num_inference_per_prompt < 2:
        raise ConfigError(
            f"{prefix}.advantage_estimator='rloo' needs models.policy.num_inference_per_prompt >= 2 (the "
            "baseline is the other samples of the prompt)"
        )
    check_bounds(prefix, trainer, ("reward_kl_coef", "distill_coef"), 0, ">= 0 (0: off)")
    for key in ("gamma", "lam"):
        if not 0 <= getattr(trainer, key) <= 1:
            raise ConfigError(f"{prefix}.{key}={getattr(trainer, key)}: expected a number in [0, 1]")
    if trainer.reward_kl_coef and estimator not in TOKEN_ESTIMATORS:
        raise ConfigError(
            f"{prefix}.reward_kl_coef={trainer.reward_kl_coef}: a KL penalty in the per-token reward needs a "
            f"per-token estimator ({list(TOKEN_ESTIMATORS)}); with {estimator!r} use "
            f"{prefix}.algorithm.kl_coef (a KL term in the loss) instead"
        )
    if (estimator == "gae") != bool(m.critic.load):
        raise ConfigError(
            f"{prefix}.advantage_estimator='gae' needs PPO's critic: set models.critic.load to the policy's HF "
            "directory (the value model starts from it)"
            if estimator == "gae"
            else f"models.critic.load={m.critic.load!r}: only {prefix}.advantage_estimator='gae' uses a critic; "
            "set the estimator to gae or remove models.critic"
        )
    if bool(trainer.distill_coef) != bool(m.teacher.load):
        raise ConfigError(
            f"{prefix}.distill_coef={trainer.distill_coef} needs a teacher: set models.teacher.load to its HF directory"
            if trainer.distill_coef
            else f"models.teacher.load={m.teacher.load!r}: the teacher is used by on-policy distillation only; "
            f"set {prefix}.distill_coef > 0 or remove models.teacher"
        )
    if estimator == "none" and not trainer.distill_coef:
        raise ConfigError(
            f"{prefix}.advantage_estimator='none' trains on the teacher's signal alone: set "
            f"{prefix}.distill_coef > 0 and models.teacher.load, or choose an estimator"
        )
    critic = m.critic
    if critic.load:
        if critic.value_clip < 0 or critic.micro_batch_size < 1:
            raise ConfigError("models.critic.value_clip: expected >= 0; models.critic.micro_batch_size: >= 1")
        if not 0 <= critic.warmup_episodes < config.runtime_args.num_episode:
            raise ConfigError(
                f"models.critic.warmup_episodes={critic.warmup_episodes}: expected 0 up to runtime_args."
                f"num_episode - 1 = {config.runtime_args.num_episode - 1} (the policy trains after them)"
            )


def _reward_terms(config: RunConfig) -> None:
    reward = config.models.reward
    if reward.terms and reward.multi_turn:
        raise ConfigError(
            "models.reward.terms: weighted rewards score single-turn samples; a multi-turn run's reward is its "
            "environment's (models.reward.env, with models.reward.fn); remove the terms"
        )
    model = config.models.reward_model
    if model.load and reward.multi_turn:
        raise ConfigError(
            "models.reward_model: a reward model scores single-turn samples; a multi-turn run's reward is its "
            "environment's (models.reward.env, with models.reward.fn); remove it"
        )
    judge = config.models.judge
    if not reward.fn and not reward.terms and not model.load and not judge.load:
        raise ConfigError(
            "models.reward.fn is empty, and neither models.reward.terms, models.reward_model nor models.judge is "
            "given: give a reward"
        )
    if not reward.terms and not model.load and not judge.load and reward.weight != 1.0:
        raise ConfigError(
            f"models.reward.weight={reward.weight}: weighs models.reward.fn in a sum with models.reward.terms; "
            "with fn alone it changes nothing but the scale (set it in the function), so remove it"
        )
    seen = {}
    for key, term in reward.weighted_terms:
        where = key.rsplit(".", 1)[0]
        if not term.fn:
            raise ConfigError(f"{key}: no reward function; expected 'math' or path/to/file.py[:function]")
        if not term.name:
            raise ConfigError(f"{where}.name: empty; name the reward (its metrics are reward/<name>/mean)")
        if not math.isfinite(term.weight):
            raise ConfigError(f"{where}.weight={term.weight}: expected a finite number")
        if term.name in seen:
            raise ConfigError(
                f"{where}.name={term.name!r} is also {seen[term.name]}'s name; give each reward its own "
                "(reward/<name>/mean would mix them)"
            )
        seen[term.name] = where
    if model.load:
        if model.name in seen:
            raise ConfigError(
                f"models.reward_model.name={model.name!r} is also {seen[model.name]}'s name; give each reward its own"
            )
        if not math.isfinite(model.weight):
            raise ConfigError(f"models.reward_model.weight={model.weight}: expected a finite number")
        if model.micro_batch_size < 1:
            raise ConfigError(f"models.reward_model.micro_batch_size={model.micro_batch_size}: expected >= 1")
        seen[model.name] = "models.reward_model"
    if judge.load:
        _judge(config, seen)


def _judge(config: RunConfig, names: dict[str, str]) -> None:
    judge, rt = config.models.judge, config.runtime_args
    if config.models.reward.multi_turn:
        raise ConfigError("models.judge: a judge grades single-turn responses; remove it from a multi-turn run")
    if not judge.own_engines:
        if rt.rollout_mode == "async":
            raise ConfigError(
                "models.judge.load='policy' with runtime_args.rollout_mode='async': the engines' weights change "
                "while groups are judged; give the judge engines of its own (load a model directory) or use "
                "rollout_mode sync or one_step_off"
            )
        if changed := ["runtime_args.judge_devices"] * bool(rt.judge_devices) + [
            f"models.judge.{k}" for k in judge.ENGINE_KEYS if getattr(judge, k) != getattr(type(judge), k)
        ]:
            raise ConfigError(
                f"{', '.join(changed)}: size a judge's own engines, but models.judge.load='policy' judges on the "
                "policy's engines; remove them, or load the judge from a model directory"
            )
    if judge.name in names:
        raise ConfigError(f"models.judge.name={judge.name!r} is also {names[judge.name]}'s name; give it its own")
    if judge.parser not in PARSERS and not is_user_file(judge.parser):
        raise ConfigError(
            f"models.judge.parser={judge.parser!r}: expected one of {sorted(PARSERS)} or an existing "
            "path/to/file.py:function"
        )
    if not math.isfinite(judge.weight) or judge.timeout_s <= 0 or judge.max_new_tokens < 1:
        raise ConfigError(
            "models.judge: expected a finite weight, timeout_s > 0 and max_new_tokens >= 1 (got "
            f"{judge.weight}, {judge.timeout_s}, {judge.max_new_tokens})"
        )
    try:
        load_template(judge.template)
    except JudgeError as err:
        raise ConfigError(str(err)) from None
    if judge.own_engines:
        if not 0 < judge.gpu_memory_utilization < 1 or judge.max_new_tokens >= judge.max_model_len:
            raise ConfigError(
                f"models.judge: expected 0 < gpu_memory_utilization < 1 and max_new_tokens < max_model_len (got "
                f"{judge.gpu_memory_utilization}, {judge.max_new_tokens}, {judge.max_model_len})"
            )
        policy = config.models.policy.rollout.gpu_memory_utilization
        if not rt.judge_devices and policy + judge.gpu_memory_utilization > 0.95:
            raise ConfigError(
                f"models.judge.gpu_memory_utilization={judge.gpu_memory_utilization} + models.policy.rollout."
                f"gpu_memory_utilization={policy} > 0.95: the judge's engines share the policy engines' "
                "devices on CUDA; lower them or give the judge runtime_args.judge_devices"
            )
        engines = rt.devices("judge") or rt.devices("rollout")
        if len(engines) % judge.tensor_parallel_size:
            where = "runtime_args.judge_devices" if rt.judge_devices else "the rollout engines' devices"
            raise ConfigError(
                f"models.judge.tensor_parallel_size={judge.tensor_parallel_size} does not divide {where} "
                f"({len(engines)}): each judge engine takes tensor_parallel_size devices"
            )


def _overlong(config: RunConfig) -> None:
    trainer, rollout = config.models.policy_trainer, config.models.policy.rollout
    prefix = "models.policy_trainer"
    if trainer.overlong_buffer < 0 or trainer.overlong_penalty < 0:
        raise ConfigError(f"{prefix}.overlong_buffer and {prefix}.overlong_penalty: expected >= 0 (buffer 0: off)")
    if not trainer.overlong_buffer:
        return
    if config.models.reward.multi_turn:
        raise ConfigError(
            f"{prefix}.overlong_buffer={trainer.overlong_buffer}: overlong shaping is measured against one "
            "response's max_new_tokens, and a multi-turn trajectory has one per turn; set it to 0"
        )
    if trainer.overlong_buffer >= rollout.train.max_new_tokens:
        raise ConfigError(
            f"{prefix}.overlong_buffer={trainer.overlong_buffer}: expected fewer than "
            f"models.policy.rollout.train.max_new_tokens={rollout.train.max_new_tokens} (the penalty starts "
            "that many tokens before the limit)"
        )


def _multi_turn(config: RunConfig) -> None:
    m = config.models
    reward, limits = m.reward, m.policy.rollout.multi_turn
    if reward.agent:
        _agent(reward)
    check_bounds("models.reward", reward, ("env_actors", "tool_actors"), 1, "at least 1")
    check_bounds("models.reward", reward, ("env_timeout_s", "tool_timeout_s"), 0, "a positive number of seconds", True)
    reward.sandbox.validate("models.reward.sandbox")
    if reward.runs_code:
        try:
            Sandbox.start(reward.sandbox)  # logs the kernel layers that will confine the policy's code
        except SandboxUnavailableError as err:
            raise ConfigError(f"models.reward: {err}") from None
    for key, spec, builtins in [("models.reward.env", reward.environment, BUILTIN_ENVS)] * (not reward.agent) + [
        (f"models.reward.tools[{i}]", tool, BUILTIN_TOOLS) for i, tool in enumerate(reward.tools)
    ]:
        if spec not in builtins and not is_user_file(spec):
            raise ConfigError(f"{key}={spec!r}: expected one of {list(builtins)} or an existing path/to/file.py[:name]")
    total = limits.total_tokens(m.policy.rollout.max_model_len)
    if total <= m.policy.max_prompt_tokens:
        raise ConfigError(
            f"models.policy.rollout.multi_turn.max_total_tokens={total} leaves no room after a prompt of "
            f"models.policy.max_prompt_tokens={m.policy.max_prompt_tokens}; raise it"
        )
    if m.policy_trainer.moe.routing_replay:
        raise ConfigError(
            "models.policy_trainer.moe.routing_replay: multi-turn trajectories are sampled turn by turn, with "
            "no routing of their observation tokens to replay; set it to false"
        )
    if limits.rewritten_history == "new_sample":
        _new_samples(config)


def _new_samples(config: RunConfig) -> None:
    """A trajectory may become several training samples (rows), so a step's rows vary: each sample's advantage
    is its trajectory's, and the rows are planned as packed sequences."""
    trainer, key = config.models.policy_trainer, "models.policy.rollout.multi_turn.rewritten_history=new_sample"
    if trainer.advantage_estimator in TOKEN_ESTIMATORS:
        raise ConfigError(
            f"{key}: models.policy_trainer.advantage_estimator={trainer.advantage_estimator!r} chains the advantages "
            f"of a trajectory's tokens, which its samples split; use a per-sample estimator ({sorted(ESTIMATORS)})"
        )
    if not trainer.max_token_in_packing or trainer.share_prompts:
        raise ConfigError(
            f"{key}: a step's rows vary with the samples its trajectories became; set "
            "models.policy_trainer.max_token_in_packing > 0 (packed rows, planned whatever their number) and "
            "share_prompts: false"
        )


def _layouts(config: RunConfig) -> None:
    rt, m = config.runtime_args, config.models
    devices = rt.trainer_devices
    for role in m.checked_roles:
        world = rt.world(role)
        if world != devices:
            where = f"runtime_args.reward_model_devices={world}"
        elif devices == rt.num_devices:
            where = f"runtime_args.num_devices={devices}"
        else:
            others = ("rollout_devices", "reward_model_devices", "judge_devices")
            where = f"the trainer's {devices} devices: runtime_args.num_devices={rt.num_devices} - " + " - ".join(
                f"{k}={getattr(rt, k)}" for k in others if getattr(rt, k)
            )
        try:
            getattr(m, role).parallel.validate_world(world)
        except ValueError as err:
            raise ConfigError(f"models.{role}.parallel: {err} ({where})") from None
    for role in m.trained_roles:
        trainer = getattr(m, role)
        dp = trainer.parallel.dp(devices)
        if rt.train_global_batch_size % (trainer.micro_batch_size * dp):
            raise ConfigError(
                f"runtime_args.train_global_batch_size={rt.train_global_batch_size} is not a multiple of "
                f"models.{role}.micro_batch_size={trainer.micro_batch_size} x data-parallel size {dp}"
            )
    rollout_tp = m.policy.rollout.tensor_parallel_size
    if rt.engine_devices % rollout_tp:
        key = "num_devices" if rt.colocated else "rollout_devices"
        raise ConfigError(
            f"models.policy.rollout.tensor_parallel_size={rollout_tp} does not divide "
            f"runtime_args.{key}={rt.engine_devices}: each rollout replica takes tensor_parallel_size devices"
        )


def _agent(reward) -> None:
    if reward.env or reward.tools:
        raise ConfigError(
            f"models.reward.agent={reward.agent!r}: the agent program brings its own loop and tools; leave "
            "models.reward.env and models.reward.tools empty"
        )
    if not is_user_file(reward.agent):
        raise ConfigError(f"models.reward.agent={reward.agent!r}: expected an existing path/to/file.py[:function]")
    check_bounds("models.reward", reward, ("agent_actors",), 1, "at least 1")
    check_bounds("models.reward", reward, ("agent_timeout_s",), 0, "a positive number of seconds", True)
