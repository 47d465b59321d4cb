"""What a run checks before it writes anything (while Ray starts beside it): the model directories' files, the
data, and the user's code (reward function, judge parser, environment and tools) on the first training prompt, so
that code that cannot load or answer fails in seconds with the key that names it."""

from __future__ import annotations

from mcore_rl.config.schema import RunConfig
from mcore_rl.data.run_data import Data
from mcore_rl.rewards.judge import PARSERS, Verdicts
from mcore_rl.rewards.user import Rewards


def check_inputs(config: RunConfig) -> Data:
    """The model directories' files, the data, and the user's code on the first prompt: the run's data."""
    config.check_files()
    data = Data(config)
    check_user_code(config, data.train.batch(0, 1)[0].row)
    return data


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
