"""Tool calls in each model family's format (mcore_rl/agent/tool_calls.py): written by the family's chat template
(tests/data/chat_templates) or as its model card documents it, read back exactly, typed by the tools' schemas; and
text the policy may write instead (cut short, corrupted, hostile) never raises and never becomes a call silently."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mcore_rl.agent.tool_calls import FORMATS, ToolCall, call_ids, detect_format, parse_tool_calls, resolve_format

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
SCHEMAS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Find a record.",
        "parameters": {"type": "object", "properties": {
            "id": {"type": "integer"}, "tags": {"type": "array"}, "exact": {"type": "boolean"}, "note": {"type": "string"}}}}},
]  # fmt: skip
# A string that looks like a number stays a string where the schema says string; the rest are typed.
CALLS = [("calculator", {"expression": "3 * (4 + 5)"}), ("lookup", {"id": 42, "tags": ["a", "b"], "exact": True})]
USER = [{"role": "user", "content": "What is 3 * (4 + 5)?"}]


def _render(template: str, messages: list[dict], generation: bool = False) -> str:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template(template)
    return compiled.render(messages=messages, tools=SCHEMAS, add_generation_prompt=generation, bos_token="<s>",
                           eos_token="</s>")  # fmt: skip


# The ids of CALLS where the format writes them: Kimi-K2's name the function and the call's place; Mistral's are
# 9 characters (its templates keep the last 9 of an id).
IDS = {"kimi_k2": ["functions.calculator:0", "functions.lookup:1"], "mistral": ["a1b2c3d4e", "f5g6h7i8j"]}


def _expected(fmt: str, calls=CALLS, ids=None) -> list[ToolCall]:
    ids = ids or IDS.get(fmt, [""] * len(CALLS))
    return [ToolCall(n, a, id=ids[CALLS.index((n, a))]) for n, a in calls]


def _assistant_turn(template: str, calls: list[tuple[str, dict]], fmt: str = "") -> str:
    """What the template renders for an assistant message with ``calls``: the text after the generation prompt."""
    ids = IDS.get(fmt, [f"call{i:06d}x" for i in range(len(CALLS))])
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": ids[CALLS.index((name, arguments))], "type": "function",
         "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls
    ]}  # fmt: skip
    full, prefix = _render(template, [*USER, message]), _render(template, USER, generation=True)
    return full[len(os.path.commonprefix([full, prefix])) :]


@pytest.mark.parametrize(
    "fmt, file, calls",
    [("qwen3_coder", "qwen3_coder.jinja", CALLS),
     ("glm45", "glm45.jinja", CALLS),
     ("deepseek_v3", "deepseek_v3.jinja", CALLS),
     ("llama3_json", "llama3.1_json.jinja", CALLS[1:]),  # one call per turn in Llama 3.1's format
     ("kimi_k2", "kimi_k2_thinking.jinja", CALLS),
     ("mistral", "mistral_small_3.1.jinja", CALLS),
     ("gpt_oss", "gpt_oss.jinja", CALLS[1:])],  # gpt-oss's template renders a message's first call only
)  # fmt: skip
def test_each_family_s_template_writes_calls_its_format_reads_back(fmt, file, calls):
    template = (TEMPLATES / file).read_text()
    assert detect_format(template) == fmt
    turn = _assistant_turn(template, calls, fmt)
    assert parse_tool_calls(turn, 8, fmt, SCHEMAS) == _expected(fmt, calls), turn


# As each model card documents its format (their templates are not shipped: tests/data/chat_templates/README.md).
DOCUMENTED = {
    "hermes": '<think>\n</think>\nLet me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": '
    '"3 * (4 + 5)"}}\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"id": 42, "tags": ["a", "b"], '
    '"exact": true}}\n</tool_call><|im_end|>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>"
    '{"expression": "3 * (4 + 5)"}<|tool_call_end|><|tool_call_begin|>functions.lookup:1'
    '<|tool_call_argument_begin|>{"id": 42, "tags": ["a", "b"], "exact": true}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>",
    "gpt_oss": "<|channel|>analysis<|message|>Two tools to call.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.calculator <|constrain|>json<|message|>{"expression": "3 * (4 + 5)"}<|call|>'
    '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"id": 42, "tags": ["a", "b"], '
    '"exact": true}<|call|>',
    "mistral": '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}, "id": "a1b2c3d4e"}, '
    '{"name": "lookup", "arguments": {"id": 42, "tags": ["a", "b"], "exact": true}, "id": "f5g6h7i8j"}]</s>',
    "mistral_v11": '[TOOL_CALLS]calculator[ARGS]{"expression": "3 * (4 + 5)"}[TOOL_CALLS]lookup[CALL_ID]f5g6h7i8j'
    '[ARGS]{"id": 42, "tags": ["a", "b"], "exact": true}</s>',
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>"
    '{"expression": "3 * (4 + 5)"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>lookup<｜tool▁sep｜>{"id": 42, '
    '"tags": ["a", "b"], "exact": true}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
}
FORMAT_OF = {"mistral_v11": "mistral", "deepseek_v31": "deepseek_v3"}


@pytest.mark.parametrize("name", DOCUMENTED)
def test_each_documented_format_is_read_back(name):
    fmt = FORMAT_OF.get(name, name)
    ids = ["", "f5g6h7i8j"] if name == "mistral_v11" else None  # v11 writes [CALL_ID] where it has one
    assert parse_tool_calls(DOCUMENTED[name], 8, fmt, SCHEMAS) == _expected(fmt, ids=ids)


def _well_formed() -> dict[str, str]:
    """One turn with both calls per format (rendered by a template where one is shipped)."""
    texts = {FORMAT_OF.get(k, k): v for k, v in DOCUMENTED.items() if k not in FORMAT_OF}
    for fmt, file in (
        ("qwen3_coder", "qwen3_coder.jinja"),
        ("glm45", "glm45.jinja"),
        ("deepseek_v3", "deepseek_v3.jinja"),
        ("kimi_k2", "kimi_k2_thinking.jinja"),
        ("mistral", "mistral_small_3.1.jinja"),
    ):
        texts[fmt] = _assistant_turn((TEMPLATES / file).read_text(), CALLS, fmt)
    texts["llama3_json"] = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "3 * (4 + 5)"}}; ' + (
        '{"name": "lookup", "parameters": {"id": 42, "tags": ["a", "b"], "exact": true}}<|eom_id|>'
    )
    assert sorted(texts) == sorted(FORMATS)
    return texts


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_turn_cut_anywhere_or_corrupted_never_raises_or_makes_a_call_it_did_not_finish(fmt):
    """Every prefix of a well-formed turn (a response that ran out of tokens) parses without raising, and a call
    it makes is one of the two written, whole; so do corrupted copies (a character dropped, doubled or swapped)."""
    text = _well_formed()[fmt]
    whole = _expected(fmt)
    assert parse_tool_calls(text, 8, fmt, SCHEMAS) == whole
    variants = [text[:i] for i in range(len(text))]
    variants += [text[:i] + text[i + 1 :] for i in range(0, len(text), 3)]
    variants += [text[:i] + text[i] + text[i:] for i in range(0, len(text), 5)]
    variants += [text[:i] + "<|" + text[i:] for i in range(0, len(text), 7)]
    for variant in variants:
        calls = parse_tool_calls(variant, 8, fmt, SCHEMAS)
        assert all(isinstance(c, ToolCall) for c in calls)
        made = [c for c in calls if not c.error]
        assert all(isinstance(c.arguments, dict) and isinstance(c.name, str) for c in made)
        if variant == text[: len(variant)]:  # a prefix: no half-written call is made
            assert all(c in whole for c in made), (variant, made)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_hostile_arguments_are_errors_and_calls_are_capped(fmt):
    deep, long_ = "[" * 30_000 + "]" * 30_000, '{"expression": "' + "9" * 70_000 + '"}'
    for arguments in (deep, long_):
        turn = _well_formed()[fmt].replace('{"expression": "3 * (4 + 5)"}', arguments, 1)
        if turn == _well_formed()[fmt]:  # the XML formats write parameters, not JSON
            turn = turn.replace("3 * (4 + 5)", "9" * 70_000, 1)
        calls = parse_tool_calls(turn, 8, fmt, SCHEMAS)
        assert calls and calls[0].error and calls[0].kind == "parse", (fmt, calls[:1])
    many = parse_tool_calls(_well_formed()[fmt] * 10, 3, fmt, SCHEMAS)
    assert len(many) <= 4 and (len(many) < 4 or many[3].kind == "too_many_calls")
    assert parse_tool_calls("The answer is 27.", 8, fmt, SCHEMAS) == []


def test_the_format_comes_from_the_template_or_the_key():
    assert detect_format(None) == detect_format("{{ messages }}") == "hermes"  # no markers: Hermes instructions
    assert detect_format("... '<|tool_call_begin|>' ...") == "kimi_k2"
    assert detect_format("<|start|>assistant<|channel|>commentary to=functions.x<|call|>") == "gpt_oss"
    assert detect_format("{{ '[TOOL_CALLS] [' }}") == "mistral"
    assert resolve_format("k", "auto", (TEMPLATES / "glm45.jinja").read_text()) == "glm45"
    assert resolve_format("k", "kimi_k2", None) == "kimi_k2"
    with pytest.raises(ValueError, match=r"multi_turn\.tool_format='json': expected 'auto' or one of \["):
        resolve_format("multi_turn.tool_format", "json", None)


def test_a_result_names_the_model_s_call_id_or_one_whose_last_nine_characters_are_unique():
    calls = [ToolCall("a", {}, id="functions.a:0"), ToolCall("b", {}), ToolCall("", {}, "malformed", "parse")]
    assert call_ids(calls, "call_7_2") == ["functions.a:0", "call_7_2_1", "call_7_2_2"]
    # Mistral's templates keep an id's last 9 characters: those of a trajectory's generated ids differ
    ids = [i for turn in range(300) for i in call_ids([ToolCall("b", {})] * 8, f"call_123456_{turn}")]
    assert len({i[-9:] for i in ids}) == len(ids) == 2400 and min(map(len, ids)) >= 9
