"""A built-in, seeded arithmetic dataset, so the main job needs no downloads."""

from __future__ import annotations

import random

from mcore_rl.data.prompts import PromptRow

INSTRUCTION = "Answer with the number only."


def arithmetic_splits(
    num_train: int, num_eval: int, seed: int, max_operand: int = 50
) -> tuple[list[PromptRow], list[PromptRow]]:
    """Disjoint train/eval questions like "What is 17 + 25?"; ids ``train-<i>`` / ``eval-<i>``; seeded."""
    possible = 2 * (max_operand + 1) ** 2
    if num_train + num_eval > possible:
        raise ValueError(f"only {possible} distinct questions with max_operand={max_operand}; raise it")
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    questions = []
    while len(questions) < num_train + num_eval:
        q = (rng.randint(0, max_operand), rng.choice("+-"), rng.randint(0, max_operand))
        if q not in seen:
            seen.add(q)
            questions.append(q)

    def row(split: str, i: int, q: tuple[int, str, int]) -> PromptRow:
        a, op, b = q
        answer = a + b if op == "+" else a - b
        return PromptRow(
            f"{split}-{i}", [{"role": "user", "content": f"What is {a} {op} {b}? {INSTRUCTION}"}], str(answer)
        )

    train = [row("train", i, q) for i, q in enumerate(questions[:num_train])]
    evaluation = [row("eval", i, q) for i, q in enumerate(questions[num_train:])]
    return train, evaluation
