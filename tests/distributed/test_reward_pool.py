"""Reward actors under a deadline: a reward call that hangs costs its sample a zero (counted), never the run; several
weighted reward functions are summed, each kept by name with its components; a judge's verdict parser that hangs
leaves its verdict unreadable."""

from __future__ import annotations

import time

from mcore_rl.rewards.judge import Verdicts
from mcore_rl.rewards.user import RewardTerm
from mcore_rl.roles.rollout import BoundedPool, RewardPool

HANGS_ON_ONE = """
import time

def reward_fn(messages, answer):
    if messages[-1]["content"] == "hang":
        time.sleep(3600)
    return float(messages[-1]["content"] == answer)


def length(messages, answer):
    text = messages[-1]["content"]
    return {"score": len(text), "vowels": sum(c in "aeiou" for c in text)}
"""


def _sample(i: int, text: str, answer: str = "4"):
    return (f"s{i}", [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": text}], answer)


def test_a_hung_reward_scores_zero_and_the_pool_goes_on(ray_address, tmp_path):
    (tmp_path / "r.py").write_text(HANGS_ON_ONE)
    terms = [("models.reward.fn", RewardTerm("exact", str(tmp_path / "r.py"), 1.0))]
    pool = RewardPool(terms, num_actors=2, num_cpus=0, timeout_s=5.0)  # seconds no working call approaches
    try:
        texts = ["4", "5", "hang", "4", "4", "no"]
        start = time.monotonic()
        scored = pool.score([_sample(i, t) for i, t in enumerate(texts)])
        assert [total for total, _ in scored] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
        assert scored[0][1] == {"exact": 1.0} and scored[2][1] == {}  # the hung sample has no parts
        assert pool.take_timeouts() == 1 and pool.take_timeouts() == 0
        assert time.monotonic() - start < 120
        assert [t for t, _ in pool.score([_sample(0, "4"), _sample(1, "3")])] == [1.0, 0.0]  # the replacement serves
        assert pool.score([_sample(0, "hang")]) == [(0.0, {})] and pool.take_timeouts() == 1
    finally:
        pool.stop()


def test_weighted_rewards_are_summed_and_kept_by_name(ray_address, tmp_path):
    (tmp_path / "r.py").write_text(HANGS_ON_ONE)
    terms = [
        ("models.reward.fn", RewardTerm("exact", str(tmp_path / "r.py"), 2.0)),
        ("models.reward.terms[0].fn", RewardTerm("length", f"{tmp_path}/r.py:length", -0.5)),
    ]
    pool = RewardPool(terms, num_actors=1, num_cpus=0, timeout_s=30.0)
    try:
        assert pool.score([_sample(0, "4"), _sample(1, "aloe")]) == [
            (2.0 * 1 - 0.5 * 1, {"exact": 1.0, "length": 1.0, "length/vowels": 0.0}),
            (2.0 * 0 - 0.5 * 4, {"exact": 0.0, "length": 4.0, "length/vowels": 3.0}),
        ]
    finally:
        pool.stop()


# A user's verdict parser whose regex backtracks exponentially on a verdict the policy can provoke ("aaaa...b").
BACKTRACKS = """
import re

def parse(verdict):
    if re.fullmatch(r"(a+)+c", verdict):
        return 1.0
    return float(verdict) if verdict.strip().isdigit() else None
"""


def test_a_judge_parser_that_hangs_on_a_hostile_verdict_leaves_it_unreadable(ray_address, tmp_path):
    """The parser runs in an actor of its own under the reward deadline: the verdict that sends its regex into
    exponential backtracking is stopped and reads as unreadable (None, which the judge counts); the others parse."""
    (tmp_path / "p.py").write_text(BACKTRACKS)
    pool = BoundedPool(Verdicts, (f"{tmp_path}/p.py:parse",), 1, 0, 2.0, None, "judge verdict")
    try:
        verdicts = [("s0", "7"), ("s1", "a" * 40 + "b"), ("s2", "unsure"), ("s3", "3")]
        assert pool.score(verdicts) == [7.0, None, None, 3.0] and pool.take_timeouts() == 1
    finally:
        pool.stop()
