"""Batched decode steps of the Llama-3-8B shape at TP 1 and TP 2 (random bf16 weights): the time of one step
of the engine's batched step, at batch 1 and 16.

No checkpoint is written: every rank builds its shard's modules (tensor_parallel.rank_transformer) on its own
device from a seed, with the collectives of a real TP engine, and runs under an Engine like a loaded one;
rank 0 drives the step through the same replicated calls (parallel.RankGroup, tp_loader.STEP_CALLS) that the
scheduler makes. Steps are queued back to back, each row taking the step before's token on the device
(the CARRY column), and synchronised once at the end: the steady decode loop of the scheduler.

  python -m pipeline.bench.probes.tensor_parallel                            # a host with 2 GPUs
  python -m pipeline.bench.probes.tensor_parallel --shape tiny --device cpu  # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.engine.config import EngineLimits, SpecConfig
from pipeline.engine.kv_cache import CacheBudget
from pipeline.engine.model import ModelConfig
from pipeline.engine.parallel import ParallelConfig, RankGroup, rank_device
from pipeline.engine.runner import Engine
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.engine.step import CARRY, POSITION, TABLE, TEMPERATURE, TOKEN, TOP_P, BatchStep
from pipeline.engine.tensor_parallel import module_path, rank_transformer, shard
from pipeline.engine.tp_loader import STEP, STEP_CALLS

SHAPES = {
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        intermediate_size=14336,
        norm_epsilon=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
    ),
    "tiny": ModelConfig(
        vocab_size=509,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        intermediate_size=128,
        norm_epsilon=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=2048,
    ),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
INIT_STD = 0.02  # weights ~ N(0, INIT_STD): activations stay finite through 32 random layers
SEED = 0
GREEDY_TOP_P = 1.0


@dataclass(frozen=True)
class Probe:
    shape: str = "llama3-8b"
    dtype: str = "bfloat16"
    context: int = 512  # tokens each row already holds in the cache when the timed steps start
    warmup: int = 5  # untimed steps a batch size runs first (on CUDA: graph capture)
    steps: int = 50  # timed steps
    max_batch: int = 16

    @property
    def max_seq_len(self) -> int:
        return self.context + self.warmup + self.steps + 1


def build_rank(probe: Probe, rank: int, world: int, device: torch.device) -> tuple[dict[str, Any], dict[str, Any]]:
    """One rank's step over random weights (rank 0 calls it too): its objects and its pool's size."""
    cfg = SHAPES[probe.shape]
    torch.manual_seed(SEED + rank)
    with torch.device(device):
        target = rank_transformer(cfg, world)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD)
    if world > 1:
        shard(target, rank)
    target = target.to(dtype=DTYPES[probe.dtype]).eval()
    limits = EngineLimits(probe.max_batch, probe.max_seq_len, probe.max_seq_len, 0)
    block = CacheBudget().block_size
    whole_blocks = -(-probe.max_seq_len // block) * block  # each row's table covers whole blocks
    cache = CacheBudget(max_num_tokens=probe.max_batch * whole_blocks)  # the same pool on every rank
    serving = SchedulerConfig(max_batch_size=probe.max_batch, cache=cache)
    engine = Engine(target, None, limits, SpecConfig(), None, serving)
    if world > 1:
        module_path(target)
    step = engine.scheduler.batch
    return {STEP: step}, {"blocks": step.pool.num_blocks}


def time_steps(step: BatchStep, batch: int, probe: Probe) -> float:
    """Seconds a step, over probe.steps greedy decode steps of `batch` rows at probe.context tokens."""
    tables: list[list[int]] = []
    rows, floats = [], []
    for _ in range(batch):
        ints, row_floats = step.new_row()
        table: list[int] = []
        step.pool.grow(table, probe.max_seq_len)
        tables.append(table)
        ints[TABLE : TABLE + len(table)] = table
        ints[TOKEN], ints[POSITION], ints[CARRY] = 0, probe.context, -1
        row_floats[TEMPERATURE], row_floats[TOP_P] = 0.0, GREEDY_TOP_P
        rows.append(ints)
        floats.append(row_floats)
    ints_all, floats_all = np.stack(rows), np.stack(floats)
    with torch.inference_mode():

        def run(n: int) -> None:
            out = None
            for _ in range(n):
                out = step.decode(ints_all, floats_all)
                ints_all[:, CARRY] = np.arange(batch)  # each row takes its own token of this step
                ints_all[:, POSITION] += 1
            assert out is not None
            out.cpu()  # waits for every step queued

        run(probe.warmup)
        start = time.perf_counter()
        run(probe.steps)
        seconds = (time.perf_counter() - start) / probe.steps
    for table in tables:
        step.pool.release(table)
    return seconds


def measure(probe: Probe, tp: int, device: torch.device, batches: list[int]) -> dict[int, float]:
    build = functools.partial(build_rank, probe)
    group = RankGroup.start(tp, device, build, ParallelConfig()) if tp > 1 else None
    try:
        step = build(0, tp, rank_device(device, 0))[0][STEP]
        if group is not None:
            group.join()
            group.replicate(step, STEP, STEP_CALLS)
        return {b: time_steps(step, b, probe) for b in batches}
    finally:
        if group is not None:
            group.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=Probe.shape)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=Probe.dtype)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=Probe.context)
    p.add_argument("--steps", type=int, default=Probe.steps)
    args = p.parse_args(argv)
    probe = Probe(args.shape, args.dtype, args.context, Probe.warmup, args.steps, max(args.batch))
    device = torch.device(args.device)
    print(f"{args.shape} {args.dtype} on {device.type}, {args.context} tokens of context, {args.steps} timed steps")
    for tp in args.tp:
        for batch, seconds in measure(probe, tp, device, args.batch).items():
            print(f"tp {tp}  batch {batch:3d}  {seconds * 1e3:8.3f} ms a step  {batch / seconds:10.1f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
