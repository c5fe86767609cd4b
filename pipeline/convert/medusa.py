"""Medusa heads in (FasterDecoding reference, ModelOpt, vLLM layouts) → a MedusaForCausalLM checkpoint.

Each layout is normalised to {head: {"linear": [(weight, bias) per layer], "lm_head": tensor | None}};
the published config's head count is not trusted (some understate it): the tensors decide.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from pipeline.convert.source import TargetSource, read_safetensors
from pipeline.errors import UserError

DEFAULT_MEDUSA_DRAFT_LEN = 63  # TensorRT-LLM's --max_medusa_token_len default
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")
MODELOPT_PREFIX = "medusa_heads."

# (pattern, what): reference/ModelOpt `{h}.{l}.linear.*`, `{h}.{L}.weight`;
# vLLM `blocks.{h}.layers.{l}.*`, `lm_heads.{h}.weight`.
_REFERENCE_LINEAR = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_REFERENCE_HEAD = re.compile(r"^(\d+)\.(\d+)\.weight$")
_VLLM_LINEAR = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")
VLLM_SHARED_HEAD = "lm_head.weight"  # vLLM's original_lm_head: one head shared by all


def medusa_file(path: Path) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise UserError(
            f"{path}: Medusa heads not found; give a folder with medusa_lm_head.safetensors/.pt or the file"
        )
    for name in MEDUSA_FILES:
        if (path / name).is_file():
            return path / name
    raise UserError(f"{path}: no Medusa weights found; expected one of {', '.join(MEDUSA_FILES)}")


def load_medusa_tensors(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        return read_safetensors(file)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError) as exc:
        raise UserError(f"{file}: cannot read PyTorch weights ({exc}); the file is truncated or corrupt") from None


def parse_heads(tensors: dict[str, torch.Tensor], file: Path) -> dict[int, dict[str, Any]]:
    """Normalise any supported layout into per-head linear (weight, bias) lists and an optional lm_head."""
    linear: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    heads_lm: dict[int, torch.Tensor] = {}
    shared = None
    raw_heads: dict[tuple[int, int], torch.Tensor] = {}
    for key, t in tensors.items():
        name = key[len(MODELOPT_PREFIX) :] if key.startswith(MODELOPT_PREFIX) else key
        if m := _REFERENCE_LINEAR.match(name) or _VLLM_LINEAR.match(name):
            linear.setdefault((int(m.group(1)), int(m.group(2))), {})[m.group(3)] = t
        elif m := _VLLM_HEAD.match(name):
            heads_lm[int(m.group(1))] = t
        elif m := _REFERENCE_HEAD.match(name):
            raw_heads[(int(m.group(1)), int(m.group(2)))] = t
        elif name == VLLM_SHARED_HEAD:
            shared = t
        elif name != "token_map":  # vLLM's optional reduced-vocab map; not used by TensorRT-LLM
            raise UserError(
                f"{file}: tensor {key} is not a Medusa head tensor; expected FasterDecoding, ModelOpt or vLLM names"
            )
    if not linear:
        raise UserError(
            f"{file}: no Medusa head layers found (keys like 0.0.linear.weight or blocks.0.layers.0.weight)"
        )
    num_heads = max(h for h, _ in linear) + 1
    heads: dict[int, dict[str, Any]] = {}
    for h in range(num_heads):
        layers = sorted(layer for hh, layer in linear if hh == h)
        if layers != list(range(len(layers))) or not layers:
            raise UserError(f"{file}: head {h} has layers {layers}; expected 0..L-1 for every head")
        lm = heads_lm.get(h, raw_heads.get((h, len(layers)), shared))
        heads[h] = {
            "linear": [(linear[(h, layer)].get("weight"), linear[(h, layer)].get("bias")) for layer in layers],
            "lm_head": lm,
        }
    return heads


def _declared_heads(path: Path) -> int | None:
    cfg_file = (path if path.is_dir() else path.parent) / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text())
    return cfg.get("medusa_num_heads") or cfg.get("num_heads") or (cfg.get("medusa") or {}).get("num_medusa_heads")


def medusa_tensors(
    heads: dict[int, dict[str, Any]], source: TargetSource, file: Path, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """TensorRT-LLM head tensors, checking every shape against the target; missing pieces filled with a note."""
    h_size, vocab = source.config.hidden_size, source.config.vocab_size
    out: dict[str, torch.Tensor] = {}
    filled_lm, zero_bias = [], []
    for h, head in heads.items():
        for layer, (w, b) in enumerate(head["linear"]):
            if w is None:
                raise UserError(f"{file}: head {h} layer {layer} has a bias but no weight")
            if b is None:
                b = torch.zeros(h_size)
                zero_bias.append(h)
            _check(file, f"head {h} layer {layer} weight", w, (h_size, h_size))
            _check(file, f"head {h} layer {layer} bias", b, (h_size,))
            out[f"medusa_heads.{h}.medusa_layers.{layer}.linear.weight"] = w
            out[f"medusa_heads.{h}.medusa_layers.{layer}.linear.bias"] = b
        lm = head["lm_head"]
        if lm is None:
            lm = source.lm_head
            filled_lm.append(h)
        _check(file, f"head {h} lm_head", lm, (vocab, h_size))
        out[f"medusa_heads.{h}.lm_head.weight"] = lm
    if filled_lm:
        print(f"note: {file}: heads {filled_lm} have no lm_head; using the target's lm_head for them")
    if zero_bias:
        print(
            f"note: {file}: heads {sorted(set(zero_bias))} have no linear bias (vLLM medusa_fc_bias=false); writing "
            "zeros"
        )
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def _check(file: Path, what: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise UserError(
            f"{file}: {what} has shape {list(t.shape)} but the target needs {list(shape)} "
            "(hidden size / vocabulary); these heads were trained for another model"
        )


def medusa_config(base: dict[str, Any], num_heads: int, num_layers: int, max_draft_len: int) -> dict[str, Any]:
    """Base LLaMA fields + the Medusa ones. rotary_scaling is reduced to {"type": ...} as TensorRT-LLM's
    Medusa converter writes it (it drops the factor; harmless for unscaled targets such as SmolLM2)."""
    config = dict(
        base,
        architecture="MedusaForCausalLM",
        max_draft_len=max_draft_len,
        num_medusa_heads=num_heads,
        num_medusa_layers=num_layers,
        model_type=base.get("qwen_type", "llama"),
    )
    if base.get("rotary_scaling"):
        config["rotary_scaling"] = {"type": base["rotary_scaling"]["type"]}
    return config


def add_medusa(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    source: TargetSource,
    path: str,
    dtype: torch.dtype,
    num_heads: int | None,
    max_draft_len: int | None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    file = medusa_file(Path(path))
    heads = parse_heads(load_medusa_tensors(file), file)
    declared = _declared_heads(Path(path))
    if declared is not None and declared != len(heads):
        print(
            f"note: {file}: config declares {declared} Medusa heads but the tensors hold {len(heads)}; using the "
            "tensors"
        )
    if num_heads is not None:
        if not 1 <= num_heads <= len(heads):
            raise UserError(f"--num-medusa-heads {num_heads}: {file} holds {len(heads)} heads; choose 1..{len(heads)}")
        heads = {h: heads[h] for h in range(num_heads)}
    layer_counts = {len(head["linear"]) for head in heads.values()}
    if len(layer_counts) != 1:
        raise UserError(
            f"{file}: heads have different layer counts {sorted(layer_counts)}; TensorRT-LLM needs one count"
        )
    draft_len = max_draft_len or DEFAULT_MEDUSA_DRAFT_LEN
    new_config = medusa_config(config, len(heads), layer_counts.pop(), draft_len)
    return new_config, {**tensors, **medusa_tensors(heads, source, file, dtype)}
