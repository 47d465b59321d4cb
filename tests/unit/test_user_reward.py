"""User reward functions load from a file; failures name the sample."""

from __future__ import annotations

import pytest

from mcore_rl.rewards.user import RewardError, load_reward_fn, score

ANSWERED = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "\\boxed{4}"}]


def test_builtin_and_file_reward_functions(tmp_path):
    assert score(load_reward_fn("math"), [("s0", ANSWERED, "4"), ("s1", ANSWERED, "5")]) == [1.0, 0.0]
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def reward_fn(messages, answer):\n    return len(messages[-1]['content'])\n\ndef half(m, a):\n    return 0.5\n"
    )
    assert score(load_reward_fn(str(path)), [("s0", ANSWERED, "4")]) == [9.0]
    assert score(load_reward_fn(f"{path}:half"), [("s0", ANSWERED, "4")]) == [0.5]


def test_bad_reward_functions_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="reward function file .*nope.py not found"):
        load_reward_fn(str(tmp_path / "nope.py"))
    path = tmp_path / "r.py"
    path.write_text(
        "def reward_fn(messages, answer):\n    return 1 / (answer == 'ok')\n\ndef nan(m, a):\n    return float('nan')\n"
    )
    with pytest.raises(AttributeError, match="no function 'other'"):
        load_reward_fn(f"{path}:other")
    with pytest.raises(RewardError, match="failed on sample s7: ZeroDivisionError"):
        score(load_reward_fn(str(path)), [("s6", ANSWERED, "ok"), ("s7", ANSWERED, "bad")])
    with pytest.raises(RewardError, match="returned nan on sample s1"):
        score(load_reward_fn(f"{path}:nan"), [("s1", ANSWERED, "x")])
