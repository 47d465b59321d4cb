"""pass@k and mean@n against a count over every k-subset of the samples (the estimator's definition), and the eval
table."""

import itertools

import pytest

from mcore_rl.evaluation import accuracy_metrics, eval_table, ks, pass_at_k


def _by_subsets(correct: list[bool], k: int) -> float:
    """The fraction of k-subsets of one prompt's samples holding a correct one, counted."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_by_subsets(correct, k), abs=1e-12), (n, c, k)


def test_accuracy_and_pass_at_k_over_prompts():
    # three prompts of four samples: 1, 0 and 4 correct
    correct = [True, False, False, False] + [False] * 4 + [True] * 4
    got = accuracy_metrics(correct, 4)
    assert got["accuracy"] == 5 / 12  # mean@4: every sample counts once
    assert got["pass_at_1"] == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert got["pass_at_2"] == pytest.approx((_by_subsets(correct[:4], 2) + 0 + 1) / 3)
    assert got["pass_at_4"] == pytest.approx((1 + 0 + 1) / 3)
    assert list(got) == ["accuracy", "pass_at_1", "pass_at_2", "pass_at_4"]
    assert accuracy_metrics([True, False], 1) == {"accuracy": 0.5, "pass_at_1": 0.5}  # greedy: pass@1 is the accuracy
    assert ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="5 samples are no whole number of prompts of 4 samples"):
        accuracy_metrics([True] * 5, 4)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_the_eval_table_has_a_row_per_set():
    metrics = {
        "eval/accuracy": 0.31, "eval/pass_at_1": 0.31, "eval/time_s": 12.25, "eval/reward/exact": 0.31,
        "eval/word_problems/accuracy": 0.125, "eval/word_problems/time_s": 30.5,
    }  # fmt: skip
    assert eval_table(5, metrics, ["", "word_problems"]).splitlines() == [
        "eval after episode 5:",
        "                 accuracy   pass_at_1      time_s",
        "eval                 0.31        0.31       12.25",
        "word_problems       0.125                    30.5",
    ]
