"""Hugging Face Llama/Mistral/Qwen2 → TensorRT-LLM 1.2 LLaMA checkpoint: the weight map and config.json.

The weight map is a table of (TensorRT-LLM template, Hugging Face template(s), transform); `{i}` is
the layer index. Tensors come out full (unsharded); shard.py cuts them per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.convert.source import TargetSource, config_head_dim, rope_settings
from pipeline.errors import UserError

TRTLLM_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
GPUS_PER_NODE = 8  # TensorRT-LLM's Mapping default


def copy_tensor(t: torch.Tensor) -> torch.Tensor:
    return t


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rows q ‖ k ‖ v (the full, unsharded fused QKV; shard.split_qkv makes the per-rank layout)."""
    return torch.cat([q, k, v], dim=0)


TRANSFORMS: dict[str, Callable[..., torch.Tensor]] = {"copy": copy_tensor, "fuse_qkv": fuse_qkv}


@dataclass(frozen=True)
class WeightRule:
    trt: str
    hf: tuple[str, ...]
    transform: str = "copy"
    optional: bool = False  # absent in the source ⇒ absent in the checkpoint (biases, layer-0 norms of drafts)


def _qkv(suffix: str) -> tuple[str, ...]:
    return tuple(f"self_attn.{p}_proj.{suffix}" for p in "qkv")


# One decoder layer, relative to "transformer.layers.{i}." / "model.layers.{i}.". TensorRT-LLM's
# GatedMLP computes proj(act(fc(x)) * gate(x)), so fc is HF gate_proj and gate is HF up_proj.
DECODER_LAYER_RULES: tuple[WeightRule, ...] = (
    WeightRule("input_layernorm.weight", ("input_layernorm.weight",)),
    WeightRule("attention.qkv.weight", _qkv("weight"), "fuse_qkv"),
    WeightRule("attention.qkv.bias", _qkv("bias"), "fuse_qkv", optional=True),
    WeightRule("attention.dense.weight", ("self_attn.o_proj.weight",)),
    WeightRule("post_layernorm.weight", ("post_attention_layernorm.weight",)),
    WeightRule("mlp.fc.weight", ("mlp.gate_proj.weight",)),
    WeightRule("mlp.gate.weight", ("mlp.up_proj.weight",)),
    WeightRule("mlp.proj.weight", ("mlp.down_proj.weight",)),
)

LLAMA_RULES: tuple[WeightRule, ...] = (
    WeightRule("transformer.vocab_embedding.weight", ("model.embed_tokens.weight",)),
    *(
        WeightRule(
            f"transformer.layers.{{i}}.{r.trt}", tuple(f"model.layers.{{i}}.{h}" for h in r.hf), r.transform, r.optional
        )
        for r in DECODER_LAYER_RULES
    ),
    WeightRule("transformer.ln_f.weight", ("model.norm.weight",)),
    WeightRule("lm_head.weight", ("lm_head.weight",)),
)


def map_weights(
    rules: tuple[WeightRule, ...],
    source: dict[str, torch.Tensor],
    num_layers: int,
    trt_prefix: str = "",
    hf_prefix: str = "",
    where: str = "source",
) -> dict[str, torch.Tensor]:
    """Apply a weight map; templates with `{i}` expand over layers. Missing required tensors are UserErrors."""
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        indices = range(num_layers) if "{i}" in rule.trt else [None]
        for i in indices:
            names = [hf_prefix + h.format(i=i) for h in rule.hf]
            missing = [n for n in names if n not in source]
            if missing:
                if rule.optional:
                    continue
                raise UserError(
                    f"{where}: tensor {missing[0]} is missing; it is needed for {trt_prefix + rule.trt.format(i=i)}"
                )
            out[trt_prefix + rule.trt.format(i=i)] = TRANSFORMS[rule.transform](*(source[n] for n in names))
    return out


