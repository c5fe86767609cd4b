"""Tensor- and pipeline-parallel sharding of full TensorRT-LLM-named tensors, and its exact inverse.

The converter first builds full (unsharded) tensors under TensorRT-LLM names, then `shard_tensors`
cuts them per rank; `merge_shards` undoes it for the portable engine. Which cut a tensor gets is
declared once, in SPLIT_RULES, by its TensorRT-LLM name; each cut is a named pair of functions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.errors import UserError


@dataclass(frozen=True)
class ShardLayout:
    """What a cut needs to know about the model a tensor belongs to."""

    tp: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int

    @property
    def kv_replicas(self) -> int:
        """How many ranks share one KV head (1 when there are at least as many KV heads as ranks)."""
        return 1 if self.num_kv_heads >= self.tp else self.tp // self.num_kv_heads


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def _chunks(t: torch.Tensor, parts: int, dim: int, name: str) -> list[torch.Tensor]:
    if t.shape[dim] % parts:
        raise UserError(
            f"tensor {name} has {t.shape[dim]} entries on dim {dim}, not divisible by tp_size {parts}; choose "
            "another --tp-size"
        )
    return [c.contiguous() for c in torch.chunk(t, parts, dim=dim)]


def split_replicated(t: torch.Tensor, lay: ShardLayout, name: str) -> list[torch.Tensor]:
    return [t] * lay.tp


def merge_replicated(parts: list[torch.Tensor], lay: ShardLayout, name: str) -> torch.Tensor:
    return parts[0]


def split_rows(t: torch.Tensor, lay: ShardLayout, name: str) -> list[torch.Tensor]:
    return _chunks(t, lay.tp, 0, name)


def merge_rows(parts: list[torch.Tensor], lay: ShardLayout, name: str) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def split_cols(t: torch.Tensor, lay: ShardLayout, name: str) -> list[torch.Tensor]:
    return _chunks(t, lay.tp, 1, name)


def merge_cols(parts: list[torch.Tensor], lay: ShardLayout, name: str) -> torch.Tensor:
    return torch.cat(parts, dim=1)


def split_vocab(t: torch.Tensor, lay: ShardLayout, name: str) -> list[torch.Tensor]:
    """Zero-pad rows to a multiple of tp, then cut rows (lm_head-style outputs)."""
    pad = padded_vocab(t.shape[0], lay.tp) - t.shape[0]
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))], dim=0)
    return _chunks(t, lay.tp, 0, name)


def merge_vocab(parts: list[torch.Tensor], lay: ShardLayout, name: str) -> torch.Tensor:
    return torch.cat(parts, dim=0)[: lay.vocab_size]


def _qkv_sizes(lay: ShardLayout) -> tuple[int, int]:
    return lay.num_heads * lay.head_size, lay.num_kv_heads * lay.head_size


def split_qkv(t: torch.Tensor, lay: ShardLayout, name: str) -> list[torch.Tensor]:
    """Full rows q ‖ k ‖ v → per rank q_r ‖ k_r ‖ v_r; with fewer KV heads than ranks each KV head
    is repeated consecutively so rank r holds KV head r // (tp / kv_heads)."""
    q_rows, kv_rows = _qkv_sizes(lay)
    if t.shape[0] != q_rows + 2 * kv_rows:
        raise UserError(f"tensor {name} has {t.shape[0]} rows; heads imply {q_rows + 2 * kv_rows}")
    q, k, v = torch.split(t, [q_rows, kv_rows, kv_rows], dim=0)
    if lay.kv_replicas > 1:
        k, v = _repeat_heads(k, lay), _repeat_heads(v, lay)
    qs, ks, vs = (_chunks(x, lay.tp, 0, name) for x in (q, k, v))
    return [torch.cat([a, b, c], dim=0) for a, b, c in zip(qs, ks, vs)]


def _repeat_heads(x: torch.Tensor, lay: ShardLayout) -> torch.Tensor:
    heads = x.reshape(lay.num_kv_heads, lay.head_size, *x.shape[1:])
    return heads.repeat_interleave(lay.kv_replicas, dim=0).reshape(-1, *x.shape[1:])


