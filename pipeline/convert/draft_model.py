"""Draft-model speculation: a smaller Llama-family model sharing the target's tokenizer, converted into
its own full checkpoint in `<ckpt>/draft/` (TensorRT-LLM builds it as a plain engine)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.convert.checkpoint import DRAFT_DIR, write_checkpoint
from pipeline.convert.llama import check_parallel, llama_config, llama_tensors
from pipeline.convert.source import (
    TargetSource,
    check_architecture,
    check_weights,
    load_config,
    load_target,
    load_tokenizer,
    read_hf_weights,
    resolve_spec,
)
from pipeline.errors import UserError

# Texts whose token ids must agree between target and draft tokenizers.
TOKENIZER_PROBES = ("Hello world!", "The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b")
SHARED_WITH_TARGET = ("model.embed_tokens.weight", "lm_head.weight")


def load_draft(spec: str, target: TargetSource) -> TargetSource:
    """Load a draft; a folder without embed_tokens/lm_head (trained drafts commit only their own layers)
    or without a tokenizer borrows them from the target, with a note."""
    path = resolve_spec(spec)
    if path.is_file():
        return load_target(path)
    config = load_config(path)
    check_architecture(config, path)
    weights = {k: v.float() for k, v in read_hf_weights(path).items()}
    borrowed = [
        n for n in SHARED_WITH_TARGET if n not in weights and not (n == "lm_head.weight" and config.tie_word_embeddings)
    ]
    for name in borrowed:
        weights[name] = target.lm_head if name == "lm_head.weight" else target.state_dict[name]
    if borrowed:
        print(f"note: {path}: no {' / '.join(borrowed)}; using the target's")
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
    if not has_tokenizer:
        print(f"note: {path}: no tokenizer files; using the target's tokenizer")
    tokenizer = load_tokenizer(path) if has_tokenizer else target.tokenizer
    check_weights(config, weights, path)
    return TargetSource(str(spec), config, weights, tokenizer)


def check_same_vocabulary(draft: TargetSource, target: TargetSource) -> None:
    if draft.config.vocab_size != target.config.vocab_size:
        raise UserError(
            f"{draft.spec}: draft vocab_size {draft.config.vocab_size} differs from the target's "
            f"{target.config.vocab_size}; a draft model must share the target's tokenizer"
        )
    for text in TOKENIZER_PROBES:
        a, b = draft.tokenizer(text).input_ids, target.tokenizer(text).input_ids
        if a != b:
            raise UserError(
                f"{draft.spec}: the draft tokenizer encodes {text!r} as {a[:8]} but the target as {b[:8]}; "
                "a draft model must share the target's tokenizer"
            )
    if draft.tokenizer.eos_token_id != target.tokenizer.eos_token_id:
        raise UserError(
            f"{draft.spec}: draft eos id {draft.tokenizer.eos_token_id} differs from the target's "
            f"{target.tokenizer.eos_token_id}; a draft model must share the target's tokenizer"
        )


def write_draft_model(ckpt_dir: Path, target: TargetSource, spec: str, dtype: torch.dtype, tp: int) -> None:
    """The draft's own checkpoint in ckpt_dir/draft/ (same tp; one pipeline stage: drafts are small)."""
    draft = load_draft(spec, target)
    check_same_vocabulary(draft, target)
    check_parallel(draft.config, tp, 1, what="draft model")
    write_checkpoint(ckpt_dir / DRAFT_DIR, llama_config(draft.config, dtype, tp, 1), llama_tensors(draft, dtype))
