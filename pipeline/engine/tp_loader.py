"""A tensor-parallel engine: rank 0 in the calling process, ranks 1.. in processes it spawns (parallel.py),
each an Engine over its own rank{r}.safetensors shard (tensor_parallel.py). Rank 0's scheduler drives the
batched step; each of the step's calls runs on every rank.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pipeline.engine.config import EngineDir
from pipeline.engine.model import ModelConfig
from pipeline.engine.parallel import ParallelConfig, RankGroup
from pipeline.engine.runner import Engine
from pipeline.engine.sampling import RequestError
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.engine.tensor_parallel import check_split, module_path, rank_transformer, shard
from pipeline.engine.weights import engine_state_dict, load_into
from pipeline.errors import UserError

# The batched step's calls that run on every rank; the rest of the step (its pool's free list, its
# readback) is rank 0's bookkeeping, and block tables travel inside the calls' host arrays.
STEP_CALLS = ("decode", "prefill")
STEP = "step"


def tp_size(engine: EngineDir) -> int:
    return int(engine.pretrained_config.get("mapping", {}).get("tp_size", 1))


def runs_as_ranks(engine: EngineDir, serving: SchedulerConfig | None) -> bool:
    """Whether a TP > 1 engine runs as one process a rank: plain, batched, without pipeline stages. Others
    (speculative engines, pipeline-parallel shards, the one-request loop) load their shards merged into one
    process, as a TP 1 engine."""
    mapping = engine.pretrained_config.get("mapping", {})
    batched = serving is None or serving.batched
    return tp_size(engine) > 1 and engine.spec.mode == "none" and mapping.get("pp_size", 1) == 1 and batched


def check_tensor_parallel(engine: EngineDir, device: torch.device, serving: SchedulerConfig) -> int:
    """The rank count of an engine this runtime can run tensor-parallel; UserError naming the fix otherwise."""
    from pipeline.convert.checkpoint import rank_file

    world, where = tp_size(engine), str(engine.path)
    check_split(ModelConfig.from_pretrained_config(engine.pretrained_config), world, where)
    for rank in range(world):
        if not rank_file(engine.path, rank).is_file():
            raise UserError(f"{rank_file(engine.path, rank)}: missing; tp_size {world} needs one file a rank")
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise UserError(f"{where}: tp_size {world} needs {world} GPUs, this host has {torch.cuda.device_count()}")
    return world


def load_tensor_parallel(
    engine: EngineDir,
    device: torch.device,
    dtype: torch.dtype,
    positions: int,
    serving: SchedulerConfig | None,
    config: ParallelConfig,
) -> Engine:
    """Rank 0 here, ranks 1.. in processes of their own; rank 0's step calls replayed on every rank. `positions`:
    the RoPE positions a request can reach (the loader's max_positions)."""
    from transformers import AutoTokenizer

    serving = serving or SchedulerConfig()
    world = check_tensor_parallel(engine, device, serving)
    build = functools.partial(build_rank, engine.path, dtype, positions, serving)
    group = RankGroup.start(world, device, build, config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(engine.tokenizer_dir)
        runtime = rank_engine(engine, 0, world, device, dtype, positions, serving, tokenizer)
        step = runtime.scheduler.batch
        reports = group.join()
        # Rank 0 hands out blocks: only those every rank's pool holds (CUDA pools follow each GPU's free memory).
        blocks = min(step.pool.num_blocks, *(r["blocks"] for r in reports))
        step.pool.free = [b for b in step.pool.free if b < blocks]
        step.pool.num_blocks = blocks
        group.replicate(step, STEP, STEP_CALLS)
        # A forward on rank 0 alone would stall the group; setattr: the instance's method is replaced.
        setattr(runtime, "verify_external", _no_external_drafts)  # noqa: B010
        runtime.warm_up()
    except BaseException:
        group.close()
        raise
    return runtime


def build_rank(
    path: Path,
    dtype: torch.dtype,
    positions: int,
    serving: SchedulerConfig,
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rank other than 0 (in its own process): its step, and its pool's size for rank 0."""
    runtime = rank_engine(EngineDir.load(path), rank, world, device, dtype, positions, serving, None)
    step = runtime.scheduler.batch
    return {STEP: step}, {"blocks": step.pool.num_blocks}


def rank_engine(
    engine: EngineDir,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    positions: int,
    serving: SchedulerConfig,
    tokenizer: Any,
) -> Engine:
    """An Engine over rank `rank`'s shard: per-rank heads, so its block pool holds this rank's KV heads."""
    from pipeline.convert.checkpoint import rank_file, read_config
    from pipeline.convert.eagle import not_a_later_copy
    from pipeline.convert.source import read_safetensors

    config = read_config(engine.path)
    file = rank_file(engine.path, rank)
    tensors = read_safetensors(file, not_a_later_copy)
    cfg = ModelConfig.from_pretrained_config(config, set(tensors))  # biases: by the shard's tensor names
    cfg = replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, positions))
    target = rank_transformer(cfg, world)
    state = engine_state_dict(tensors, "transformer.", "")
    state["lm_head.weight"] = tensors["lm_head.weight"]  # the converter writes it for tied models too
    load_into(target, state, str(file))
    shard(target, rank)
    target = target.to(device, dtype).eval()
    runtime = Engine(target, tokenizer, engine.limits, engine.spec, None, serving)
    module_path(target)
    return runtime


def _no_external_drafts(prompt_ids: list[int], draft_ids: list[int]) -> list[int]:
    raise RequestError("a tensor-parallel engine does not verify external drafts; serve them with a tp_size 1 engine")