def merge_qkv(parts: list[torch.Tensor], lay: ShardLayout, name: str) -> torch.Tensor:
    q_rows, kv_rows = _qkv_sizes(lay)
    kv_local = kv_rows // lay.tp if lay.kv_replicas == 1 else lay.head_size
    pieces = [torch.split(p, [q_rows // lay.tp, kv_local, kv_local], dim=0) for p in parts]
    kv_ranks = range(0, lay.tp, lay.kv_replicas)  # one rank per distinct KV head group
    q = torch.cat([p[0] for p in pieces], dim=0)
    k = torch.cat([pieces[r][1] for r in kv_ranks], dim=0)
    v = torch.cat([pieces[r][2] for r in kv_ranks], dim=0)
    return torch.cat([q, k, v], dim=0)


Split = Callable[[torch.Tensor, ShardLayout, str], list[torch.Tensor]]
Merge = Callable[[list[torch.Tensor], ShardLayout, str], torch.Tensor]
CUTS: dict[str, tuple[Split, Merge]] = {
    "replicated": (split_replicated, merge_replicated),
    "rows": (split_rows, merge_rows),
    "cols": (split_cols, merge_cols),
    "vocab": (split_vocab, merge_vocab),
    "qkv": (split_qkv, merge_qkv),
}

# First match wins; anything unmatched (embeddings, norms) is replicated on every TP rank.
SPLIT_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)attention\.qkv\.(weight|bias)$", "qkv"),
    (r"(^|\.)attention\.dense\.weight$", "cols"),
    (r"(^|\.)mlp\.(fc|gate)\.(weight|bias)$", "rows"),
    (r"(^|\.)mlp\.proj\.weight$", "cols"),
    (r"(^|\.)lm_head\.weight$", "vocab"),
    (r"^medusa_heads\.\d+\.medusa_layers\.\d+\.linear\.(weight|bias)$", "rows"),
    (r"^eagle_nets\.\d+\.drafter\.fc\.(weight|bias)$", "rows"),
)
_COMPILED_RULES = tuple((re.compile(p), cut) for p, cut in SPLIT_RULES)


def cut_for(name: str) -> str:
    return next((cut for pattern, cut in _COMPILED_RULES if pattern.search(name)), "replicated")


def layouts(config: dict[str, Any]) -> dict[str, ShardLayout]:
    """Layouts keyed by tensor-name prefix ("" = the base model; "eagle_nets." = the EAGLE draft)."""
    tp = config["mapping"]["tp_size"]

    def of(cfg: dict[str, Any]) -> ShardLayout:
        heads = cfg["num_attention_heads"]
        return ShardLayout(
            tp,
            heads,
            cfg.get("num_key_value_heads") or heads,
            cfg.get("head_size") or cfg["hidden_size"] // heads,
            config["vocab_size"],
        )

    out = {"": of(config)}
    if "eagle_net_config" in config:
        out["eagle_nets."] = of(config["eagle_net_config"])
    return out


def layout_for(name: str, lays: dict[str, ShardLayout]) -> ShardLayout:
    return lays["eagle_nets."] if name.startswith("eagle_nets.") and "eagle_nets." in lays else lays[""]


_LAYER = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")


def pp_stage(name: str, num_layers: int, pp: int) -> tuple[int, str]:
    """(pipeline stage, stage-local name): layers by index, the embedding first, everything else last."""
    m = _LAYER.match(name)
    if m:
        per_stage = num_layers // pp
        idx = int(m.group(1))
        return idx // per_stage, f"transformer.layers.{idx % per_stage}.{m.group(2)}"
    if name.startswith("transformer.vocab_embedding."):
        return 0, name
    return pp - 1, name


def shard_tensors(full: dict[str, torch.Tensor], config: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Per-rank tensors, rank = pp_rank * tp + tp_rank (TensorRT-LLM's Mapping)."""
    tp, pp = config["mapping"]["tp_size"], config["mapping"]["pp_size"]
    lays = layouts(config)
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp * pp)]
    for name, tensor in full.items():
        stage, local = pp_stage(name, config["num_hidden_layers"], pp)
        split, _ = CUTS[cut_for(name)]
        for tp_rank, part in enumerate(split(tensor, layout_for(name, lays), name)):
            ranks[stage * tp + tp_rank][local] = part
    return ranks


def merge_shards(ranks: list[dict[str, torch.Tensor]], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of shard_tensors: full tensors with global layer indices."""
    tp, pp = config["mapping"]["tp_size"], config["mapping"]["pp_size"]
    per_stage = config["num_hidden_layers"] // pp
    lays = layouts(config)
    full: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        group = ranks[stage * tp : (stage + 1) * tp]
        for local in group[0]:
            missing = [r for r, rank in enumerate(group) if local not in rank]
            if missing:
                raise UserError(
                    f"tensor {local} is missing from rank{stage * tp + missing[0]}.safetensors; re-run "
                    "`specpipe convert`"
                )
            m = _LAYER.match(local)
            name = f"transformer.layers.{int(m.group(1)) + stage * per_stage}.{m.group(2)}" if m else local
            _, merge = CUTS[cut_for(name)]
            full[name] = merge([rank[local] for rank in group], layout_for(name, lays), name)
    return full
