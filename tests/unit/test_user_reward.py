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


def test_a_reward_may_return_named_components_and_several_are_weighted(tmp_path):
    from mcore_rl.rewards.user import Rewards, RewardTerm, default_name

    path = tmp_path / "parts.py"
    path.write_text(
        "def graded(messages, answer):\n"
        "    text = messages[-1]['content']\n"
        "    return {'score': 0.5 + ('4' in text), 'boxed': float('boxed' in text)}\n\n"
        "def no_score(m, a):\n    return {'boxed': 1.0}\n\n"
        "def bad_part(m, a):\n    return {'score': 1.0, 'boxed': 'yes'}\n"
    )
    assert Reward(f"{path}:graded").score_parts([("s0", ANSWERED, "4")]) == [(1.5, {"boxed": 1.0})]
    rewards = Rewards(
        [("models.reward.fn", RewardTerm("math", "math", 1.0)), ("t", RewardTerm("graded", f"{path}:graded", 0.1))]
    )
    ((total, parts),) = rewards.score([("s0", ANSWERED, "4")])
    assert total == pytest.approx(1.0 + 0.1 * 1.5) and parts == {"math": 1.0, "graded": 1.5, "graded/boxed": 1.0}
    with pytest.raises(RewardError, match=r"returned a dictionary without 'score' on sample s0 \(keys \['boxed'\]\)"):
        Reward(f"{path}:no_score", "models.reward.terms[0].fn").score([("s0", ANSWERED, "4")])
    with pytest.raises(RewardError, match=r"returned\['boxed'\] 'yes' \(str\) on sample s0; expected a finite real"):
        Reward(f"{path}:bad_part").score([("s0", ANSWERED, "4")])
    assert [default_name(s) for s in ("math", f"{path}", f"{path}:graded")] == ["math", "parts", "graded"]
