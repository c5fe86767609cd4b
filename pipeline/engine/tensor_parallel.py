"""One rank's shard of the engine's model, on the same Transformer (Megatron-style tensor parallelism).

The converter cuts a checkpoint per rank (convert/shard.py): each rank holds heads/tp query heads and
their KV heads in a fused qkv (column-parallel), the matching columns of attention.dense (row-parallel),
rows intermediate/tp of mlp.fc and mlp.gate (column-parallel, fused here into fc_gate as fc ‖ gate of the
rank's own rows), the matching columns of mlp.proj (row-parallel), and rows padded_vocab/tp of the LM head
(vocab-parallel); embeddings and norms are whole on every rank. So a rank's model is the Transformer of a
config with per-rank head and MLP sizes, plus two collectives added as forward hooks: each row-parallel
product is summed over the ranks (all-reduce), and the LM head's vocabulary slices are gathered so that
every rank holds the full logits and draws the same tokens.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from pipeline.convert.shard import padded_vocab
from pipeline.engine.model import DecoderLayer, Linear, ModelConfig, Transformer
from pipeline.errors import UserError


def splits(cfg: ModelConfig, world: int) -> bool:
    """Whether `world` ranks split this model as the converter cuts it: query heads and the MLP evenly, and
    KV heads evenly or (fewer KV heads than ranks) each KV head repeated over a whole number of ranks."""
    kv_ok = cfg.num_kv_heads % world == 0 or world % cfg.num_kv_heads == 0
    return cfg.num_heads % world == 0 and cfg.intermediate_size % world == 0 and kv_ok


def check_split(cfg: ModelConfig, world: int, where: str) -> None:
    if splits(cfg, world):
        return
    sizes = [t for t in range(1, cfg.num_heads + 1) if splits(cfg, t)]
    raise UserError(
        f"{where}: tensor parallel size {world} does not split this model's {cfg.num_heads} attention heads, "
        f"{cfg.num_kv_heads} KV heads and MLP of {cfg.intermediate_size} evenly across ranks; convert and "
        f"build it again with --tp-size {' or '.join(map(str, sizes))}"
    )


def rank_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The sizes one rank's modules have (the vocabulary stays whole: the embedding is not split)."""
    return replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=max(1, cfg.num_kv_heads // world),  # fewer KV heads than ranks: one repeated per rank
        intermediate_size=cfg.intermediate_size // world,
    )


def rank_transformer(cfg: ModelConfig, world: int) -> Transformer:
    """An unloaded Transformer of one rank's shapes: per-rank heads and MLP, its slice of the LM head."""
    model = Transformer(rank_config(cfg, world))
    model.lm_head = Linear(cfg.hidden_size, padded_vocab(cfg.vocab_size, world) // world, bias=False)
    return model


def shard(model: Transformer, rank: int) -> None:
    """Add the collectives to a loaded rank model: all-reduce after attention.dense and mlp.proj, gather the
    LM head's slices (to the real vocabulary, padding dropped). A row-parallel bias is added once: by rank 0."""
    for layer in _layers(model):
        for linear in (layer.attention.dense, layer.mlp.proj):
            if linear.bias is not None and rank != 0:
                with torch.no_grad():
                    linear.bias.zero_()
            linear.register_forward_hook(_all_reduce)
    model.lm_head.register_forward_hook(_GatherVocab(model.cfg.vocab_size))


def module_path(model: Transformer) -> None:
    """Keep a rank's layers on the module path: the fused layer kernels (kernels.routing) chain a layer's
    products and residual adds in one call, leaving no place for the all-reduce."""
    for layer in _layers(model):
        layer.fused = layer.paged = None


def _layers(model: Transformer) -> list[DecoderLayer]:
    return [m for m in model.layers if isinstance(m, DecoderLayer)]


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None, "the ranks' group is formed before any step runs"
    return group


def _all_reduce(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # traceable for torch.compile and CUDA graph capture
        return funcol.all_reduce(out, "sum", _world())
    out = out.contiguous()
    dist.all_reduce(out)
    return out


class _GatherVocab:
    """Forward hook: [..., vocab/tp] logits of this rank -> [..., vocab] on every rank, in rank order."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        world, local = dist.get_world_size(), out.shape[-1]
        rows = out.reshape(-1, local).contiguous()
        if torch.compiler.is_compiling():
            gathered = funcol.all_gather_tensor(rows, 0, _world())
        else:
            gathered = rows.new_empty(world * rows.shape[0], local)
            dist.all_gather_single(gathered, rows)
        full = gathered.view(world, rows.shape[0], local).transpose(0, 1).reshape(*out.shape[:-1], world * local)
        return full[..., : self.vocab_size]
