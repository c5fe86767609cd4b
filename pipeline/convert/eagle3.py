"""EAGLE-3 draft: validated against the target and kept, in Hugging Face layout, in `<ckpt>/draft/`.

TensorRT-LLM 1.2 has no TensorRT-engine path for EAGLE-3; its PyTorch backend serves it. The target
checkpoint next to the draft is a plain LlamaForCausalLM, and the draft folder written here
(config.json + model.safetensors, the EAGLE-3 reference names) is what TensorRT-LLM expects as the
speculative model:

    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import Eagle3DecodingConfig
    spec = Eagle3DecodingConfig(max_draft_len=63, speculative_model="<ckpt>/draft")
    llm = LLM(model="<target as a Hugging Face folder, e.g. from export_hf_folder>", speculative_config=spec)

Draft layout: fc [H, 3H] over three captured target features; one `midlayer` whose attention reads
2H = concat(norm(embedding), norm(feature)); its own `norm`; an optional lm_head over a draft
vocabulary with `d2t` (target_id = draft_id + d2t[draft_id]) and `t2d` when that vocabulary is smaller.

A draft trained on the whole vocabulary can be given a smaller one here (`draft_vocab`): its LM head keeps the rows
of the tokens most frequent in a token file's responses (frequency-ranked drafting, as FR-Spec; the drafts' training
data in drafts/distill/ holds the target's own greedy replies). The drafter's LM
head is read at every draft depth, a fifth of SmolLM2's weights each time, so this cuts what a draft step reads;
verification still decides every token, so greedy output stays that of the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from pipeline.convert.checkpoint import DRAFT_DIR
from pipeline.convert.source import TargetSource, load_config_dict, read_hf_weights
from pipeline.errors import UserError

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
VOCAB_MAPS = ("d2t", "t2d")  # integer/bool index maps, kept in their own dtype


def expected_eagle3_shapes(draft: dict[str, Any], target_hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    h = draft["hidden_size"]
    heads = draft["num_attention_heads"]
    kv = draft.get("num_key_value_heads") or heads
    d = draft.get("head_dim") or h // heads
    inter = draft["intermediate_size"]
    shapes = {
        "fc.weight": (h, 3 * target_hidden),
        "norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * d),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
    }
    draft_vocab = draft.get("draft_vocab_size") or vocab
    if draft_vocab != vocab:
        shapes["d2t"] = (draft_vocab,)
    return shapes


def validate_eagle3(
    folder: Path, draft: dict[str, Any], weights: dict[str, torch.Tensor], source: TargetSource
) -> None:
    vocab, target_h = source.config.vocab_size, source.config.hidden_size
    for name, shape in expected_eagle3_shapes(draft, target_h, vocab).items():
        if name not in weights:
            raise UserError(f"{folder}: tensor {name} is missing; an EAGLE-3 draft needs it with shape {list(shape)}")
        if tuple(weights[name].shape) != shape:
            raise UserError(
                f"{folder}: tensor {name} has shape {list(weights[name].shape)} but the target needs "
                f"{list(shape)}; this draft was trained for another model"
            )
    draft_vocab = draft.get("draft_vocab_size") or vocab
    if "lm_head.weight" in weights and tuple(weights["lm_head.weight"].shape) != (draft_vocab, draft["hidden_size"]):
        raise UserError(
            f"{folder}: tensor lm_head.weight has shape {list(weights['lm_head.weight'].shape)} but "
            f"draft_vocab_size/hidden_size need {[draft_vocab, draft['hidden_size']]}"
        )
    if draft["hidden_size"] != target_h and "embed_tokens.weight" not in weights:
        raise UserError(
            f"{folder}: hidden_size {draft['hidden_size']} differs from the target's {target_h}, so the draft needs "
            "embed_tokens.weight"
        )


def frequent_tokens(path: str | Path, size: int, vocab: int) -> torch.Tensor:
    """The `size` ids most frequent in a token file, ascending: an .npz of `tokens`, as DistillSet.save_tokens
    writes the drafts' training data (with its `lengths` and `prompt_lens`, only the responses count: the
    target's own greedy continuations, what a draft guesses); ties go to the lower id."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{file}: token file not found; give the .npz of token ids that ranks the draft's vocabulary")
    try:
        data = np.load(file)
        tokens = data["tokens"].astype(np.int64)
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise UserError(
            f"{file}: not a token file ({e}); give an .npz with a 'tokens' array of token ids, "
            f"as the drafts' training data in drafts/distill/"
        ) from None
    if {"lengths", "prompt_lens"} <= set(data.files):
        lengths, prompts = data["lengths"], data["prompt_lens"]
        offsets = np.arange(tokens.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tokens = tokens[offsets >= np.repeat(prompts, lengths)]
    if tokens.size == 0 or tokens.min() < 0 or tokens.max() >= vocab:
        found = f"ids {tokens.min()}-{tokens.max()}" if tokens.size else "no tokens"
        raise UserError(
            f"{file}: {found}, outside the target's vocabulary of {vocab}; give the token file of "
            f"this target's tokenizer"
        )
    counts = torch.from_numpy(np.bincount(tokens, minlength=vocab))
    return torch.sort(torch.argsort(-counts, stable=True)[:size]).values


def reduce_vocab(weights: dict[str, torch.Tensor], kept: torch.Tensor, vocab: int) -> None:
    """weights' LM head (where they have one) to the rows of `kept` (target ids, ascending), with the d2t and t2d
    maps for them."""
    if "lm_head.weight" in weights:
        weights["lm_head.weight"] = weights["lm_head.weight"][kept]
    weights["d2t"] = kept - torch.arange(kept.numel())
    weights["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, kept, True)


def write_eagle3_draft(
    ckpt_dir: Path,
    source: TargetSource,
    path: str,
    dtype: torch.dtype,
    draft_vocab: int | None = None,
    vocab_tokens: str | None = None,
) -> None:
    """Validate the EAGLE-3 draft and write it (in `dtype`) into ckpt_dir/draft/, with a vocabulary of the
    `draft_vocab` tokens most frequent in `vocab_tokens` if given (see frequent_tokens)."""
    vocab = source.config.vocab_size
    if (draft_vocab is None) != (vocab_tokens is None):
        raise UserError(
            "--draft-vocab and --vocab-tokens go together: the size of the draft's vocabulary and the "
            "token file whose most frequent tokens make it"
        )
    if draft_vocab is not None and not 0 < draft_vocab < vocab:
        raise UserError(
            f"--draft-vocab {draft_vocab}: give a size between 1 and {vocab - 1} (the target's vocabulary has {vocab})"
        )
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"{folder}: EAGLE-3 draft folder not found; give the folder with config.json and the weights")
    draft = load_config_dict(folder)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if key not in draft:
            raise UserError(f"{folder}/config.json: missing {key!r}; not an EAGLE-3 draft config")
    weights = read_hf_weights(folder)
    validate_eagle3(folder, draft, weights, source)
    own_vocab = draft.get("draft_vocab_size") or vocab
    if "lm_head.weight" not in weights:
        if own_vocab != vocab:
            raise UserError(
                f"{folder}: no lm_head.weight and draft_vocab_size {own_vocab} differs from the target's vocabulary"
            )
        print(f"note: {folder}: no lm_head.weight; using the target's lm_head")
        weights["lm_head.weight"] = source.lm_head
    if draft_vocab is not None:
        if own_vocab != vocab:
            raise UserError(
                f"{folder}: the draft already has a vocabulary of {own_vocab} tokens; --draft-vocab "
                f"chooses one for drafts over the whole vocabulary ({vocab})"
            )
        assert vocab_tokens is not None  # given together with draft_vocab (checked above)
        reduce_vocab(weights, frequent_tokens(vocab_tokens, draft_vocab, vocab), vocab)
    draft_vocab = draft_vocab or own_vocab
    out = {k: (v if k in VOCAB_MAPS else v.to(dtype)).contiguous() for k, v in weights.items()}
    config = dict(
        draft,
        architectures=[EAGLE3_ARCHITECTURE],
        draft_vocab_size=draft_vocab,
        torch_dtype=str(dtype).removeprefix("torch."),
        target_hidden_size=source.config.hidden_size,
    )
    dst = ckpt_dir / DRAFT_DIR
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
