"""What a run checks before it writes anything (while Ray starts beside it): the model directories' files, the
data, and the user's code (reward function, judge parser, environment and tools) on the first training prompt, so
that code that cannot load or answer fails in seconds with the key that names it."""

from __future__ import annotations

import logging
from pathlib import Path

from mcore_rl import checkpoint
from mcore_rl.config.loader import ConfigError
from mcore_rl.config.schema import RunConfig
from mcore_rl.data.run_data import Data
from mcore_rl.rewards.judge import PARSERS, Verdicts
from mcore_rl.rewards.user import Rewards

log = logging.getLogger(__name__)


def check_inputs(config: RunConfig) -> Data:
    """The model directories' files, the checkpoints a resume would load, the data, and the user's code on the first
    prompt: the run's data."""
    config.check_files()
    check_resume(config)
    data = Data(config)
    check_user_code(config, data.train.batch(0, 1)[0].row, data.tokenizer)
    return data


def check_resume(config: RunConfig) -> None:
    """Where the run's directory holds complete checkpoints, one of them loads under the run's layout: a trained
    role's optimizer state saved per rank loads under its own layout and devices only
    (:func:`mcore_rl.checkpoint.optimizer_layout`); else the newest's reason, before any role starts."""
    from mcore_rl.trainer.policy import PolicyTrainer
    from mcore_rl.trainer.value import ValueTrainer

    rt, m = config.runtime_args, config.models
    roles = [(PolicyTrainer.checkpoint_dir, m.policy_trainer.parallel)]
    if m.uses("critic"):
        roles.append((ValueTrainer.checkpoint_dir, m.critic.parallel))
    problems = []
    for _, path in reversed(checkpoint.complete(Path(rt.output_dir) / "checkpoints", report=False)):
        try:
            for name, parallel in roles:
                if (path / name).is_dir():  # a role new to the run: its load says so
                    checkpoint.optimizer_layout(path / name, checkpoint.parallel_layout(parallel, rt.trainer_devices))
            return
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError(f"runtime_args.output_dir: no checkpoint there loads under this run's layout: {problems[0]}")


def check_user_code(config: RunConfig, row, tokenizer) -> None:
    """The reward function, or the environment and tools, on the first training prompt answered with its reference
    answer (an agent program: loaded): code that cannot load or answer at all fails in seconds, before any actor
    starts. ``tokenizer``: the policy's, whose chat template renders the tools."""
    reward = config.models.reward
    answered = [*row.messages, {"role": "assistant", "content": row.answer}]
    if not reward.multi_turn:
        if config.models.judge.load and config.models.judge.parser not in PARSERS:
            Verdicts(config.models.judge.parser)  # it loads
        return Rewards(reward.weighted_terms).check(answered, row.answer)
    if reward.agent:  # it needs the endpoint to run at all: loaded here, run by the sampler
        from mcore_rl.agent.actors import AgentError, load_program
        from mcore_rl.agent.template_audit import CALCULATOR

        try:
            load_program(reward.agent)
        except AgentError as err:
            raise ConfigError(str(err)) from None
        check_template(config, [CALCULATOR], tokenizer)  # an agent's tools are its own: audited with a calculator
        return
    from mcore_rl.agent.envs import EnvError, check_messages, check_step, environment_factory
    from mcore_rl.agent.tools import load_tools, schema

    tools = load_tools(reward.tools, reward.sandbox)
    if tools:
        check_tool_format(config, tools, tokenizer)
    check_template(config, [schema(t) for t in tools.values()], tokenizer)
    env = environment_factory(reward.environment, reward.fn, reward.sandbox)()
    what = f"models.reward.env={reward.environment!r} on the first training prompt (row {row.id!r})"
    try:
        check_messages(env.reset(row.as_dict()), "reset")
        check_step(env.step(answered[-1]))
    except EnvError as err:
        raise EnvError(f"{what}: {err}") from None
    except Exception as err:  # noqa: BLE001 - the user's environment, reported by key
        raise EnvError(f"{what} raised {type(err).__name__}: {err}") from None


def check_tool_format(config: RunConfig, tools: dict, tokenizer) -> None:
    """The policy's chat template (``tokenizer``'s) with the tool-call format it is read in (``auto``: the
    template's own): a template that does not render tools takes Hermes's instructions, so another format is
    refused here, by key."""
    from mcore_rl.agent.chat import ChatFormat
    from mcore_rl.agent.tool_calls import KEY, resolve_format
    from mcore_rl.agent.tools import schema

    try:
        limits = config.models.policy.rollout.multi_turn
        fmt = resolve_format(KEY, limits.tool_format, tokenizer.chat_template)
        ChatFormat(tokenizer, [schema(t) for t in tools.values()], fmt, limits.rewritten_history == "new_sample")
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_template(config: RunConfig, tools: list[dict], tokenizer) -> None:
    """The template audit (:mod:`mcore_rl.agent.template_audit`) of the policy's chat template with the run's tools:
    a template that refuses the conversation is refused, and one that rewrites the history is refused unless the
    run trains rewritten contexts as new samples; the verdict is logged either way."""
    from mcore_rl.agent.chat import REWRITTEN_KEY
    from mcore_rl.agent.template_audit import audit

    limits = config.models.policy.rollout.multi_turn
    verdict = audit(tokenizer, tools, limits.tool_format)
    where = f"models.policy.load={config.models.policy.load!r}: its chat template"
    if verdict.refused or (not verdict.appends and limits.rewritten_history == "refuse"):
        raise ConfigError(f"{where} {verdict.describe()}" + ("" if verdict.refused else f" ({REWRITTEN_KEY}=refuse)"))
    log.info("template audit: %s %s", where, verdict.describe())
