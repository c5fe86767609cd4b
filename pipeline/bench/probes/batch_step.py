"""The plain engine's batched decode step on random weights, A/B by kernel settings: served against device time.

Each variant (a KernelTuning: "base" or FIELD=VALUE,...) gets its own plain engine over one random target. For
each row count R, R requests of --tokens tokens after a --prompt-tokens prompt are submitted together and
stream through the scheduler; `served` is the median gap between the first request's tokens once all R
decode (prefills are one an iteration). `device` replays that bucket's captured step back to back (CUDA
events; no host work between replays) and `kernels` counts a replay's kernels under the profiler. Served
well above device: the host (the scheduler's loop, the clients) sets the step time.

  python -m pipeline.bench.probes.batch_step base paged_decode_rows=2/16 --rows 1,8,64
  python -m pipeline.bench.probes.batch_step base --device cpu --shape tiny --rows 1,4 --tokens 24   # smoke test
  python -m pipeline.bench.probes.batch_step base --draft eagle --rows 1 --compile-tiers '' --compile-tiers dynamic64

--draft eagle measures an engine with a random EAGLE drafter instead (--draft plain,eagle: both, one after the
other): each of its tiers (--tiers) runs alone (the controller's policy set to it, no request paused for its
acceptance) for the same rows, with the same measures plus `wall`, the controller's read-to-read seconds a step
of that tier. Random drafts are rejected, so a drafting step emits one token a row: served and wall are the
step's time. The plain tier's device time is its deferring step's (most steps of a run of plain steps);
`catch_up_ms` is its other step's, which catches the drafter up on the pairs deferred.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.bench.load import random_engine, retune
from pipeline.bench.probes.variants import HELP, parse_variants
from pipeline.bench.speed import SHAPES, environment
from pipeline.engine.graphs import CapturedStep
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


def device_ms(graph: CapturedStep) -> tuple[float, float, dict[str, list[float]]]:
    """(ms a replay of a captured step, back to back; kernels a replay; [kernels, µs] a replay by name)."""
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
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name.setdefault(e.name[:80], [0.0, 0.0])
            entry[0] += 1 / PROFILED_REPLAYS
            entry[1] += e.time_range.elapsed_us() / PROFILED_REPLAYS
    kernels = sum(n for n, _ in by_name.values())
    return start.elapsed_time(end) / REPLAYS, kernels, dict(sorted(by_name.items(), key=lambda kv: -kv[1][1]))


def plain_rows(engine: Engine, name: str, prompt: list[int], rows: int, tokens: int) -> dict:
    row = {"variant": name, "tier": "-", "rows": rows, "served_ms": served_ms(engine, prompt, rows, tokens)}
    if engine.device.type == "cuda":
        batch = engine.scheduler.batch
        bucket = next(b for b in batch.buckets if b >= rows)
        row["device_ms"], row["kernels"], row["by_name"] = device_ms(batch.graphs[(bucket, "greedy")])
    return row


def tier_rows(engine: Engine, name: str, prompt: list[int], rows: int, tokens: int, tiers: list[str]) -> list[dict]:
    """Each tier run alone for `rows` requests: served, the controller's wall, device ms and kernels."""
    spec, controller = engine.scheduler.spec, engine.scheduler.controller
    assert spec is not None and controller is not None
    out = []
    for tier in tiers or controller.names:
        index = controller.names.index(tier)
        controller.config = replace(controller.config, policy=tier, request_min_steps=tokens)
        served_ms(engine, prompt, rows, rows + 16)  # captures the tier's graph in this bucket
        row = {"variant": name, "tier": tier, "rows": rows, "served_ms": served_ms(engine, prompt, rows, tokens)}
        bucket = spec.bucket(rows)
        row["wall_ms"] = controller.costs(bucket)[index] * 1e3
        if engine.device.type == "cuda":
            graph = spec.spec_graphs[(bucket, index, "greedy", index == 0)]
            row["device_ms"], row["kernels"], row["by_name"] = device_ms(graph)
            if index == 0:
                catch_up = spec.spec_graphs[(bucket, 0, "greedy", False)]
                row["catch_up_ms"], row["catch_up_kernels"], row["catch_up_by_name"] = device_ms(catch_up)
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("by_name")}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help=HELP)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument(
        "--draft",
        type=lambda s: s.split(","),
        default=["plain"],
        help="plain, eagle (a random EAGLE drafter's tiers) or plain,eagle",
    )
    ap.add_argument("--tiers", type=lambda s: s.split(","), default=[], help="with --draft: these tiers (all)")
    ap.add_argument(
        "--compile-tiers",
        action="append",
        default=None,
        help="with --draft: drafting tiers whose steps run compiled in buckets of up to 4 rows, comma-separated "
        "(SchedulerConfig.compile_tiers); repeated: each set in turn, '' for none (default: none)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    variants = parse_variants(ap, args.variants)
    if not set(args.draft) <= {"plain", "eagle"}:
        ap.error(f"--draft {','.join(args.draft)}: give plain, eagle or plain,eagle")
    if args.tokens <= max(args.rows) + 8:
        ap.error(f"--tokens {args.tokens}: give more than the most rows + 8, so that every row decodes a while")

    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    prompt = torch.randint(shape.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    with torch.inference_mode():
        runs = [(name, tuning, tiers) for name, tuning in variants.items() for tiers in args.compile_tiers or [""]]
        for variant, tuning, compiled in runs:
            name = variant + (f" compiled:{compiled}" if compiled else "")
            for kind in args.draft:
                draft = None if kind == "plain" else kind
                start = time.time()
                serving = SchedulerConfig(compile_tiers=tuple(t for t in compiled.split(",") if t))
                engine = random_engine(shape, device, max(args.rows), draft, serving)
                retune(engine, tuning)  # before any of this engine's graphs is captured
                for rows in args.rows:  # compiles and captures the rows' bucket (every tier's: calibration)
                    served_ms(engine, prompt, rows, rows + 16)
                print(f"{name} {kind}: compiled and captured in {time.time() - start:.1f} s", flush=True)
                for rows in args.rows:
                    if draft:
                        results += tier_rows(engine, name, prompt, rows, args.tokens, args.tiers)
                    else:
                        results.append(plain_rows(engine, name, prompt, rows, args.tokens))
                        print(json.dumps({k: v for k, v in results[-1].items() if k != "by_name"}), flush=True)
                del engine
    head = f"{'variant':<24} {'tier':<7} {'rows':>5} {'served ms':>10} {'wall ms':>8} {'device ms':>10} {'kernels':>8}"
    print("\n" + head + f" {'catch-up ms':>11}")
    for r in results:
        dev = f"{r['device_ms']:>10.3f} {r['kernels']:>8.0f}" if "device_ms" in r else f"{'-':>10} {'-':>8}"
        wall = f"{r['wall_ms']:>8.3f}" if "wall_ms" in r else f"{'-':>8}"
        catch_up = f"{r['catch_up_ms']:>11.3f}" if "catch_up_ms" in r else f"{'-':>11}"
        print(f"{r['variant']:<24} {r['tier']:<7} {r['rows']:>5} {r['served_ms']:>10.3f} {wall} {dev} {catch_up}")
    if args.json:
        env = environment(torch.device(args.device))
        args.json.write_text(json.dumps({"environment": env, "shape": args.shape, "results": results}, indent=1))


if __name__ == "__main__":
    main()
