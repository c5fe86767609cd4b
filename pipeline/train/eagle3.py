"""EAGLE-3 draft (SafeAILab layout): fc fuses three target layers' outputs; one `midlayer` whose
attention reads [input_layernorm(embed(token)), hidden_norm(feature)] (2H wide); a final norm; the
target's LM head (full vocabulary, so no d2t/t2d; the LM head is omitted and filled by the converter).

Step 0 at position j reads fc(g_j), g_j = the pre-norm residual streams after target layers
(1, L/2 - 1, L - 4) at j, with token_{j+1}; deeper steps feed the draft's own pre-norm output (no fc).
Trained on the target's token distribution alone (no feature regression), unrolled like EAGLE-3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from pipeline.train.distill import DistillSet
from pipeline.train.eagle import eagle_config, unrolled_depth_hits, unrolled_loss
from pipeline.train.llama_layer import MLP, Attention, LayerShape, RMSNorm, rope_tables, shift_right
from pipeline.train.losses import soft_cross_entropy
from pipeline.train.target import FrozenHead

if TYPE_CHECKING:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

WEIGHTS_FILE = "model.safetensors"
FUSED_LAYERS = 3


class Eagle3Layer(nn.Module):
    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape, 2 * shape.hidden)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden, shape.rms_eps)
        self.hidden_norm = RMSNorm(shape.hidden, shape.rms_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.rms_eps)

    def forward(self, embed, feature, cos, sin, keys, values) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(embed), self.hidden_norm(feature)), dim=-1)
        h = feature + self.self_attn(x, cos, sin, keys, values)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(FUSED_LAYERS * shape.hidden, shape.hidden, bias=False)
        self.midlayer = Eagle3Layer(shape)
        self.norm = RMSNorm(shape.hidden, shape.rms_eps)

    def init_from(self, target_layer: LlamaDecoderLayer, target_norm: LlamaRMSNorm) -> None:
        """MLP, o_proj and norms from the target; q/k/v take the target's weights on both input halves."""
        src = target_layer.state_dict()
        layer = self.midlayer
        with torch.no_grad():
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(src[f"mlp.{name}.weight"])
            layer.self_attn.o_proj.weight.copy_(src["self_attn.o_proj.weight"])
            for name in ("q_proj", "k_proj", "v_proj"):
                w = src[f"self_attn.{name}.weight"]
                getattr(layer.self_attn, name).weight.copy_(torch.cat((w, w), dim=1) * 0.5)
            for norm in ("input_layernorm", "hidden_norm"):
                getattr(layer, norm).weight.copy_(src["input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(src["post_attention_layernorm.weight"])
            self.norm.weight.copy_(target_norm.weight)

    def unroll(self, frozen: FrozenHead, tokens: torch.Tensor, fused: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Pre-norm outputs of each unrolled step (apply `self.norm` before the LM head)."""
        embed = frozen.embed_tokens(F.pad(tokens[:, 1:], (0, 1)))
        cos, sin = rope_tables(tokens.shape[1], self.shape.head_dim, self.shape.rope_theta, tokens.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        feature = self.fc(fused.to(self.fc.weight.dtype))
        outs = []
        for _ in range(steps):
            h = self.midlayer(embed.to(feature.dtype), feature, cos, sin, keys, values)
            outs.append(h)
            feature = shift_right(h, 1)
        return outs


def eagle3_loss(draft: Eagle3Draft, frozen: FrozenHead, batch: DistillSet, steps: int) -> torch.Tensor:
    outs = draft.unroll(frozen, batch.tokens, batch.aux_batch, steps)
    return unrolled_loss(
        outs, batch, lambda h, teacher: soft_cross_entropy(frozen.logits(draft.norm(h)), frozen.logits(teacher))
    )


@torch.no_grad()
def eagle3_depth_hits(
    draft: Eagle3Draft, frozen: FrozenHead, data: DistillSet, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return unrolled_depth_hits(draft.unroll(frozen, data.tokens, data.aux_batch, depth), frozen, data, draft.norm)


def save_eagle3(
    draft: Eagle3Draft,
    folder: Path,
    vocab_size: int,
    max_positions: int,
    fused_layers: tuple[int, ...],
    dtype: torch.dtype,
) -> None:
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in draft.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = eagle_config(draft.shape, vocab_size, max_positions, 1)
    config.update(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": vocab_size,
            "fused_target_layer_outputs": list(fused_layers),
            "lm_head_omitted": True,
        }
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
