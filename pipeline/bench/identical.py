"""Do a request's tokens depend on the batch or on speculation? Greedy outputs compared, and their speed.

    python -m pipeline.bench.identical --engine PLAIN_DIR [--spec DIR ...] --prompt-ids FILE --device cuda
        [--invariant] [--concurrency 1,16,64] [--max-tokens 256] [--speculation adaptive|TIER]

The plain engine's outputs one request at a time (concurrency 1) are the reference; every other run
(the plain engine at each concurrency, each speculative engine at each concurrency) is compared with it
request by request: identical outputs, and the mean share of an output before its first difference.
Runs at concurrency C submit C requests at a time and wait for all of them. Writes one JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.prompts import load_prompt_ids
from pipeline.bench.speed import device_tag, environment, save_json
from pipeline.engine.loader import open_engine
from pipeline.engine.runner import Engine
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.scheduler import SchedulerConfig

IGNORE_END = -1


def run(engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt's greedy output, `concurrency` requests at a time; and the output tokens per second."""
    params = SamplingParams(max_tokens=max_tokens, end_id=IGNORE_END)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        streams = [engine.stream(p, params) for p in prompts[i : i + concurrency]]
        for stream in streams:
            outputs.append(next(c.result for c in stream if c.finished and c.result is not None).token_ids)
    seconds = time.perf_counter() - start
    return outputs, sum(len(o) for o in outputs) / seconds


def compare(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    same = sum(g == w for g, w in zip(got, want))
    shares = []
    for g, w in zip(got, want):
        first = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        shares.append(first / max(1, len(w)))
    return {"identical": same, "requests": len(want), "mean_share_before_difference": sum(shares) / len(shares)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, required=True, help="the plain engine (the reference)")
    p.add_argument("--spec", type=Path, nargs="*", default=[], help="speculative engines of the same target")
    p.add_argument("--prompt-ids", type=Path, required=True)
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--device", default="cuda")
    p.add_argument("--invariant", action="store_true", help="batch-invariant kernels (SchedulerConfig.invariant)")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument(
        "--speculation", default="adaptive", help="the speculative engines' tiers: adaptive, full, or one tier's name"
    )
    p.add_argument("--output", type=Path, default=Path("bench"))
    args = p.parse_args(argv)
    prompts = load_prompt_ids(args.prompt_ids, args.num_prompts)
    levels = [int(c) for c in args.concurrency.split(",")]
    serving = SchedulerConfig(
        max_batch_size=args.max_batch_size, invariant=args.invariant, speculation=args.speculation
    )
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    device = torch.device(args.device)
    stem = f"identical-{'invariant' if args.invariant else 'default'}-{device_tag(device)}"
    if args.speculation != "adaptive":
        stem += f"-{args.speculation}"
    record = {"environment": environment(device), "args": {k: str(v) for k, v in vars(args).items()}}
    for folder in [args.engine, *args.spec]:
        engine = open_engine(folder, device=args.device, serving=serving)
        engine.warm_up((0.0,))  # graphs captured (and tiers timed) before the timed runs
        for c in levels:
            outputs, speed = run(engine, prompts, c, args.max_tokens)
            if reference is None:
                reference = outputs
            row = {"engine": folder.name, "concurrency": c, "output_tokens_per_s": speed, **compare(outputs, reference)}
            rows.append(row)
            print(
                f"{folder.name:>16} C={c:>3}  {speed:8.1f} tok/s  identical {row['identical']}/{row['requests']}  "
                f"share before a difference {row['mean_share_before_difference']:.2f}",
                flush=True,
            )
            save_json(args.output / f"{stem}.json", {**record, "rows": rows})  # what ran so far, if a run is cut
        del engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
