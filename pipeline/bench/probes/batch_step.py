"""The plain engine's batched decode step on random weights, A/B by kernel settings: served against device time.

Each variant (a KernelTuning: "base" or FIELD=VALUE,...) gets its own plain engine over one random target. For
each row count R, R requests of --tokens tokens after a --prompt-tokens prompt are submitted together and
stream through the scheduler; `served` is the median gap between the first request's tokens once all R
decode (prefills are one an iteration). `device` replays that bucket's captured step back to back (CUDA
events; no host work between replays) and `kernels` counts a replay's kernels under the profiler. Served
well above device: the host (the scheduler's loop, the clients) sets the step time.

  python -m pipeline.bench.probes.batch_step base paged_decode_rows=2/16 --rows 1,8,64
  python -m pipeline.bench.probes.batch_step base --device cpu --shape tiny --rows 1,4 --tokens 24   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pipeline.bench.probes.variants import HELP, parse_variants
from pipeline.bench.speed import SHAPES, _IdsOnly, random_model
from pipeline.engine.config import EngineLimits, SpecConfig
from pipeline.engine.kernels.routing import attach
from pipeline.engine.request import SamplingParams
from pipeline.engine.runner import Engine
from pipeline.engine.scheduler import SchedulerConfig

REPLAYS = 200  # back-to-back replays timed for a bucket's device time
PROFILED_REPLAYS = 10


def served_ms(engine: Engine, prompt: list[int], rows: int, tokens: int) -> float:
    """Median ms between the first request's tokens while `rows` requests decode together."""
    params = SamplingParams(max_tokens=tokens, end_id=-1)
    streams = [engine.stream(prompt, params) for _ in range(rows)]
    times = []
    for chunk in streams[0]:
        times.extend([time.perf_counter()] * len(chunk.token_ids))
    for rest in streams[1:]:
        for _ in rest:
            pass
    gaps = [b - a for a, b in zip(times, times[1:])][rows:]  # after every row's prefill
    return statistics.median(gaps) * 1e3


def device_ms(engine: Engine, rows: int) -> tuple[float, float]:
    """(ms a replay of the rows' bucket's greedy decode graph, kernels a replay)."""
    batch = engine.scheduler.batch
    bucket = next(b for b in batch.buckets if b >= rows)
    graph = batch.graphs[(bucket, "greedy")]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph()
    start.record()
    for _ in range(REPLAYS):
        graph()
    end.record()
    end.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_REPLAYS):
            graph()
        torch.cuda.synchronize()
    kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    return start.elapsed_time(end) / REPLAYS, kernels / PROFILED_REPLAYS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help=HELP)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument(
        "--max-seq-len", type=int, default=2048, help="the engine's cache a row (make build-engines builds 2048)"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    variants = parse_variants(ap, args.variants)
    if args.tokens <= max(args.rows) + 8:
        ap.error(f"--tokens {args.tokens}: give more than the most rows + 8, so that every row decodes a while")
    if args.prompt_tokens + args.tokens > args.max_seq_len:
        ap.error(f"--prompt-tokens + --tokens exceed --max-seq-len {args.max_seq_len}")

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    target = random_model(shape, device, dtype)
    prompt = torch.randint(shape.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    limits = EngineLimits(max(args.rows), args.prompt_tokens, args.max_seq_len, 0)
    results = []
    with torch.inference_mode():
        for name, tuning in variants.items():
            start = time.time()
            engine = Engine(target, _IdsOnly(), limits, SpecConfig(), serving=SchedulerConfig())
            if device.type == "cuda":
                attach(target, tuning=tuning)  # before any of this engine's graphs is captured
            for rows in args.rows:  # compiles and captures the rows' bucket
                served_ms(engine, prompt, rows, rows + 16)
            print(f"{name}: compiled and captured in {time.time() - start:.1f} s", flush=True)
            for rows in args.rows:
                row = {"variant": name, "rows": rows, "served_ms": served_ms(engine, prompt, rows, args.tokens)}
                if device.type == "cuda":
                    row["device_ms"], row["kernels"] = device_ms(engine, rows)
                results.append(row)
                print(json.dumps(row), flush=True)
            del engine
    print(f"\n{'variant':<28} {'rows':>5} {'served ms':>10} {'device ms':>10} {'kernels':>8} {'tok/s':>9}")
    for r in results:
        dev = f"{r['device_ms']:>10.3f} {r['kernels']:>8.0f}" if "device_ms" in r else f"{'-':>10} {'-':>8}"
        tokens_per_s = r["rows"] / r["served_ms"] * 1e3
        print(f"{r['variant']:<28} {r['rows']:>5} {r['served_ms']:>10.3f} {dev} {tokens_per_s:>9.0f}")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "results": results}, indent=1))


if __name__ == "__main__":
    main()
