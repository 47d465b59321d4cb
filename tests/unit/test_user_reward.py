"""User reward functions load from a file; every failure names the key, the file and the sample, and anything but a
finite real number is refused (not converted)."""

from __future__ import annotations

import pytest

from mcore_rl.rewards.user import Reward, RewardError

ANSWERED = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "\\boxed{4}"}]


def test_builtin_and_file_reward_functions(tmp_path):
    assert Reward("math").score([("s0", ANSWERED, "4"), ("s1", ANSWERED, "5")]) == [1.0, 0.0]
    path = tmp_path / "my_reward.py"
    path.write_text(
        "import numpy\n"
        "def reward_fn(messages, answer):\n    return len(messages[-1]['content'])\n\n"
        "def half(m, a):\n    return 0.5\n\n"
        "def numpy_float(m, a):\n    return numpy.float32(0.25)\n"
    )
    assert Reward(str(path)).score([("s0", ANSWERED, "4")]) == [9.0]
    assert Reward(f"{path}:half").score([("s0", ANSWERED, "4")]) == [0.5]
    assert Reward(f"{path}:numpy_float").score([("s0", ANSWERED, "4")]) == [0.25]


def test_bad_reward_files_are_named(tmp_path):
    with pytest.raises(RewardError, match=r"models.reward.fn='.*nope.py': file .*nope.py not found"):
        Reward(str(tmp_path / "nope.py"))
    path = tmp_path / "r.py"
    path.write_text("def reward_fn(messages, answer):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"r.py has no 'other'; define a function other\(messages, answer\)"):
        Reward(f"{path}:other")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(RewardError, match=r"importing .*broken.py raised ModuleNotFoundError"):
        Reward(str(broken))


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("return '1.0'", r"returned '1.0' \(str\)"),
        ("return True", r"returned True \(bool\)"),
        ("return None", r"returned None"),
        ("return float('nan')", r"returned nan"),
        ("return float('inf')", r"returned inf"),
        ("return [1.0]", r"returned \[1.0\] \(list\)"),
        ("return 1 / (answer == 'ok')", r"failed on sample s7: ZeroDivisionError"),
    ],
)
def test_a_result_that_is_not_a_finite_number_names_key_file_and_sample(tmp_path, body, problem):
    path = tmp_path / "bad.py"
    path.write_text(f"def reward_fn(messages, answer):\n    {body}\n")
    reward = Reward(str(path))
    expected = rf"models.reward.fn='{path}' {problem}"
    with pytest.raises(
        RewardError, match=expected + (r"" if "failed" in problem else r" on sample s7; expected a finite")
    ):
        reward.score([("s7", ANSWERED, "bad")])
