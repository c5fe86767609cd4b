"""EAGLE-1/2 draft (SafeAILab layout): fc over [embedding, feature] and Llama layers (the first without an
input norm), predicting the target's next final feature; the target's LM head turns it into a token.

At position j the draft reads x_j = fc([embed(token_{j+1}), f_j]) and its output h_j approximates
f_{j+1}, so lm_head(h_j) predicts token_{j+2}. Deeper draft steps feed h_j back as the feature.
Training unrolls `steps` such steps (see llama_layer's unrolled attention) so the draft also learns
to read its own, imperfect, features.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from pipeline.train.distill import DistillSet, unrolled_masks
from pipeline.train.eval import depth_valid
from pipeline.train.llama_layer import MLP, Attention, LayerShape, RMSNorm, rope_tables, shift_right
from pipeline.train.losses import feature_regression, soft_cross_entropy, step_weights
from pipeline.train.target import FrozenHead

WEIGHTS_FILE = "model.safetensors"
STEP_DECAY = 0.8  # later unrolled steps weigh less (EAGLE-3's training-time-test weighting)
TOKEN_LOSS_WEIGHT = 0.1  # EAGLE's w_cls against w_reg = 1


class EagleLayer(nn.Module):
    """A Llama decoder layer. A draft's first has no input_layernorm (fc's output goes straight into
    attention); later ones have theirs."""

    def __init__(self, shape: LayerShape, input_norm: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.rms_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(shape, shape.hidden)
        self.mlp = MLP(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.rms_eps)

    def forward(self, x, cos, sin, keys, values) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, keys, values)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleDraft(nn.Module):
    def __init__(self, shape: LayerShape, num_layers: int = 1) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(2 * shape.hidden, shape.hidden, bias=True)
        self.layers = nn.ModuleList(EagleLayer(shape, input_norm=i > 0) for i in range(num_layers))

    def start_as_identity(self, first: int) -> None:
        """Zero the projections that write the residual stream in layers `first` on: they pass their input
        through, so a draft grown from a trained shallower one starts where that one ended."""
        for layer in self.layers[first:]:
            assert isinstance(layer, EagleLayer)
            nn.init.zeros_(layer.self_attn.o_proj.weight)
            nn.init.zeros_(layer.mlp.down_proj.weight)

    def unroll(
        self, frozen: FrozenHead, tokens: torch.Tensor, features: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Outputs h of each unrolled step; step s at position p belongs to the chain rooted at p - s."""
        next_embed = frozen.embed_tokens(F.pad(tokens[:, 1:], (0, 1)))
        cos, sin = rope_tables(tokens.shape[1], self.shape.head_dim, self.shape.rope_theta, tokens.device)
        keys: list[list[torch.Tensor]] = [[] for _ in self.layers]
        values: list[list[torch.Tensor]] = [[] for _ in self.layers]
        feature = features
        outs = []
        for _ in range(steps):
            h = self.fc(torch.cat((next_embed.to(feature.dtype), feature), dim=-1))
            for layer, k, v in zip(self.layers, keys, values):
                h = layer(h, cos, sin, k, v)
            outs.append(h)
            feature = shift_right(h, 1)  # the next step at p continues the chain that was at p - 1
        return outs


def unrolled_loss(
    outs: list[torch.Tensor], batch: DistillSet, step_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Step-weighted mean over unrolled steps of step_loss(draft outputs, teacher features next
    position), both taken at the positions that step trains."""
    teacher = batch.feature_batch[:, 1:]
    weights = step_weights(len(outs), STEP_DECAY)
    total = torch.zeros((), device=batch.tokens.device)
    for s, (h, mask) in enumerate(zip(outs, unrolled_masks(batch, len(outs)))):
        total = total + weights[s] * step_loss(h[:, :-1][mask], teacher[mask])
    return total / sum(weights)


def eagle_loss(draft: EagleDraft, frozen: FrozenHead, batch: DistillSet, steps: int) -> torch.Tensor:
    def step_loss(pred: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        return feature_regression(pred, want) + TOKEN_LOSS_WEIGHT * soft_cross_entropy(
            frozen.logits(pred), frozen.logits(want)
        )

    return unrolled_loss(draft.unroll(frozen, batch.tokens, batch.feature_batch, steps), batch, step_loss)


@torch.no_grad()
def eagle_depth_hits(
    draft: EagleDraft, frozen: FrozenHead, data: DistillSet, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    outs = draft.unroll(frozen, data.tokens, data.feature_batch, depth)
    return unrolled_depth_hits(outs, frozen, data, lambda h: h)


def unrolled_depth_hits(
    outs: list[torch.Tensor], frozen: FrozenHead, data: DistillSet, to_logit_input
) -> tuple[torch.Tensor, torch.Tensor]:
    """correct[n, j, s]: step s of the chain rooted at j (run at position j + s) hits the target's token."""
    greedy = frozen.logits(data.feature_batch).argmax(-1)  # the target's token for position p + 1
    width = greedy.shape[1]
    correct = torch.zeros((*greedy.shape, len(outs)), dtype=torch.bool, device=greedy.device)
    for s, h in enumerate(outs):
        hit = frozen.logits(to_logit_input(h[:, : width - 1])).argmax(-1) == greedy[:, 1:]  # at position p
        correct[:, : width - 1 - s, s] = hit[:, s:]
    return correct, depth_valid(data.lengths, data.prompt_lens, width, len(outs))


def eagle_config(shape: LayerShape, vocab_size: int, max_positions: int, num_layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "rms_norm_eps": shape.rms_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max_positions,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }


def save_eagle(draft: EagleDraft, folder: Path, vocab_size: int, max_positions: int, dtype: torch.dtype) -> None:
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in draft.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = eagle_config(draft.shape, vocab_size, max_positions, len(draft.layers))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
