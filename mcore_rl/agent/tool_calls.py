"""Tool calls read from an assistant turn, in the format its model family was trained to write.

Each format (:data:`FORMATS`) cuts the turn's text (decoded with its special tokens: several families' markers are
special tokens) into raw calls: a name and arguments as JSON text, or as parameter strings in the XML formats,
which the tools' schemas type. One validation then turns every raw call into a :class:`ToolCall` or an error the
policy reads as the call's result: malformed, too long, unclosed, too many. Nothing the policy writes raises past
:func:`parse_tool_calls`, and each scan is linear in the text (``str.find``, no backtracking pattern over it).

``auto`` picks the format from the markers in the model's chat template (:func:`detect_format`); a template that
shows none is read as Hermes, whose instructions :mod:`mcore_rl.agent.chat` then puts in the system message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

KEY = "models.policy.rollout.multi_turn.tool_format"  # the run config's key that chooses the format
MAX_CALL_CHARS = 1 << 16  # one call's arguments: far past any real call, short enough to parse at once
MAX_ID_CHARS = 100  # a call id the model wrote, as its result names it
JSON_TYPES = {"integer", "number", "boolean", "object", "array", "null"}  # an XML parameter of these is JSON


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # why the call could not be parsed (then it is not made; the error is its result)
    kind: str = ""  # the error's kind, counted in agent/tool_errors/<kind>
    id: str = ""  # the call's id as the model wrote it (Kimi-K2, Mistral), which its result must name; "" for none


@dataclass(frozen=True)
class _Raw:
    """A call as the format wrote it: ``arguments`` JSON text, or ``{parameter: text}`` (XML formats)."""

    name: str
    arguments: str | dict
    error: str = ""
    id: str = ""


def _blocks(text: str, open_: str, close: str) -> Iterator[tuple[str, bool]]:
    """The bodies between ``open_`` and ``close``, in order, and whether each was closed (an unclosed one runs to
    the end of the text, and is the last)."""
    start = text.find(open_)
    while start >= 0:
        body = start + len(open_)
        end = text.find(close, body)
        if end < 0:
            yield text[body:], False
            return
        yield text[body:end], True
        start = text.find(open_, end + len(close))


def _between(open_: str, close: str, body: Callable[[str], _Raw]) -> Callable[[str], Iterator[_Raw]]:
    """A format whose calls sit between two markers: each closed block read by ``body``, an unclosed one (the
    turn ran out of tokens inside it) an error."""

    def parse(text: str) -> Iterator[_Raw]:
        for block, closed in _blocks(text, open_, close):
            yield body(block) if closed else _Raw("", "", f"a {open_} without {close}")

    parse.__doc__ = body.__doc__
    return parse


def _json_object_call(body: str, arguments_keys: tuple[str, ...] = ("arguments",)) -> _Raw:
    """``{"name": ..., "arguments": {...}}`` written as JSON text (Llama writes ``parameters``)."""
    try:
        call = _json(body)
    except ValueError as err:
        return _Raw("", "", f"the tool call is not JSON ({err})")
    return _object_call(call, arguments_keys)


def _object_call(call: object, arguments_keys: tuple[str, ...] = ("arguments",)) -> _Raw:
    """A parsed ``{"name": ..., "arguments": {...}}``; the arguments go back to text for the one validation."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return _Raw("", "", 'the tool call has no "name" string')
    arguments = next((call[k] for k in arguments_keys if k in call), {})
    call_id = call["id"] if isinstance(call.get("id"), str) else ""  # Mistral's
    if isinstance(arguments, str):
        return _Raw(call["name"], arguments, id=call_id)
    try:  # back to text for the one validation (json.dumps may nest less deep than json.loads did)
        return _Raw(call["name"], json.dumps(arguments), id=call_id)
    except (ValueError, RecursionError) as err:
        return _Raw(call["name"], "", f"the arguments cannot be read ({type(err).__name__})")


