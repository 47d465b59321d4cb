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


# Multi-step word problems: the text, the expression that answers it, and its value, of operands a, b (two digits)
# and c, d (3 to 12); each needs two or three operations, which a small model gets wrong in its head and right with
# a calculator.
_WORD_PROBLEMS = (
    ("A shop has {a} apples. It sells {b} of them, then receives {c} boxes of {d} apples each. How many apples "
     "does it have now?", "{a} - {b} + {c} * {d}", lambda a, b, c, d: a - b + c * d),
    ("Tom saves {a} dollars a week for {c} weeks, then spends {b} dollars. How many dollars does he have left?",
     "{a} * {c} - {b}", lambda a, b, c, d: a * c - b),
    ("A train has {c} cars with {a} seats each. {b} seats are taken and {d} more passengers board. How many "
     "seats are still free?", "{c} * {a} - {b} - {d}", lambda a, b, c, d: c * a - b - d),
    ("A farmer plants {c} rows of {a} trees and {d} rows of {b} trees. How many trees does he plant?",
     "{c} * {a} + {d} * {b}", lambda a, b, c, d: c * a + d * b),
)  # fmt: skip


def word_problem_splits(num_train: int, num_eval: int, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """Disjoint train/eval multi-step word problems with whole, non-negative answers; ids ``train-<i>`` /
    ``eval-<i>``; each row's ``expression`` field is the arithmetic that answers it; seeded."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[tuple[str, str, str]] = []
    while len(rows) < num_train + num_eval:
        text, expression, value = rng.choice(_WORD_PROBLEMS)
        operands = dict(a=rng.randint(12, 99), b=rng.randint(12, 99), c=rng.randint(3, 12), d=rng.randint(3, 12))
        question, answer = text.format(**operands), value(**operands)
        if answer >= 0 and question not in seen:
            seen.add(question)
            rows.append((question, expression.format(**operands), str(answer)))

    def row(split: str, i: int, question: str, expression: str, answer: str) -> PromptRow:
        messages = [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
        return PromptRow(f"{split}-{i}", messages, answer, {"expression": expression})

    train = [row("train", i, *q) for i, q in enumerate(rows[:num_train])]
    return train, [row("eval", i, *q) for i, q in enumerate(rows[num_train:])]


BUILTIN_SPLITS = {"builtin:arithmetic": arithmetic_splits, "builtin:word_problems": word_problem_splits}
