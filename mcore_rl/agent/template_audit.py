"""The template audit: does the policy's chat template render a conversation by appending to it?

A multi-turn trajectory is one token sequence that only grows (:mod:`mcore_rl.agent.chat`): each turn is sampled
after the previous context, and the next context is that context, the turn and the observation. That is the
conversation the policy is trained on; it is the one a deployment shows the policy only if the template renders
every earlier turn the same once more messages follow. Thinking templates often do not (Qwen3's and DeepSeek-R1's
drop the reasoning of turns before the last user message), and some put a different separator after an assistant
turn once a tool result follows it: training then silently uses contexts the model never sees.

:func:`audit` renders a synthetic conversation (system, user, an assistant turn with reasoning and a tool call, the
tool's result, an assistant turn with reasoning and an answer, a second user message, a plain assistant answer)
incrementally and whole, and checks that each step's text is a prefix of the next: the prompt of each assistant turn,
that turn as the last message, the prompt of the next. The first step that is not names the first differing token
and the fix. A run with tools, an environment or an agent audits its policy's template before any actor starts
(:func:`mcore_rl.preflight.check_template`); ``mcore-rl-check-template MODEL_DIR`` runs it alone.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

from mcore_rl.agent.chat import REWRITTEN_KEY, ChatFormat
from mcore_rl.agent.tool_calls import KEY, resolve_format
from mcore_rl.agent.tools import Calculator, schema

CALCULATOR = schema(Calculator())  # the tool the audit's conversation calls, where the run gives none of its own
_CALL = {"id": "call_0_0_0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}
_THOUGHTS = ("The user wants 6*7; the calculator gives it.", "The tool says 42.")


def _assistant(content: str, reasoning: str = "", calls: list[dict] | None = None) -> dict:
    """An assistant message as chat templates read one: the reasoning under both names templates use."""
    message = {"role": "assistant", "content": content}
    if reasoning:
        message |= {"reasoning_content": reasoning, "thinking": reasoning}
    return message | ({"tool_calls": calls} if calls else {})


def conversation(tools: bool) -> list[dict]:
    """The audit's conversation; without ``tools`` the tool call is left out and its result is a user message (an
    environment's observation)."""
    observation = {"role": "tool", "tool_call_id": _CALL["id"], "name": "calculator", "content": "42"}
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 6*7? Use the calculator."},
        _assistant("I will compute it.", _THOUGHTS[0], [_CALL] if tools else None),
        observation if tools else {"role": "user", "content": "42"},
        _assistant("6*7 = 42.", _THOUGHTS[1]),
        {"role": "user", "content": "And 7*8?"},
        _assistant("56."),
    ]


@dataclass(frozen=True)
class Mismatch:
    """Where a step's text stops being a prefix of the next step's."""

    earlier: str  # the step whose text should continue, e.g. "assistant turn 1 as the last message"
    later: str  # the step that renders it otherwise
    token_index: int  # of the first differing token in the earlier step's ids
    expected: str  # that token, as the earlier step has it ("" where the later one ends first)
    got: str  # the later step's token there ("" where it ends first)
    excerpt: tuple[str, str]  # the two texts around the difference
    drops_reasoning: bool  # the earlier text holds reasoning that the later one lacks


@dataclass(frozen=True)
class Verdict:
    appends: bool  # every step's text is a prefix of the next's
    mismatch: Mismatch | None = None
    refused: str = ""  # the template raised on the conversation (its own raise_exception)

    def describe(self) -> str:
        """One paragraph: the verdict, where it fails and the fix."""
        if self.refused:
            return f"refuses the audit's conversation: {self.refused}"
        if self.appends:
            return "appends: every turn's context continues the previous one token for token"
        m = self.mismatch
        what = "drops earlier turns' reasoning" if m.drops_reasoning else "renders an earlier turn differently"
        return (
            f"rewrites the history ({what}): {m.later} does not continue {m.earlier}; first differing token "
            f"#{m.token_index}: {m.expected!r} there, {m.got!r} here (...{m.excerpt[0]!r} against ...{m.excerpt[1]!r}). "
            f"Fix: {REWRITTEN_KEY}: new_sample (each rewritten context trains as a new sample), or a template that "
            "renders every turn as it renders the last one"
        )


