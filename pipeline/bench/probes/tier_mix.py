"""Does switching tiers change what a tier accepts? One request at a time, each drafting tier's accepted tokens
a row when it runs alone, and when the tiers take turns in blocks of --block steps (in the order given),
split into a block's first step (right after another tier) and its later ones. A tier that accepts less in
its first step than in its later ones, or less in turns than alone, loses state across switches.

    python -m pipeline.bench.probes.tier_mix --engine engines/smollm2-eagle --prompt-ids IDS [--device cuda]
        [--tiers chain1,chain4,tree32,tree64,dynamic64] [--block 1,8] [--prompts 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.bench.prompts import load_prompt_ids
from pipeline.bench.speed import environment
from pipeline.engine.adaptive import AdaptiveConfig, TierController
from pipeline.engine.loader import open_engine
from pipeline.engine.runner import Engine
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.scheduler import SchedulerConfig

IGNORE_END = -1


@dataclass
class Turns(TierController):
    """A controller that runs `order`'s tiers in blocks of `block` steps, and records each drafting step's
    acceptance by (tier, first step of its block)."""

    order: list[int] = field(default_factory=list)
    block: int = 1
    drafted: int = 0  # drafting steps chosen
    records: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    last: int = -1  # the tier of the last drafting step observed

    def choose(self, bucket: int, rows: int, drafting: int) -> int:
        self.steps += 1
        if drafting == 0:
            return 0
        index = self.order[(self.drafted // self.block) % len(self.order)]
        self.drafted += 1
        return index

    def observe(self, index: int, accepted: list[int]) -> None:
        super().observe(index, accepted)
        if index == 0 or not accepted:
            return
        first = index != self.last
        self.last = index
        self.records.setdefault((index, first), []).extend(float(a) for a in accepted)


def run(engine: Engine, prompts: list[list[int]], order: list[int], block: int, max_tokens: int) -> Turns:
    scheduler = engine.scheduler
    loaded = scheduler.controller
    assert loaded is not None and scheduler.spec is not None
    # No request is paused for low acceptance: every step drafts.
    config = replace(AdaptiveConfig(), request_cutoff=0.0)
    turns = Turns(scheduler.spec.tiers, config, order=order, block=block)
    turns.plain_cost, turns.ratio = dict(loaded.plain_cost), {b: list(r) for b, r in loaded.ratio.items()}
    scheduler.controller = turns
    try:
        for ids in prompts:
            engine.generate(ids, SamplingParams(max_tokens=max_tokens, end_id=IGNORE_END))
    finally:
        scheduler.controller = loaded
    return turns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-ids", type=Path, required=True, help="JSON list of prompts' token ids")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tiers", default="", help="drafting tiers, comma-separated (default: all)")
    p.add_argument("--block", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--output", type=Path, default=None, help="a JSON file for the table")
    args = p.parse_args(argv)

    # One request at a time: one batch bucket, so that a CUDA engine warms up that bucket's graphs alone.
    engine = open_engine(args.engine, device=args.device, serving=SchedulerConfig(max_batch_size=1))
    names = engine.scheduler.controller.names if engine.scheduler.controller else []
    chosen = args.tiers.split(",") if args.tiers else names[1:]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise SystemExit(f"--tiers {','.join(unknown)}: not this engine's; it has {', '.join(names[1:])}")
    order = [names.index(n) for n in chosen]
    prompts = load_prompt_ids(args.prompt_ids, args.prompts)
    engine.generate(prompts[0], SamplingParams(max_tokens=8, end_id=IGNORE_END))  # first-use costs

    def mean(xs: list[float] | None) -> float | None:
        return round(statistics.mean(xs), 3) if xs else None

    table: dict[str, dict[str, Any]] = {n: {} for n in chosen}
    for index, name in zip(order, chosen):
        t = run(engine, prompts, [index], 1, args.max_tokens)
        table[name]["alone"] = mean(t.records.get((index, False), []) + t.records.get((index, True), []))
        print(f"{name:>10} alone {table[name]['alone']}", flush=True)
    for block in args.block:
        t = run(engine, prompts, order, block, args.max_tokens)
        for index, name in zip(order, chosen):
            first, later = t.records.get((index, True)), t.records.get((index, False))
            table[name][f"block {block}: first"] = mean(first)
            if block > 1:
                table[name][f"block {block}: later"] = mean(later)
        print(f"block {block} done", flush=True)
    columns = list(next(iter(table.values())).keys())
    print(f"{'tier':>10} " + " ".join(f"{c:>17}" for c in columns))
    for name, row in table.items():
        print(f"{name:>10} " + " ".join(f"{str(row.get(c)):>17}" for c in columns))
    if args.output is not None:
        doc = {"engine": str(args.engine), "prompts": len(prompts), "max_tokens": args.max_tokens, "table": table}
        args.output.write_text(json.dumps({**doc, "environment": environment(engine.device)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
