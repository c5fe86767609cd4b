"""EAGLE-1/2 draft (SafeAILab layout) → an EagleForCausalLM checkpoint (reference §3).

The draft is `fc(concat(token embedding, target feature))` followed by decoder layers whose layer 0
has no input_layernorm; the target's embedding (when the draft has none) and LM head are reused.
TensorRT-LLM keeps num_eagle_layers identical copies of the draft, one per tree depth.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pipeline.convert.llama import DECODER_LAYER_RULES, WeightRule, check_parallel, map_weights
from pipeline.convert.source import TargetSource, load_config_dict, read_hf_weights
from pipeline.errors import UserError

DEFAULT_EAGLE_DRAFT_LEN = 63
DEFAULT_NUM_EAGLE_LAYERS = 4
DEFAULT_MAX_NON_LEAVES = 10
MAX_EAGLE_DRAFT_LEN = 256
EAGLE_COPY = re.compile(r"eagle_nets\.(\d+)\.")


def not_a_later_copy(name: str) -> bool:
    """False for the tensors of the draft's copies past the first (eagle_nets.{i}., i >= 1), which the
    portable engine never reads: loading them would cost num_eagle_layers - 1 drafts' memory."""
    match = EAGLE_COPY.match(name)
    return match is None or match.group(1) == "0"


# Layer 0 of an EAGLE-1 draft has no input_layernorm, so that rule is optional here (checked for l >= 1).
EAGLE_LAYER_RULES: tuple[WeightRule, ...] = tuple(
    WeightRule(
        f"layers.{{i}}.{r.trt}",
        tuple(f"layers.{{i}}.{h}" for h in r.hf),
        r.transform,
        r.optional or r.trt == "input_layernorm.weight",
    )
    for r in DECODER_LAYER_RULES
)
EAGLE_FC_RULES: tuple[WeightRule, ...] = (
    WeightRule("fc.weight", ("fc.weight",)),
    WeightRule("fc.bias", ("fc.bias",)),
    WeightRule("vocab_embedding.weight", ("embed_tokens.weight",)),
)


def eagle_net_config(base: dict[str, Any], draft: dict[str, Any]) -> dict[str, Any]:
    """The nested draft config: shapes from the draft, vocabulary and rope from the target."""
    heads = draft["num_attention_heads"]
    head = draft.get("head_dim") or draft["hidden_size"] // heads
    return {
        "architecture": "LlamaForCausalLM",
        "dtype": base["dtype"],
        "logits_dtype": base["logits_dtype"],
        "num_hidden_layers": draft["num_hidden_layers"],
        "num_attention_heads": heads,
        "hidden_size": draft["hidden_size"],
        "intermediate_size": draft["intermediate_size"],
        "num_key_value_heads": draft.get("num_key_value_heads") or heads,
        "norm_epsilon": draft.get("rms_norm_eps", base["norm_epsilon"]),
        "max_position_embeddings": draft.get("max_position_embeddings", base["max_position_embeddings"]),
        "head_dim": head,
        "head_size": head,
        "vocab_size": base["vocab_size"],
        "hidden_act": base["hidden_act"],
        "rotary_base": base["rotary_base"],
        "rotary_scaling": base["rotary_scaling"],
        "position_embedding_type": base["position_embedding_type"],
        "quantization": base["quantization"],
        "mapping": base["mapping"],
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
    }


def _check(folder: Path, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise UserError(
            f"{folder}: tensor {name} has shape {list(t.shape)} but the target needs {list(shape)}; "
            "this draft was trained for another model"
        )


def drafter_tensors(
    folder: Path, weights: dict[str, torch.Tensor], draft: dict[str, Any], source: TargetSource
) -> dict[str, torch.Tensor]:
    """One drafter's tensors (names relative to `eagle_nets.{i}.drafter.`), checked against the target."""
    h, vocab = source.config.hidden_size, source.config.vocab_size
    weights = dict(weights)
    if "embed_tokens.weight" not in weights:
        print(f"note: {folder}: no embed_tokens.weight; using the target's embedding")
        weights["embed_tokens.weight"] = source.state_dict["model.embed_tokens.weight"]
    if "fc.bias" not in weights:
        print(f"note: {folder}: no fc.bias; writing zeros")
        weights["fc.bias"] = torch.zeros(h)
    _check(folder, "fc.weight", weights.get("fc.weight", torch.empty(0)), (h, 2 * h))
    _check(folder, "embed_tokens.weight", weights["embed_tokens.weight"], (vocab, h))
    layers = draft["num_hidden_layers"]
    out = map_weights(EAGLE_FC_RULES, weights, 0, where=str(folder))
    out.update(map_weights(EAGLE_LAYER_RULES, weights, layers, where=str(folder)))
    for layer in range(1, layers):
        if f"layers.{layer}.input_layernorm.weight" not in weights:
            raise UserError(
                f"{folder}: tensor layers.{layer}.input_layernorm.weight is missing (only layer 0 may omit it)"
            )
    return out


def add_eagle(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    source: TargetSource,
    path: str,
    dtype: torch.dtype,
    num_eagle_layers: int | None,
    max_draft_len: int | None,
    max_non_leaves: int | None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"{folder}: EAGLE draft folder not found; give the folder with config.json and the weights")
    draft = load_config_dict(folder)
    if draft.get("hidden_size") != source.config.hidden_size:
        raise UserError(
            f"{folder}/config.json: hidden_size {draft.get('hidden_size')} does not match the target's "
            f"{source.config.hidden_size}; this draft was trained for another model"
        )
    num_layers = num_eagle_layers or DEFAULT_NUM_EAGLE_LAYERS
    draft_len = max_draft_len or DEFAULT_EAGLE_DRAFT_LEN
    if num_layers < 1 or not 1 <= draft_len <= MAX_EAGLE_DRAFT_LEN:
        raise UserError(
            f"--num-eagle-layers {num_layers} / --max-draft-len {draft_len}: need >= 1 and max_draft_len <= "
            f"{MAX_EAGLE_DRAFT_LEN}"
        )
    net = eagle_net_config(config, draft)
    check_parallel(SimpleNamespace(**net), config["mapping"]["tp_size"], 1, what="EAGLE draft")
    drafter = drafter_tensors(folder, read_hf_weights(folder), draft, source)
    lm_head = source.lm_head
    out = dict(tensors)
    for i in range(num_layers):
        out.update({f"eagle_nets.{i}.drafter.{k}": v for k, v in drafter.items()})
        out[f"eagle_nets.{i}.lm_head.weight"] = lm_head
    new_config = dict(
        config,
        architecture="EagleForCausalLM",
        max_draft_len=draft_len,
        num_eagle_layers=num_layers,
        max_non_leaves_per_layer=max_non_leaves or DEFAULT_MAX_NON_LEAVES,
        eagle_net_config=net,
    )
    return new_config, {k: v.to(dtype).contiguous() for k, v in out.items()}
