"""A generative judge: a language model prompted with a user's template to grade each response, its verdict
parsed into a number. The judge generates on the policy's own rollout engines (``models.judge.load: policy``), whose
requests interleave with the rollout's, or on engines of its own loaded from a model directory (its weights never
change; its own tokenizer renders the prompt).

The template is text with ``{response}`` (the policy's response) and optionally ``{question}`` (the prompt's last
user message) and ``{answer}`` (the reference answer); it becomes the judge's user message. A parser turns the
verdict's text into a number or None (unreadable): built in, ``score_tag`` (the number in ``<score>...</score>``)
or ``yes_no`` (1 for a first word yes, 0 for no), both linear-time regexes over a verdict of at most
``max_new_tokens``; or a user's function (:class:`Verdicts`, run in an actor with a deadline: the verdict comes from
the policy's text, and a parser's regex can be made to backtrack). An unreadable verdict, a call past the deadline,
or a prompt with no room for the verdict in the engines' context scores 0 and is counted.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from mcore_rl.rollout.engine import SamplingConfig
from mcore_rl.userfile import UserCodeError, load_attribute

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
Parse = Callable[[Sequence[tuple[str, str]]], list[float | None]]  # (sample id, verdict) -> number or None each


def builtin_parse(name: str) -> Parse:
    """A built-in parser over a batch of (sample id, verdict)."""
    parser = PARSERS[name]
    return lambda verdicts: [parser(text) for _, text in verdicts]


class Verdicts:
    """A user's parser, ``models.judge.parser: path/to/file.py:function`` taking the verdict's text and returning a
    number, or None for a verdict it cannot read. One that raises has not read it either (the text is the judge's
    answer to the policy's words: odd input is expected); one that returns anything else has a bug, raised as a
    :class:`JudgeError` naming the sample."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn = load_attribute(
            f"{KEY}.parser", spec, "parse", "a function {name}(verdict: str) -> float | None", JudgeError
        )
        if not callable(self.fn):
            raise JudgeError(f"{KEY}.parser={spec!r}: {self.fn!r} is not a function; define (verdict) -> float | None")

    def score(self, verdicts: Sequence[tuple[str, str]]) -> list[float | None]:
        return [self._one(sample_id, text) for sample_id, text in verdicts]

    def _one(self, sample_id: str, text: str) -> float | None:
        try:
            value = self.fn(text)
        except Exception:  # noqa: BLE001 - an unreadable verdict, counted by the judge
            return None
        if value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool)):
            return value if value is None else float(value)
        raise JudgeError(
            f"{KEY}.parser={self.spec!r} returned {value!r} ({type(value).__name__}) on the verdict of sample "
            f"{sample_id}; expected a number, or None for a verdict it cannot read"
        )


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
    template, with its generation prompt), generates a greedy verdict on the ``engines`` within the deadline, and
    parses it; ``take_failures`` counts the verdicts that were unreadable or late."""

    def __init__(self, config, engines, tokenizer, max_model_len: int, parse: Parse | None = None):
        """``max_model_len``: the engines'; a prompt with no room left for the verdict is not sent (it scores 0 and
        is counted: a response long enough to overflow the judge must not stop the run). ``parse``: a user's parser
        (see :class:`Verdicts`); default: the built-in ``config.parser``."""
        self.name, self.weight, self.timeout_s = config.name, config.weight, config.timeout_s
        self.template, self.parse = load_template(config.template), parse or builtin_parse(config.parser)
        self.sampling = SamplingConfig(temperature=0.0, max_new_tokens=config.max_new_tokens)
        self.engines, self.tokenizer = engines, tokenizer
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
            self.engines.generate_within([prompts[i] for i in fits], self.sampling, self.timeout_s) if fits else []
        )
        if verdicts is None:  # past the deadline: every verdict of the call is lost
            verdicts, fits = [], []
        texts = self.tokenizer.batch_decode([c[0].token_ids for c in verdicts], skip_special_tokens=True)
        scores, readable = [0.0] * len(samples), 0  # too long, late or unreadable: 0, counted
        values = self.parse([(samples[i][0], text) for i, text in zip(fits, texts, strict=True)]) if fits else []
        for i, value in zip(fits, values, strict=True):
            if value is not None and math.isfinite(value):
                scores[i], readable = value, readable + 1
        self.failures += len(samples) - readable
        return scores

    def take_failures(self) -> int:
        count, self.failures = self.failures, 0
        return count
