"""A generative judge: a language model prompted with a user's template to grade each response, its verdict
parsed into a number. The judge generates on the policy's own rollout engines (``models.judge.load: policy``):
their requests interleave with the rollout's, which keeps advancing while a verdict is generated.

The template is text with ``{response}`` (the policy's response) and optionally ``{question}`` (the prompt's last
user message) and ``{answer}`` (the reference answer); it becomes the judge's user message. A parser turns the
verdict's text into a number or None (unreadable): ``score_tag`` (the number in ``<score>...</score>``) or
``yes_no`` (1 for a first word yes, 0 for no); both are linear-time regexes over a verdict of at most
``max_new_tokens``. An unreadable verdict, a call past the deadline, or a prompt with no room for the verdict in
the engines' context scores 0 and is counted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

from mcore_rl.rollout.engine import SamplingConfig
from mcore_rl.userfile import UserCodeError

KEY = "models.judge"
PLACEHOLDERS = ("question", "response", "answer")


class JudgeError(UserCodeError):
    """The judge's template or parser cannot be used."""


def score_tag(text: str) -> float | None:
    """The number in the verdict's last ``<score>...</score>``."""
    found = re.findall(r"<score>\s*(-?\d+(?:\.\d+)?)\s*</score>", text)
    return float(found[-1]) if found else None


def yes_no(text: str) -> float | None:
    """1 when the verdict's first word is yes, 0 when it is no."""
    match = re.match(r"\W*(yes|no)\b", text.strip(), re.IGNORECASE)
    return None if match is None else float(match.group(1).lower() == "yes")


PARSERS: dict[str, Callable[[str], float | None]] = {"score_tag": score_tag, "yes_no": yes_no}


def load_template(spec: str) -> str:
    """The template: a file's text when ``spec`` names an existing file, else ``spec`` itself. It must hold
    ``{response}``, and no placeholder but those of :data:`PLACEHOLDERS`."""
    text = Path(spec).read_text() if len(spec) < 4096 and Path(spec).is_file() else spec
    names = set(re.findall(r"(?<!\{)\{(\w*)\}(?!\})", text))
    if "response" not in names:
        raise JudgeError(
            f"{KEY}.template: no {{response}} placeholder, so the judge would never see the response; add it "
            f"(also available: {{question}}, {{answer}})"
        )
    if unknown := names - set(PLACEHOLDERS):
        raise JudgeError(
            f"{KEY}.template: unknown placeholder(s) {sorted(unknown)}; expected {list(PLACEHOLDERS)} (write a "
            "literal brace as {{ or }})"
        )
    return text


class Judge:
    """The ``models.judge`` term: ``score`` renders each sample into the judge's prompt (``tokenizer``'s chat
    template, with its generation prompt), generates a greedy verdict on the ``rollout`` engines within the
    deadline, and parses it; ``take_failures`` counts the verdicts that were unreadable or late."""

    def __init__(self, config, rollout, tokenizer, max_model_len: int):
        """``max_model_len``: the engines'; a prompt with no room left for the verdict is not sent (it scores 0 and
        is counted: a response long enough to overflow the judge must not stop the run)."""
        self.name, self.weight, self.timeout_s = config.name, config.weight, config.timeout_s
        self.template, self.parse = load_template(config.template), PARSERS[config.parser]
        self.sampling = SamplingConfig(temperature=0.0, max_new_tokens=config.max_new_tokens)
        self.rollout, self.tokenizer = rollout, tokenizer
        self.max_prompt = max_model_len - config.max_new_tokens
        self.failures = 0

    def prompt(self, messages: list[dict], answer: str) -> list[int]:
        question = next((m["content"] for m in reversed(messages[:-1]) if m["role"] == "user"), "")
        text = self.template.format(question=question, response=messages[-1]["content"], answer=answer)
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, return_dict=True
        )
        return list(rendered["input_ids"])

    def score(self, samples: list[tuple[str, list[dict], str]]) -> list[float]:
        prompts = [self.prompt(messages, answer) for _, messages, answer in samples]
        fits = [i for i, p in enumerate(prompts) if len(p) <= self.max_prompt]
        verdicts = (
            self.rollout.generate_within([prompts[i] for i in fits], self.sampling, self.timeout_s) if fits else []
        )
        if verdicts is None:  # past the deadline: every verdict of the call is lost
            verdicts, fits = [], []
        texts = self.tokenizer.batch_decode([c[0].token_ids for c in verdicts], skip_special_tokens=True)
        scores, readable = [0.0] * len(samples), 0  # too long, late or unreadable: 0, counted
        for i, text in zip(fits, texts, strict=True):
            value = self.parse(text)
            if value is not None and math.isfinite(value):
                scores[i], readable = value, readable + 1
        self.failures += len(samples) - readable
        return scores

    def take_failures(self) -> int:
        count, self.failures = self.failures, 0
        return count
