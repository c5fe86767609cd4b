#!/usr/bin/env python3
"""The kernels of one captured step of the Llama-3-8B shape (random bf16 weights) on CUDA, a
decode step or the verification of a tree: per kernel name, calls and microseconds per step; per
step, the time the device is busy against the span from the first kernel to the last. Busy time
over the weight-read floor is what the kernels lose; span minus busy is what launches and
dependencies between kernels lose. Then the decode loop's tokens/s (SPECPIPE_COMPILE=0 compares
graphs of uncompiled kernels).

  python3 build/probe_step.py [--kernels fused|gemv|off] [--context 128] [--tree 64]   # on CUDA
      [--gated] [--no-rope-gemv]   # the fused layer's kernel-saving flags
"""
import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from pipeline.bench.speed import SHAPES, _IdsOnly, decode_rate, random_model, streamed_bytes  # noqa: E402
from pipeline.engine import fused, fused_kernels  # noqa: E402
from pipeline.engine.config import EngineLimits, SpecConfig  # noqa: E402
from pipeline.engine.request import SamplingParams  # noqa: E402
from pipeline.engine.runner import Engine  # noqa: E402
from pipeline.engine.tree import MC_SIM_7B_63, build_tree  # noqa: E402

STEPS = 20
PAUSE_S = 0.002  # host sleep between profiled steps: the idle gap that separates them in the trace
STEP_GAP_US = 1000.0
ROWS = 25
READ_TBPS = 4.1  # the H200's measured read bandwidth, for the floor
LOOP_TOKENS = 128
LOOP_REPEATS = 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=None, choices=fused.LEVELS)
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the step")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--tree", type=int, default=1, help="tokens per step: 1 decodes, more verifies a tree")
    ap.add_argument("--attention-chunk", type=int, default=None, help="try another ATTENTION_CHUNK_SLOTS")
    ap.add_argument("--gemv", default=None, help="try another GEMV configuration: rows,columns,warps")
    ap.add_argument("--gated", action="store_true", help="SiLU-and-multiply inside the fc_gate GEMV (fused.GATED_GEMV)")
    ap.add_argument("--no-rope-gemv", action="store_true",
                    help="rotary and the cache write in a kernel after the QKV GEMV (fused.ROPE_IN_GEMV off)")
    args = ap.parse_args()
    fused.GATED_GEMV = args.gated
    fused.ROPE_IN_GEMV = not args.no_rope_gemv
    if args.attention_chunk:
        fused_kernels.ATTENTION_CHUNK_SLOTS = args.attention_chunk
    if args.gemv:
        fused_kernels.BLOCK_ROWS, fused_kernels.BLOCK_K, fused_kernels.NUM_WARPS = map(int, args.gemv.split(","))
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = random_model(SHAPES[args.shape], device, torch.bfloat16)
    engine = Engine(model, _IdsOnly(), EngineLimits(1, args.context, args.context + LOOP_TOKENS + 64, 0), SpecConfig())
    if args.kernels:
        fused.attach(model, args.kernels)
    prompt = torch.randint(SHAPES[args.shape].vocab_size, (args.context,)).tolist()
    tree = build_tree(MC_SIM_7B_63[:args.tree - 1]).to(device) if args.tree > 1 else None
    tokens = torch.zeros(args.tree, dtype=torch.long, device=device)
    depths = tree.depths if tree is not None else torch.zeros(1, dtype=torch.long, device=device)

    def step() -> torch.Tensor:
        target = engine.forward(tokens, args.context, args.context + depths, None if tree is None else tree.mask)
        return engine.greedy(target.hidden)

    with torch.inference_mode():
        engine.generate(prompt, SamplingParams(max_tokens=1, end_id=-1))  # prefill: the cache holds the context
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step()
                torch.cuda.synchronize()
                time.sleep(PAUSE_S)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    steps, current = [], []
    for e in kernels:
        if current and e.time_range.start - current[-1].time_range.end > STEP_GAP_US:
            steps.append(current)
            current = []
        current.append(e)
    steps.append(current)
    spans = [s[-1].time_range.end - s[0].time_range.start for s in steps]
    busy = [sum(e.time_range.elapsed_us() for e in s) for s in steps]
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        per_name[e.name][0] += 1
        per_name[e.name][1] += e.time_range.elapsed_us()
    n = len(steps)
    floor_us = streamed_bytes(model) / (READ_TBPS * 1e12) * 1e6
    print(f"{args.shape}, kernels={args.kernels or fused.level()}, context {args.context}, {args.tree} tokens a step, "
          f"{n} steps profiled, attention chunk {fused_kernels.ATTENTION_CHUNK_SLOTS}, GEMV "
          f"{fused_kernels.BLOCK_ROWS},{fused_kernels.BLOCK_K},{fused_kernels.NUM_WARPS}, gated {fused.GATED_GEMV}, "
          f"rope in GEMV {fused.ROPE_IN_GEMV}")
    print(f"per step: span {statistics.median(spans):.0f} us, busy {statistics.median(busy):.0f} us, "
          f"{len(kernels) / n:.0f} kernels, weight-read floor at {READ_TBPS} TB/s {floor_us:.0f} us")
    print(f"{'kernel':<70} {'calls':>6} {'us/step':>9} {'us/call':>8}")
    for name, (calls, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:ROWS]:
        print(f"{name[:70]:<70} {calls / n:>6.0f} {us / n:>9.1f} {us / calls:>8.2f}")
    if tree is None:
        with torch.inference_mode():
            rate = decode_rate(engine, prompt, LOOP_TOKENS, LOOP_REPEATS)
        print(f"decode loop: {rate:.1f} tok/s, {1e3 / rate:.3f} ms/token = {floor_us / 1e6 * rate:.1%} of the floor")


if __name__ == "__main__":
    main()
