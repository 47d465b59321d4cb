"""Prompt datasets: JSONL or Parquet rows ``{"messages": [...], "answer": ..., "id": optional}``, tokenised with the model's
chat template, served in a seeded order whose position is one integer (saved in checkpoints, so a resumed run
sees exactly the batches an uninterrupted one would)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class PromptRow:
    id: str
    messages: list[dict]
    answer: str
    extra: dict = field(default_factory=dict)  # the row's other fields, for environments

    def as_dict(self) -> dict:
        """The row as the dataset holds it (what an environment's ``reset`` gets)."""
        return {"id": self.id, "messages": self.messages, "answer": self.answer, **self.extra}


def _check_row(row, where: str) -> PromptRow:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    if "answer" not in row or isinstance(row["answer"], dict | list) or row["answer"] is None:
        raise ValueError(f"{where}: 'answer' must be a string or a number")
    extra = {k: v for k, v in row.items() if k not in ("id", "messages", "answer")}
    return PromptRow(str(row.get("id", where)), messages, str(row["answer"]), extra)


def read_jsonl(path: str | Path) -> list[PromptRow]:
    """All rows of a JSONL file; a malformed row is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: dataset file not found")
    rows = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: malformed JSON ({err.msg})") from None
            rows.append(_check_row(row, where))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def read_parquet(path: str | Path) -> list[PromptRow]:
    """All rows of a Parquet file (columns ``messages``, ``answer``, optional ``id``); errors name the row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: dataset file not found")
    try:
        table = pq.read_table(path)
    except pa.ArrowException as err:
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from None
    rows = [_check_row(row, f"{path}: row {i}") for i, row in enumerate(table.to_pylist())]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def read_rows(path: str | Path) -> list[PromptRow]:
    """A dataset file by its suffix: ``.parquet``, else JSONL."""
    return read_parquet(path) if Path(path).suffix == ".parquet" else read_jsonl(path)


def write_jsonl(rows: Iterable[PromptRow], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r.as_dict()) + "\n")
    return path


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt as the model's chat template renders it, ending with the assistant turn's opening."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@dataclass(frozen=True)
class Prompt:
    row: PromptRow
    token_ids: list[int]


class PromptDataset:
    """Tokenised prompts (overlong ones dropped and counted) in a seeded order, epoch after epoch."""

    def __init__(self, rows: list[PromptRow], tokenizer, max_prompt_tokens: int, seed: int, shuffle: bool = True):
        self.prompts, self.dropped = [], 0
        for row in rows:
            ids = list(chat_token_ids(tokenizer, row.messages))
            if len(ids) > max_prompt_tokens:
                self.dropped += 1
            else:
                self.prompts.append(Prompt(row, ids))
        if not self.prompts:
            raise ValueError(
                f"every prompt is longer than max_prompt_tokens={max_prompt_tokens} (models.policy.max_prompt_tokens)"
            )
        self.seed, self.shuffle = seed, shuffle
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def _order(self, epoch: int) -> list[int]:
        cached, order = self._epoch_order  # one epoch's order at a time: positions are handed out in order
        if cached != epoch:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return order

    def at(self, position: int) -> Prompt:
        """The prompt at global ``position`` (prompts consumed so far, across epochs)."""
        n = len(self.prompts)
        return self.prompts[self._order(position // n)[position % n]]

    def batch(self, position: int, size: int) -> list[Prompt]:
        """The ``size`` prompts starting at global ``position``."""
        return [self.at(p) for p in range(position, position + size)]
