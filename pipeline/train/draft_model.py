"""A small Llama draft model distilled from the target: a few of the target's layers, its embedding
and LM head (tied, frozen, never saved), trained on KL to the target's distribution.

Saved as a Hugging Face folder whose model.safetensors lacks model.embed_tokens.weight and
lm_head.weight: the converter fills both from the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from pipeline.train.distill import DistillSet, teacher_mask
from pipeline.train.eval import depth_valid
from pipeline.train.losses import soft_cross_entropy
from pipeline.train.target import FrozenHead, rope_theta

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

WEIGHTS_FILE = "model.safetensors"
SHARED_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def build_draft_model(target: LlamaForCausalLM, layer_ids: tuple[int, ...]) -> LlamaForCausalLM:
    """A LlamaForCausalLM with the target's config but `layer_ids` of its layers (copied) and its final norm;
    the embedding is the target's own tensor, frozen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    t = target.config
    cfg = LlamaConfig(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=len(layer_ids),
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings,
        rope_parameters={"rope_theta": rope_theta(t), "rope_type": "default"},
        bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id,
        pad_token_id=t.pad_token_id,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )
    draft = LlamaForCausalLM(cfg)
    # PreTrainedModel.to is decorated with functools.wraps(Module.to), which typeshed types as unbound (self first)
    draft.to(next(target.parameters()).device)  # type: ignore[arg-type]
    with torch.no_grad():
        for mine, src in zip(draft.model.layers, layer_ids):
            mine.load_state_dict(target.model.layers[src].state_dict())
        draft.model.norm.weight.copy_(target.model.norm.weight)
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight  # shared and frozen (tied to lm_head)
    draft.lm_head.weight = target.model.embed_tokens.weight
    return draft


def trainable(draft: LlamaForCausalLM) -> list[nn.Parameter]:
    shared = {id(draft.model.embed_tokens.weight)}
    return [p for p in draft.parameters() if id(p) not in shared]


def draft_loss(draft: LlamaForCausalLM, frozen: FrozenHead, batch: DistillSet) -> torch.Tensor:
    """KL to the target at every position with a target token, prompt included (the draft reads it too)."""
    mask = teacher_mask(batch, 0, include_prompt=True)
    hidden = draft.model(input_ids=batch.tokens, use_cache=False).last_hidden_state
    return soft_cross_entropy(frozen.logits(hidden[mask]), frozen.logits(batch.feature_batch[mask]))


@torch.no_grad()
def draft_depth_hits(
    draft: LlamaForCausalLM, frozen: FrozenHead, data: DistillSet, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """With the target's tokens as context, depth k of the chain rooted at j is the draft's guess at j + k."""
    greedy = frozen.logits(data.feature_batch).argmax(-1)
    hidden = draft.model(input_ids=data.tokens, use_cache=False).last_hidden_state
    hit = frozen.logits(hidden).argmax(-1) == greedy
    width = greedy.shape[1]
    correct = torch.zeros((*greedy.shape, depth), dtype=torch.bool, device=greedy.device)
    for k in range(depth):
        correct[:, : width - 1 - k, k] = hit[:, 1 + k :]
    return correct, depth_valid(data.lengths, data.prompt_lens, width, depth)


def save_draft_model(draft: LlamaForCausalLM, folder: Path, source_layers: tuple[int, ...], dtype: torch.dtype) -> None:
    tensors = {
        k: v.detach().to(dtype).contiguous().cpu() for k, v in draft.state_dict().items() if k not in SHARED_TENSORS
    }
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    rope = draft.config.rope_parameters
    assert rope is not None  # build_draft_model sets it
    config = draft.config.to_dict()
    config.update(
        {
            "rope_theta": rope["rope_theta"],
            "torch_dtype": str(dtype).removeprefix("torch."),
            "specpipe_shared_from_target": list(SHARED_TENSORS),
            "specpipe_initialised_from_target_layers": list(source_layers),
        }
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
