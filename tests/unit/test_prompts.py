"""Prompt datasets: JSONL and Parquet rows with named errors, chat-template tokenisation, a seeded resumable order."""

from __future__ import annotations

import json

import pytest
import transformers

from converters.gguf2hf import default_model_dir
from mcore_rl.data.arithmetic import arithmetic_splits
from mcore_rl.data.prompts import PromptDataset, read_jsonl, read_rows, write_jsonl


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model_dir())


def test_arithmetic_splits_are_seeded_disjoint_and_correct():
    train, evaluation = arithmetic_splits(200, 50, seed=3)
    assert (train, evaluation) == arithmetic_splits(200, 50, seed=3)
    questions = [r.messages[0]["content"] for r in train + evaluation]
    assert len(set(questions)) == 250
    for r in train[:20]:
        a, op, b = r.messages[0]["content"].removeprefix("What is ").split("?")[0].split()
        assert int(r.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    with pytest.raises(ValueError, match="only 8 distinct questions with max_operand=1"):
        arithmetic_splits(8, 1, seed=0, max_operand=1)


def test_jsonl_roundtrip_and_errors_name_file_and_line(tmp_path):
    rows, _ = arithmetic_splits(5, 0, seed=0)
    path = write_jsonl(rows, tmp_path / "train.jsonl")
    assert read_jsonl(path) == rows
    bad = [
        ('{"messages": [{"role": "user", "content": "hi"}], "answer": 1}\n{"messages": "hi", "answer": 1}\n', ":2:"),
        ('{"messages": [{"role": "user"}], "answer": 1}\n', "messages\\[0\\] must be an object"),
        ('{"messages": [{"role": "user", "content": "x"}]}\n', "'answer' must be a string or a number"),
        ("{not json\n", ":1: malformed JSON"),
    ]
    for text, message in bad:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_jsonl(path)
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_parquet_rows_read_like_jsonl_and_errors_name_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, _ = arithmetic_splits(3, 0, seed=0)
    table = [{"id": r.id, "messages": r.messages, "answer": r.answer} for r in rows]
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "train.parquet")
    assert read_rows(tmp_path / "train.parquet") == rows
    table[2]["answer"] = None
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: row 2: 'answer' must be a string or a number"):
        read_rows(tmp_path / "bad.parquet")


def test_dataset_drops_overlong_prompts_and_resumes_at_a_position(tokenizer):
    rows, _ = arithmetic_splits(10, 0, seed=1)
    long_row = rows[0].__class__("long", [{"role": "user", "content": "word " * 500}], "0")
    data = PromptDataset([*rows, long_row], tokenizer, max_prompt_tokens=64, seed=7)
    assert data.dropped == 1 and len(data.prompts) == 10
    first = data.prompts[0]
    text = tokenizer.apply_chat_template(first.row.messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(first.token_ids) == text and text.rstrip().endswith("assistant")
    run = [p.row.id for p in data.batch(0, 25)]  # two and a half epochs
    assert sorted(run[:10]) == sorted(r.id for r in rows) and run[:10] != run[10:20]  # each epoch its own order
    resumed = [p.row.id for p in data.batch(13, 12)]
    assert resumed == run[13:25]
    assert json.dumps(run) == json.dumps([p.row.id for p in PromptDataset(rows, tokenizer, 64, seed=7).batch(0, 25)])


def test_each_word_problem_answer_is_what_the_calculator_tool_computes_from_its_expression():
    """The data computes its answers itself (it does not import the agent's tools); the calculator the policy calls
    agrees on every row."""
    from mcore_rl.agent.tools import Calculator
    from mcore_rl.data.arithmetic import word_problem_splits

    calculator = Calculator()
    train, evaluation = word_problem_splits(300, 50, seed=3)
    for row in train + evaluation:
        assert calculator.call({"expression": row.extra["expression"]}) == row.answer, row.id
        assert int(row.answer) >= 0