def audit(tokenizer, tools: list[dict] | None = None, tool_format: str = "auto") -> Verdict:
    """The verdict on ``tokenizer``'s chat template for a conversation with ``tools`` (default: a calculator) in
    ``tool_format`` (``auto``: the template's own); a template that ignores tools gets them as the run gives them
    (Hermes instructions in the system message, :class:`mcore_rl.agent.chat.ChatFormat`)."""
    tools = [CALCULATOR] if tools is None else tools
    fmt = resolve_format(KEY, tool_format, tokenizer.chat_template)
    try:  # with new_samples, a template that rewrites the history is not refused here: the audit says where
        chat = ChatFormat(tokenizer, tools, fmt, new_samples=True)
    except ValueError as err:  # it refuses a tool result after an assistant turn
        return Verdict(appends=False, refused=str(err))
    messages = chat.with_tools(conversation(bool(tools)))
    steps = []
    for turn, index in enumerate(i for i, m in enumerate(messages) if m["role"] == "assistant"):
        steps.append((f"the prompt of assistant turn {turn + 1}", messages[:index], True))
        steps.append((f"assistant turn {turn + 1} as the last message", messages[: index + 1], False))
    try:
        texts = [(name, chat.render(prefix, generation)) for name, prefix, generation in steps]
    except jinja2.TemplateError as err:
        return Verdict(appends=False, refused=" ".join(str(err).split()))
    for (earlier, a), (later, b) in itertools.pairwise(texts):
        if not b.startswith(a):
            return Verdict(appends=False, mismatch=_mismatch(tokenizer, earlier, a, later, b))
    return Verdict(appends=True)


def _first_difference(a, b) -> int:
    """The first index where sequences ``a`` and ``b`` differ, or the shorter one's length."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _mismatch(tokenizer, earlier: str, a: str, later: str, b: str) -> Mismatch:
    ids_a, ids_b = (tokenizer.encode(t, add_special_tokens=False) for t in (a, b))
    i, d = _first_difference(ids_a, ids_b), _first_difference(a, b)
    tokens = [tokenizer.decode(ids[i : i + 1]) if i < len(ids) else "" for ids in (ids_a, ids_b)]
    lost = a[d:]
    reasoning = any(thought in lost for thought in _THOUGHTS) or "<think>" in lost
    excerpt = (a[max(0, d - 30) : d + 30], b[max(0, d - 30) : d + 30])
    return Mismatch(earlier, later, i, *tokens, excerpt, reasoning)


def main(argv: list[str] | None = None) -> int:
    """``mcore-rl-check-template MODEL_DIR``: the audit of a model directory's chat template; exit status 0 when it
    appends, 1 when it rewrites the history or refuses the conversation, 2 when the tokenizer does not load."""
    parser = argparse.ArgumentParser(prog="mcore-rl-check-template", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="an HF model directory (its tokenizer and chat template)")
    parser.add_argument("--tool-format", default="auto", help="how the policy writes tool calls (default: auto)")
    parser.add_argument("--no-tools", action="store_true", help="audit a conversation without tools")
    args = parser.parse_args(argv)
    from converters.hf_io import load_tokenizer

    if not Path(args.model_dir).is_dir():
        print(f"error: MODEL_DIR={args.model_dir!r}: not a directory", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(args.model_dir)
        verdict = audit(tokenizer, [] if args.no_tools else None, args.tool_format)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.model_dir}: {verdict.describe()}")
    return 0 if verdict.appends else 1


if __name__ == "__main__":
    sys.exit(main())
