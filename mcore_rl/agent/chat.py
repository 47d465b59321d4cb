"""The chat side of a multi-turn trajectory: the tokens that go between two assistant turns, rendered by the model's
own chat template (the tool calls in those turns are read by :mod:`mcore_rl.agent.tool_calls`).

A trajectory is one token sequence that only grows: the engine's sampled ids are appended as they are (never
decoded and re-encoded, which can merge or split tokens differently), and each observation is appended as the
ids of the text the template puts after an assistant message (the end of its turn, the observation messages,
the next assistant turn's opening). That text is what follows a marker assistant message in a fixed conversation
rendered with the observation. Any template that renders what came before the assistant turn the same once more
messages follow works, also one that renders the assistant message itself differently (Qwen3's drops the empty
``<think>`` block of a turn that is no longer the last): the trajectory holds the sampled ids in its place.

A template that rewrites the history (DeepSeek-R1's drops earlier turns' reasoning) gives the policy, at
inference, a context that is not the trajectory's tokens. With ``rewritten_history: new_sample`` each observation
checks the whole conversation rendered anew against the trajectory's context (:meth:`ChatFormat.follow`); where
they differ, a new training sample starts from that rendering, as TRL and prime-rl do.
"""

from __future__ import annotations

import json

import jinja2

from mcore_rl.agent import tool_calls

REWRITTEN_KEY = "models.policy.rollout.multi_turn.rewritten_history"
_MARK = "\u2063mcore_rl\u2063"  # an assistant message's content, to find what the template puts after it

