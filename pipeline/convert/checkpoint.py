"""The TensorRT-LLM unified checkpoint on disk: config.json + rank{r}.safetensors (+ tokenizer/, draft/).

`write_checkpoint` shards full tensors per rank; `read_checkpoint` loads every rank file and merges
them back into full, unsharded TensorRT-LLM-named tensors (what the portable engine runs on).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pipeline.convert.shard import merge_shards, shard_tensors
from pipeline.convert.source import read_safetensors
from pipeline.errors import UserError

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
DRAFT_DIR = "draft"


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / f"rank{rank}.safetensors"


def write_checkpoint(
    out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], tokenizer: Any | None = None
) -> None:
    """Write config.json, one safetensors file per rank and the tokenizer into an existing folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = shard_tensors(tensors, config)
    for rank, shard in enumerate(
        tqdm(ranks, desc=f"writing {out_dir.name or 'checkpoint'}", unit="rank", disable=len(ranks) == 1)
    ):
        save_file(_unshared(shard), str(rank_file(out_dir, rank)), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir / TOKENIZER_DIR)


def _unshared(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no shared storage (tied embeddings), as safetensors requires."""
    out, seen = {}, set()
    for name, t in shard.items():
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def read_config(ckpt_dir: str | Path) -> dict[str, Any]:
    ckpt_dir = Path(ckpt_dir)
    file = ckpt_dir / CONFIG_FILE
    if not ckpt_dir.is_dir():
        raise UserError(f"{ckpt_dir}: checkpoint folder not found; create it with `specpipe convert`")
    if not file.is_file():
        raise UserError(f"{file}: not found; a TensorRT-LLM checkpoint needs config.json (re-run `specpipe convert`)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    config = config.get("pretrained_config", config)  # a built portable engine holds the same rank files
    for key in ("architecture", "num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        if key not in config:
            raise UserError(f"{file}: missing required field {key!r}; re-run `specpipe convert`")
    config.setdefault("mapping", {"world_size": 1, "tp_size": 1, "pp_size": 1})
    config["mapping"].setdefault("tp_size", 1)
    config["mapping"].setdefault("pp_size", 1)
    return config


def read_checkpoint(
    ckpt_dir: str | Path, keep: Callable[[str], bool] | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, full tensors): rank files merged, vocab padding dropped, layer indices global; only the
    tensors whose names `keep` accepts, if given.

    Works on a checkpoint folder and on a portable engine folder (config = its pretrained_config).
    """
    ckpt_dir = Path(ckpt_dir)
    config = read_config(ckpt_dir)
    world = config["mapping"]["tp_size"] * config["mapping"]["pp_size"]
    ranks = []
    for rank in range(world):
        file = rank_file(ckpt_dir, rank)
        if not file.is_file():
            raise UserError(f"{file}: missing; mapping says {world} ranks (tp*pp); re-run `specpipe convert`")
        ranks.append(read_safetensors(file, keep))
    tensors = merge_shards(ranks, config)
    check_shapes(config, tensors, ckpt_dir)
    return config, tensors


def expected_base_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Full shapes of the base model's tensors that every LLaMA-family checkpoint holds."""
    h, v = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_size") or h // heads
    inter = config["intermediate_size"]
    shapes = {"transformer.vocab_embedding.weight": (v, h), "transformer.ln_f.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        shapes.update(
            {
                p + "attention.qkv.weight": ((heads + 2 * kv) * d, h),
                p + "attention.dense.weight": (h, heads * d),
                p + "mlp.fc.weight": (inter, h),
                p + "mlp.gate.weight": (inter, h),
                p + "mlp.proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_layernorm.weight": (h,),
            }
        )
    return shapes


def check_shapes(config: dict[str, Any], tensors: dict[str, torch.Tensor], where: Path) -> None:
    for name, shape in expected_base_shapes(config).items():
        if name not in tensors:
            raise UserError(f"{where}: tensor {name} is missing from the rank files; re-run `specpipe convert`")
        if tuple(tensors[name].shape) != shape:
            raise UserError(
                f"{where}: tensor {name} has shape {list(tensors[name].shape)} but config.json implies {list(shape)}"
            )