def _hermes(body: str) -> _Raw:
    """Hermes, Qwen2.5/Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return _json_object_call(body.strip())


def _xml_parameters(body: str, open_: str, separator: str, close: str) -> dict[str, str]:
    """``open_ NAME separator VALUE close`` pairs (Qwen3-Coder's ``<parameter=k>v</parameter>``)."""
    found = {}
    for part, closed in _blocks(body, open_, close):
        key, sep, value = part.partition(separator)
        if closed and sep:
            found[key.strip()] = value
    return found


def _qwen3_coder(body: str) -> _Raw:
    """Qwen3-Coder: ``<tool_call><function=NAME><parameter=KEY>\\nVALUE\\n</parameter></function></tool_call>``."""
    _, found, rest = body.partition("<function=")
    name, gt, rest = rest.partition(">")
    if not found or not gt or "</function>" not in rest:
        return _Raw("", "", "expected <function=NAME>...</function> in the <tool_call>")
    values = _xml_parameters(rest, "<parameter=", ">", "</parameter>")
    return _Raw(name.strip(), {k: v.removeprefix("\n").removesuffix("\n") for k, v in values.items()})


def _glm45(body: str) -> _Raw:
    """GLM-4.5: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``."""
    name = body.split("<arg_key>", 1)[0].strip()
    keys = [k for k, ok in _blocks(body, "<arg_key>", "</arg_key>") if ok]
    values = [v for v, ok in _blocks(body, "<arg_value>", "</arg_value>") if ok]
    if len(keys) != len(values):
        return _Raw(name, "", f"{len(keys)} <arg_key> against {len(values)} <arg_value>")
    return _Raw(name, {k.strip(): v for k, v in zip(keys, values, strict=True)})


def _llama3_json(text: str) -> Iterator[_Raw]:
    """Llama 3.1-3.3: the turn is the call, ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` or
    alone), several separated by ``;``. A turn of prose has none."""
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    body = body.removesuffix("<|eom_id|>").removesuffix("<|eot_id|>").strip()
    if not body.startswith("{"):
        return
    try:  # one object, or several joined by ';' (split only when the whole is not one)
        parts = [body] if isinstance(_json(body), dict) else body.split(";")
    except ValueError:
        parts = body.split(";")
    for part in parts:
        yield _json_object_call(part.strip(), ("parameters", "arguments"))


_DS_CALL, _DS_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _deepseek_v3(body: str) -> _Raw:
    """DeepSeek-V3: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``;
    V3.1 and later: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``."""
    head, sep, rest = body.partition(_DS_SEP)
    if not sep:
        return _Raw("", "", f"no {_DS_SEP} in the tool call")
    if head.strip() == "function" and "```" in rest:  # V3: the name, then the arguments in a json fence
        name, _, fenced = rest.partition("\n")
        return _Raw(name.strip(), fenced.strip().removeprefix("```json").removesuffix("```").strip())
    return _Raw(head.strip(), rest.strip())


def _kimi_k2(body: str) -> _Raw:
    """Kimi-K2: ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>``; the
    ``functions.NAME:INDEX`` is the call's id, which its result names."""
    call_id, sep, arguments = body.partition("<|tool_call_argument_begin|>")
    if not sep:
        return _Raw("", "", "no <|tool_call_argument_begin|> in the call")
    call_id = call_id.strip()
    return _Raw(call_id.removeprefix("functions.").rsplit(":", 1)[0], arguments.strip(), id=call_id)


def _gpt_oss(body: str) -> _Raw:
    """gpt-oss (harmony): ``...commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``; the
    recipient may also come before ``<|channel|>``."""
    header, sep, arguments = body.partition("<|message|>")
    name = (header.split("<|", 1)[0].split() or [""])[0]
    return _Raw(name, arguments.strip()) if sep else _Raw("", "", "no <|message|> in the call")


def _mistral(text: str) -> Iterator[_Raw]:
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers), or
    ``[TOOL_CALLS]NAME[ARGS]{...}`` once per call (v11 and later; ``[CALL_ID]ID`` may precede ``[ARGS]``)."""
    marker = "[TOOL_CALLS]"
    if marker not in text:
        return
    first = text.split(marker, 1)[1].lstrip()
    if first.startswith("["):
        try:
            calls = _json(first.removesuffix("</s>").strip())
        except ValueError as err:
            yield _Raw("", "", f"the tool calls are not a JSON list ({err})")
            return
        yield from map(_object_call, calls if isinstance(calls, list) else [calls])
        return
    for part in text.split(marker)[1:]:
        head, sep, arguments = part.partition("[ARGS]")
        if not sep:
            yield _Raw("", "", "no [ARGS] in the call")
            continue
        name, _, call_id = (p.strip() for p in head.partition("[CALL_ID]"))
        yield _Raw(name, arguments.removesuffix("</s>").strip(), id=call_id)


FORMATS: dict[str, Callable[[str], Iterator[_Raw]]] = {
    "hermes": _between("<tool_call>", "</tool_call>", _hermes),
    "qwen3_coder": _between("<tool_call>", "</tool_call>", _qwen3_coder),
    "llama3_json": _llama3_json,
    "deepseek_v3": _between(_DS_CALL, _DS_END, _deepseek_v3),
    "glm45": _between("<tool_call>", "</tool_call>", _glm45),
    "kimi_k2": _between("<|tool_call_begin|>", "<|tool_call_end|>", _kimi_k2),
    "gpt_oss": _between("to=functions.", "<|call|>", _gpt_oss),
    "mistral": _mistral,
}

# Markers of each format in a chat template, the more specific first (Qwen3-Coder's and GLM's calls sit in
# Hermes's <tool_call> tags; Llama's templates name the ipython role that reads tool results), each checked on the
# family's real template (tests/data/chat_templates).
_MARKERS = (
    ("qwen3_coder", ("<function=",)),
    ("glm45", ("<arg_key>",)),
    ("hermes", ("<tool_call>",)),
    ("deepseek_v3", ("tool▁call▁begin",)),
    ("kimi_k2", ("<|tool_call_begin|>",)),
    ("gpt_oss", ("<|channel|>", "<|call|>")),  # its template writes "to=" and "functions." apart
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ("<|start_header_id|>", "ipython")),
)


def detect_format(chat_template: str | None) -> str:
    """The format whose markers the chat template writes; Hermes where it shows none (SmolLM2's, for one)."""
    template = chat_template or ""
    return next((name for name, marks in _MARKERS if all(m in template for m in marks)), "hermes")


def resolve_format(key: str, value: str, chat_template: str | None) -> str:
    """``value`` of the config key ``key``: ``auto`` (from the chat template) or one of :data:`FORMATS`."""
    if value == "auto":
        return detect_format(chat_template)
    if value not in FORMATS:
        raise ValueError(f"{key}={value!r}: expected 'auto' or one of {sorted(FORMATS)}")
    return value


def parameter_types(schemas: list[dict]) -> dict[str, dict[str, str]]:
    """``{tool: {parameter: JSON type}}`` from OpenAI-style tool schemas: what XML parameter strings become."""
    types = {}
    for schema in schemas:
        function = schema.get("function", schema)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {k: v.get("type", "string") for k, v in properties.items()}
    return types


def _json(text: str):
    """``text`` as JSON, or the reason it is not: too long, malformed, nested too deep (RecursionError), or a
    number past Python's digit limit (ValueError); nothing the model writes raises past here."""
    if len(text) > MAX_CALL_CHARS:
        raise ValueError(f"it is {len(text)} characters, more than the {MAX_CALL_CHARS} allowed")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{err.msg} at character {err.pos}") from None
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{type(err).__name__}: {str(err)[:200]}") from None


def _typed(values: dict[str, str], types: dict[str, str]) -> dict:
    """XML parameter strings as their schema types: JSON for numbers, booleans, objects and arrays (left a string
    when it is not, for the tool's own check to name), text for strings and parameters no schema types."""
    out = {}
    for key, value in values.items():
        if len(value) > MAX_CALL_CHARS:
            raise ValueError(f"parameter {key!r} is {len(value)} characters, more than the {MAX_CALL_CHARS} allowed")
        kind, text = types.get(key), value.strip()
        if kind == "boolean" and text.lower() in ("true", "false"):  # templates render Python's True too
            out[key] = text.lower() == "true"
            continue
        try:
            out[key] = _json(text) if kind in JSON_TYPES else value
        except ValueError:
            out[key] = value
    return out


def _call(raw: _Raw, types: dict[str, dict[str, str]]) -> ToolCall:
    if raw.error:
        return ToolCall(raw.name[:100], {}, raw.error, "parse")
    if not raw.name:
        return ToolCall("", {}, "the tool call names no function", "parse")
    try:
        if isinstance(raw.arguments, dict):
            arguments = _typed(raw.arguments, types.get(raw.name, {}))
        else:
            arguments = _json(raw.arguments) if raw.arguments.strip() else {}
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments = _json(arguments)
    except ValueError as err:
        return ToolCall(raw.name[:100], {}, f"the arguments are not JSON ({err})", "parse")
    if not isinstance(arguments, dict):
        return ToolCall(raw.name[:100], {}, '"arguments" must be a JSON object', "parse")
    return ToolCall(raw.name, arguments, id=raw.id[:MAX_ID_CHARS])


def call_ids(calls: list[ToolCall], prefix: str) -> list[str]:
    """The id each call's result names: the model's own where its format writes one, else ``{prefix}_{i}``, with
    ``prefix`` ``call_<trajectory>_<turn>`` (OpenAI's style; 9 characters at least, and the last 9 unique within
    the trajectory, which is what Mistral's templates keep)."""
    return [c.id or f"{prefix}_{i}" for i, c in enumerate(calls)]


def openai_tool_calls(calls: list[ToolCall], ids: list[str]) -> list[dict]:
    """``calls`` as an OpenAI assistant message's ``tool_calls`` (arguments as JSON text)."""
    return [
        {"id": i, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c, i in zip(calls, ids, strict=True)
    ]


def parse_tool_calls(
    text: str, max_calls: int, fmt: str = "hermes", schemas: list[dict] | None = None
) -> list[ToolCall]:
    """The first ``max_calls`` tool calls of an assistant turn written in ``fmt`` (one of :data:`FORMATS`), in
    order, and one error call when there were more; a malformed one (not JSON, too long, no name, arguments not an
    object, unclosed) comes back with its ``error``. ``schemas`` (the tools') type XML formats' parameters."""
    types, calls = parameter_types(schemas or []), []
    for raw in FORMATS[fmt](text):
        if len(calls) == max_calls:
            error = f"more than {max_calls} tool calls in one turn; only the first {max_calls} were made"
            calls.append(ToolCall("", {}, error, "too_many_calls"))
            break
        calls.append(_call(raw, types))
    return calls
