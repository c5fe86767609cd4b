"""Medusa-1 heads on the frozen target (FasterDecoding layout, LM head shared with the target).

Head h is `medusa_num_layers` residual blocks x + SiLU(W x + b) followed by the target's LM head;
applied to the final feature at position t it predicts the token at t + 2 + h (the target's own
LM head predicts t + 1). Each head learns the target's distribution at position t + 1 + h.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from pipeline.train.distill import DistillSet, teacher_mask
from pipeline.train.eval import depth_valid
from pipeline.train.losses import cross_entropy_to, step_weights
from pipeline.train.target import FrozenHead

WEIGHTS_FILE = "medusa_lm_head.safetensors"
HEAD_DECAY = 0.8  # Medusa-1's per-head loss weight lambda_h = 0.8 ** h


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # start as the identity: every head begins as the base head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def build_heads(hidden: int, num_heads: int, num_layers: int) -> nn.ModuleList:
    """State-dict keys `{h}.{l}.linear.weight` / `.bias`, as the converter reads them."""
    return nn.ModuleList(nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads))


def medusa_loss(heads: nn.ModuleList, frozen: FrozenHead, batch: DistillSet, hard_weight: float = 0.0) -> torch.Tensor:
    """Every head's teacher is the target's distribution at some position of its continuation, so one
    softmax over those positions serves all heads: 6 LM-head products a batch instead of 10 (5 heads).

    hard_weight moves that much of the loss onto the teacher's greedy token alone: greedy verification
    accepts a head's guess only when it is that token, while the soft teacher also rewards ranking the
    runners-up of every context a head cannot tell apart."""
    weights = step_weights(len(heads), HEAD_DECAY)
    taught = teacher_mask(batch, 0)  # positions whose distribution some head learns
    row_of = torch.cumsum(taught.flatten(), 0).view_as(taught) - 1  # position -> row of `teacher`
    features = batch.feature_batch
    teacher = torch.softmax(frozen.logits(features[taught]).float(), dim=-1)
    total = torch.zeros((), device=features.device)
    for h, head in enumerate(heads):
        shift = 1 + h
        mask = teacher_mask(batch, shift)[:, : features.shape[1] - shift]
        student = frozen.logits(head(features[:, :-shift][mask]))
        total = total + weights[h] * cross_entropy_to(student, teacher[row_of[:, shift:][mask]], hard_weight)
    return total / sum(weights)


@torch.no_grad()
def medusa_depth_hits(heads: nn.ModuleList, frozen: FrozenHead, data: DistillSet) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth 1 is head 0 (token t + 2): the target's own token t + 1 is always accepted."""
    features = data.feature_batch
    greedy = frozen.logits(features).argmax(-1)  # the target's token for position p + 1
    width = features.shape[1]
    correct = torch.zeros((*greedy.shape, len(heads)), dtype=torch.bool, device=greedy.device)
    for h, head in enumerate(heads):
        guess = frozen.logits(head(features)).argmax(-1)
        correct[:, : width - 1 - h, h] = guess[:, : width - 1 - h] == greedy[:, 1 + h :]
    return correct, depth_valid(data.lengths, data.prompt_lens, width, len(heads))


def save_medusa(
    heads: nn.ModuleList, folder: Path, base_model: str, num_layers: int, vocab_size: int, dtype: torch.dtype
) -> None:
    first = heads[0]
    assert isinstance(first, nn.Sequential)  # build_heads: each head is a Sequential of ResBlocks
    block = first[0]
    assert isinstance(block, ResBlock)
    hidden = block.linear.weight.shape[0]
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in heads.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "medusa_num_heads": len(heads),
        "medusa_num_layers": num_layers,
        "base_model_name_or_path": base_model,
        "hidden_size": hidden,
        "vocab_size": vocab_size,
        "lm_head_omitted": True,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