def check_parallel(hf_config: Any, tp: int, pp: int, what: str = "target") -> None:
    """Refuse tp/pp sizes the model cannot be cut into."""
    heads = hf_config.num_attention_heads
    kv = hf_config.num_key_value_heads or heads
    layers = hf_config.num_hidden_layers
    if tp < 1 or pp < 1:
        raise UserError(f"--tp-size {tp} / --pp-size {pp}: sizes must be >= 1")
    if heads % tp:
        raise UserError(
            f"--tp-size {tp}: does not divide the {what}'s num_attention_heads {heads}; use a divisor of {heads}"
        )
    if kv >= tp and kv % tp:
        raise UserError(f"--tp-size {tp}: does not divide the {what}'s num_key_value_heads {kv}; use a divisor of {kv}")
    if kv < tp and tp % kv:
        raise UserError(f"--tp-size {tp}: with num_key_value_heads {kv} < tp the tp size must be a multiple of {kv}")
    if hf_config.intermediate_size % tp:
        raise UserError(f"--tp-size {tp}: does not divide the {what}'s intermediate_size {hf_config.intermediate_size}")
    if layers % pp:
        raise UserError(
            f"--pp-size {pp}: does not divide the {what}'s num_hidden_layers {layers}; use a divisor of {layers}"
        )


def mapping_config(tp: int, pp: int) -> dict[str, Any]:
    return {
        "world_size": tp * pp,
        "gpus_per_node": GPUS_PER_NODE,
        "cp_size": 1,
        "tp_size": tp,
        "pp_size": pp,
        "moe_tp_size": tp,
        "moe_cluster_size": 1,
        "moe_ep_size": 1,
        "attn_tp_size": tp,
        "attn_cp_size": 1,
        "cp_config": {},
        "enable_attention_dp": False,
        "enable_lm_head_tp_in_adp": False,
    }


NO_QUANTIZATION: dict[str, Any] = {
    "quant_algo": None,
    "kv_cache_quant_algo": None,
    "group_size": 128,
    "smoothquant_val": 0.5,
    "clamp_val": None,
    "use_meta_recipe": False,
    "has_zero_point": False,
    "pre_quant_scale": False,
    "exclude_modules": None,
    "mamba_ssm_cache_dtype": None,
}


def llama_config(hf: Any, dtype: torch.dtype, tp: int, pp: int) -> dict[str, Any]:
    """config.json of a TensorRT-LLM LLaMA checkpoint (LLaMAConfig.to_dict fields).

    Qwen2 is written the way TensorRT-LLM converts it: architecture "Qwen2ForCausalLM" (its QWenForCausalLM
    class) with qwen_type "qwen2" and attn_bias true, which in that class means q/k/v biases only, no
    dense (o_proj) bias (QWenDecoderLayer passes dense_bias=False). The tensor names are the LLaMA ones.
    """
    theta, scaling = rope_settings(hf)
    head = config_head_dim(hf)
    is_qwen2 = hf.model_type == "qwen2"
    config = {
        "architecture": "Qwen2ForCausalLM" if is_qwen2 else "LlamaForCausalLM",
        "dtype": TRTLLM_DTYPE_NAMES[dtype],
        "logits_dtype": "float32",
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "num_hidden_layers": hf.num_hidden_layers,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads or hf.num_attention_heads,
        "head_size": head,
        "head_dim": head,
        "hidden_act": hf.hidden_act,
        "intermediate_size": hf.intermediate_size,
        "norm_epsilon": hf.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": theta,
        "rotary_scaling": scaling,
        "rotary_embedding_dim": head,
        "max_position_embeddings": hf.max_position_embeddings,
        "mapping": mapping_config(tp, pp),
        "quantization": dict(NO_QUANTIZATION),
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": bool(hf.tie_word_embeddings),
        "qk_layernorm": False,
        "runtime_defaults": None,
        "mlp_bias": False,
        "attn_bias": is_qwen2,
        "residual_mlp": False,
        "moe": {"num_experts": 0, "top_k": 0},
        "fc_after_embed": False,
        "use_input_layernorm_in_first_layer": True,
        "use_last_layernorm": True,
        "layer_idx_offset": 0,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "output_multiplier_scale": 1.0,
    }
    if is_qwen2:
        config["qwen_type"] = "qwen2"
    return config


def llama_tensors(source: TargetSource, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Full TensorRT-LLM-named tensors; tied models get lm_head from the embedding (written anyway)."""
    weights = dict(source.state_dict)
    weights.setdefault("lm_head.weight", source.lm_head)
    full = map_weights(LLAMA_RULES, weights, source.config.num_hidden_layers, where=source.spec)
    return {name: t.to(dtype).contiguous() for name, t in full.items()}