# For templates that ignore ``tools`` (SmolLM2's, for one): the Hermes instructions Qwen's template renders.
HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def clip(text: str, max_chars: int) -> str:
    """``text`` cut to its first ``max_chars`` characters, saying how much was cut."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[... {len(text) - max_chars} more characters cut]"


def _hermes_calls(message: dict) -> dict:
    """An assistant message with its ``tool_calls`` (as chat templates read them) in its content, as Qwen2.5's
    template renders them: the text, then one ``<tool_call>`` block per call, each on lines of its own."""
    calls = [call["function"] for call in message["tool_calls"]]
    blocks = [json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False) for c in calls]
    text = [message["content"]] if message.get("content") else []
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": "\n".join(text + [f"<tool_call>\n{b}\n</tool_call>" for b in blocks])}


class ChatFormat:
    """Token ids of a trajectory's opening prompt and of the observations between its turns."""

    def __init__(self, tokenizer, tool_schemas: list[dict], tool_format: str = "hermes", new_samples: bool = False):
        """``new_samples``: ``rewritten_history: new_sample`` (:meth:`follow`)."""
        self.tokenizer, self.tools, self.new_samples = tokenizer, tool_schemas or None, new_samples
        probe = [{"role": "user", "content": "?"}]
        # A template that ignores ``tools`` gets them in a system message of Hermes instructions instead.
        self.tools_in_system = bool(self.tools) and self._render(probe, tools=self.tools) == self._render(probe)
        if self.tools_in_system and tool_format != "hermes":
            raise ValueError(
                f"{tool_calls.KEY}={tool_format!r}: the chat template does not render "
                "tools, and the instructions put in their place are Hermes's; use tool_format 'hermes' (or "
                "'auto'), or a template that renders the tools"
            )
        self._opening = self._render(probe, generation=True)  # what the marker turn was sampled after
        self._base = [*probe, {"role": "assistant", "content": _MARK}]
        self._eos = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        # Every string the tokenizer turns into one added token (<|im_start|>, </tool_response>, <think>, ...)
        self._controls = sorted({t.content for t in tokenizer.added_tokens_decoder.values()}, key=len, reverse=True)
        self._control_ids = set(tokenizer.added_tokens_decoder)
        if self.tools:  # a template that cannot put a tool's result after a turn fails here, before a run starts
            probe = [{"role": "tool", "tool_call_id": "call_0_0_0", "name": "probe", "content": "?"}]
            self._after_turn(probe, []) if new_samples else self.observation(probe, [])

    def _render(self, messages: list[dict], generation: bool = False, tools=None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation
        )

    def with_tools(self, messages: list[dict]) -> list[dict]:
        """``messages`` as the policy sees them: where the template does not render tools itself, with the tools'
        Hermes instructions in the system message and each assistant message's tool calls written into its content
        as Hermes calls (such a template renders the content alone: a client's earlier call would vanish)."""
        if not self.tools_in_system:
            return list(messages)  # a trajectory's own list: its turns are appended to it
        messages = [_hermes_calls(m) if m.get("tool_calls") else m for m in messages]
        listing = "\n".join(json.dumps(t) for t in self.tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + system}, *messages[1:]]
        return [{"role": "system", "content": system}, *messages]

    def inert(self, text: str) -> str:
        """``text`` (a tool's or an environment's output) with every control token's string broken by a word
        joiner after its first character: it reads the same, but tokenises as text, so it cannot open a system
        turn or close its own tool response in the policy's context."""
        for control in self._controls:
            if control in text:
                text = text.replace(control, control[0] + "\u2060" + control[1:])
        return text

    def inert_messages(self, messages: list[dict]) -> list[dict]:
        """``messages`` with every text :meth:`inert`: also a tool's name and a call's id, which the policy wrote and
        some templates render (Kimi-K2's writes the name as the turn's role)."""
        return [{k: self.inert(v) if isinstance(v, str) else v for k, v in m.items()} for m in messages]

    def prompt(self, messages: list[dict]) -> list[int]:
        """The opening messages, ending with the assistant turn's opening."""
        return self.context(self.with_tools(messages))

    def context(self, conversation: list[dict]) -> list[int]:
        """The ids of ``conversation`` (with the tools' instructions, :meth:`with_tools`) as the next turn's
        context."""
        return self.tokenizer.encode(self._context(conversation), add_special_tokens=False)

    def _context(self, conversation: list[dict]) -> str:
        """The text of :meth:`context`."""
        try:
            return self.render(conversation, generation=True)
        except jinja2.TemplateError as err:  # its own raise_exception (gpt-oss's wants the call a result answers)
            roles = "/".join(sorted({m["role"] for m in conversation}))
            raise ValueError(f"the chat template refuses this conversation of {roles} messages ({err})") from None

    def render(self, conversation: list[dict], generation: bool) -> str:
        """The text of ``conversation`` (with the tools' instructions, :meth:`with_tools`) as the policy sees it;
        ``generation``: followed by the next assistant turn's opening."""
        return self._render(conversation, generation, tools=None if self.tools_in_system else self.tools)

    def sampled(self, turn_ids: list[int]) -> dict:
        """An assistant turn as the template reads it back to render the conversation: its sampled text with the
        markers of reasoning and tool calls as written (without the end-of-turn token the template adds). Only
        the control tokens the policy sampled stay control tokens: text between them is made :meth:`inert`, so a
        turn that spells ``<|im_start|>`` in ordinary tokens cannot open a turn once the conversation is encoded
        anew."""
        if turn_ids and turn_ids[-1] == self.tokenizer.eos_token_id:
            turn_ids = turn_ids[:-1]
        pieces, text = [], []
        for token in turn_ids:
            if token in self._control_ids:
                pieces += [self.inert(self._decode(text)), self._decode([token])]
                text = []
            else:
                text.append(token)
        return {"role": "assistant", "content": "".join([*pieces, self.inert(self._decode(text))])}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def follow(self, conversation: list[dict], context: list[int], messages: list[dict], turn_ids: list[int]):
        """What comes after an assistant turn (``turn_ids``, the last of ``context``) once the observation
        ``messages`` follow: ``(ids, False)`` with the :meth:`observation` ids to append, or, with ``new_samples``
        where the template rewrites the history (DeepSeek-R1's and Qwen3's drop the reasoning of earlier turns),
        ``(ids, True)`` with the prompt of a new training sample: the whole ``conversation`` (as
        :meth:`with_tools` and :meth:`sampled` give it) plus ``messages``, rendered anew, wherever that rendering is
        not ``context`` plus the appended ids."""
        if not self.new_samples:
            return self.observation(messages, turn_ids), False
        text = self._context(conversation + self.inert_messages(messages))
        ids = self._after_turn(messages, turn_ids)
        if ids is not None and self._decode(context + ids) == text:
            return ids, False
        return self.tokenizer.encode(text, add_special_tokens=False), True

    def observation(self, messages: list[dict], turn_ids: list[int]) -> list[int]:
        """What follows an assistant turn whose sampled ids were ``turn_ids``: the rest of its end-of-turn text,
        the observation ``messages`` (made :meth:`inert_messages`) and the next assistant turn's opening."""
        ids = self._after_turn(messages, turn_ids)
        if ids is None:
            raise ValueError(
                "the chat template renders earlier messages differently once more follow, so observations cannot "
                "be appended to a trajectory's tokens; use a template that appends messages, or set "
                f"{REWRITTEN_KEY}: new_sample to train on the rewritten history as a new sample"
            )
        return ids

    def _after_turn(self, messages: list[dict], turn_ids: list[int]) -> list[int] | None:
        """:meth:`observation`'s ids, or None where the template renders the turn before them differently."""
        messages = self.inert_messages(messages)
        try:
            full = self._render(self._base + messages, generation=True)
        except jinja2.TemplateError as err:  # its own raise_exception (gpt-oss's wants the call a result answers)
            roles = "/".join(sorted({m["role"] for m in messages}))
            raise ValueError(
                f"the chat template refuses {roles} messages after an assistant message without tool calls ({err}); "
                "observations follow the sampled turn as the template renders them after one, so multi-turn "
                "rollouts need a template that renders them there"
            ) from None
        mark = full.find(_MARK, len(self._opening))
        if not full.startswith(self._opening) or mark < 0:
            return None
        rest = full[mark + len(_MARK) :]
        if turn_ids and turn_ids[-1] == self.tokenizer.eos_token_id and rest.startswith(self._eos):
            rest = rest[len(self._eos) :]  # the engine sampled the end-of-turn token itself
        return self.tokenizer.encode(rest, add_special_tokens=False)
