"""Reward actors under a deadline: a reward call that hangs costs its sample a zero (counted), never the run."""

from __future__ import annotations

import time

from mcore_rl.roles.rollout import RewardPool

HANGS_ON_ONE = """
import time

def reward_fn(messages, answer):
    if messages[-1]["content"] == "hang":
        time.sleep(3600)
    return float(messages[-1]["content"] == answer)
"""


def _sample(i: int, text: str, answer: str = "4"):
    return (f"s{i}", [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": text}], answer)


def test_a_hung_reward_scores_zero_and_the_pool_goes_on(ray_address, tmp_path):
    (tmp_path / "r.py").write_text(HANGS_ON_ONE)
    pool = RewardPool(str(tmp_path / "r.py"), num_actors=2, num_cpus=0, timeout_s=2.0)
    try:
        texts = ["4", "5", "hang", "4", "4", "no"]
        start = time.monotonic()
        assert pool.score([_sample(i, t) for i, t in enumerate(texts)]) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
        assert pool.take_timeouts() == 1 and pool.take_timeouts() == 0
        assert time.monotonic() - start < 120
        assert pool.score([_sample(0, "4"), _sample(1, "3")]) == [1.0, 0.0]  # the replaced actor serves
        assert pool.score([_sample(0, "hang")]) == [0.0] and pool.take_timeouts() == 1
    finally:
        pool.stop()
