#!/usr/bin/env python3
"""A/B of kernel settings in the engine's own decode loop, on CUDA: one random bf16 model, one Engine
a variant (each compiles and captures its graphs under its settings), then 256-token decode loops
interleaved round by round, so that a machine drifting over minutes moves every variant alike.
Prints each variant's median tokens/s, its share of a READ_TBPS floor, and whether its tokens equal
the first variant's (they may not across warp counts: float32 row sums reduce in another order).

A variant is a comma-separated list of MODULE.NAME=VALUE settings of pipeline.engine.fused or
fused_kernels (the kernels read their block sizes from fused_kernels, the layer's flags from fused);
"base" is the committed configuration.

  python3 build/probe_ab.py base fused_kernels.BLOCK_ROWS=2,fused_kernels.NUM_WARPS=4 fused.ROPE_IN_GEMV=0
  python3 build/probe_ab.py --shape smollm2 --rounds 10 base fused_kernels.BLOCK_ROWS=2
  python3 build/probe_ab.py --tree 64 base fused.ROWS_MLP=0   # a 64-token verification pass instead

Session j chose the GEMV configuration this way (BENCHMARKS.md §1 (j)): a probe of the products alone put
the candidates within 5 % of each other, the loop 10 % apart.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.bench.speed import SHAPES, _IdsOnly, decode_rates, random_model, streamed_bytes, verify_costs  # noqa: E402
from pipeline.engine import fused, fused_kernels  # noqa: E402
from pipeline.engine.config import EngineLimits, SpecConfig  # noqa: E402
from pipeline.engine.request import SamplingParams  # noqa: E402
from pipeline.engine.runner import Engine  # noqa: E402

READ_TBPS = 4.1  # the H200's measured read bandwidth, for the floor (as build/probe_step.py)
PROMPT_TOKENS = 128
MODULES = {"fused": fused, "fused_kernels": fused_kernels}


def parse(variant: str) -> dict[tuple[str, str], int | float | str | tuple]:
    if variant == "base":
        return {}
    settings = {}
    for item in variant.split(","):
        key, _, value = item.partition("=")
        module, _, name = key.partition(".")
        if module not in MODULES or not hasattr(MODULES[module], name) or not value:
            sys.exit(f"{item!r}: write MODULE.NAME=VALUE with MODULE one of {', '.join(MODULES)} and NAME "
                     f"one of its settings (e.g. fused_kernels.BLOCK_ROWS=8)")
        settings[(module, name)] = number_or_text(value)
    return settings


def variant_settings(names: list[str]) -> tuple[dict[str, dict], Callable[[dict], None]]:
    """Each variant's settings, and a function that puts one variant's in place: its own values, and the
    committed ones of every setting that another variant changes."""
    variants = {v: parse(v) for v in names}
    committed = {key: getattr(MODULES[key[0]], key[1]) for s in variants.values() for key in s}

    def apply(settings: dict) -> None:
        for (module, name), value in {**committed, **settings}.items():
            setattr(MODULES[module], name, type(committed[(module, name)])(value))

    return variants, apply


def number_or_text(value: str) -> int | float | str | tuple:
    """8 -> 8, 0.5 -> 0.5, tf32x3 -> "tf32x3" (fused_kernels.FLOAT32_DOT takes a name), 64/128/4/3 ->
    (64, 128, 4, 3) (fused_kernels.ROWS_GEMM_TILE takes a tuple)."""
    if "/" in value:
        return tuple(number_or_text(part) for part in value.split("/"))
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help='"base" or MODULE.NAME=VALUE[,MODULE.NAME=VALUE...]')
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--tree", type=int, default=0,
                    help="time the verification pass of a tree of this many tokens against a 1-token pass instead")
    args = ap.parse_args()
    variants, apply = variant_settings(args.variants)

    device = torch.device("cuda")
    model = random_model(SHAPES[args.shape], device, torch.bfloat16)
    floor_s = streamed_bytes(model) / (READ_TBPS * 1e12)
    prompt = torch.randint(SHAPES[args.shape].vocab_size, (PROMPT_TOKENS,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    limits = EngineLimits(1, PROMPT_TOKENS, PROMPT_TOKENS + args.tokens + 64, 0)
    engines, tokens = {}, {}
    with torch.inference_mode():
        for name, settings in variants.items():
            apply(settings)
            start = time.time()
            engines[name] = Engine(model, _IdsOnly(), limits, SpecConfig())
            engines[name].warm_up()
            tokens[name] = engines[name].generate(prompt, SamplingParams(max_tokens=args.tokens, end_id=-1)).token_ids
            print(f"{name}: compiled and captured in {time.time() - start:.1f} s, tokens equal to the first "
                  f"variant's: {tokens[name] == tokens[args.variants[0]]}", flush=True)
        rates = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in (args.variants if r % 2 == 0 else args.variants[::-1]):
                apply(variants[name])
                if args.tree:
                    rates[name].append({k: v * 1e3 for k, v in verify_costs(
                        engines[name], PROMPT_TOKENS, (args.tree,), 1).items()})
                else:
                    rates[name] += decode_rates(engines[name], prompt, args.tokens, 1)
    if args.tree:
        print(f"{args.shape}, verification after {PROMPT_TOKENS} tokens, {args.rounds} rounds: ms of a pass")
        for name, runs in rates.items():
            one, tree = (statistics.median(run[k] for run in runs) for k in (1, args.tree))
            ratio = statistics.median(run[args.tree] / run[1] for run in runs)
            print(f"  1 token {one:.3f}  {args.tree} tokens {tree:.3f}  ratio {ratio:.3f}  {name}   (ratios "
                  + " ".join(f"{run[args.tree] / run[1]:.3f}" for run in runs) + ")")
        return
    print(f"{args.shape}, {args.tokens} tokens after {PROMPT_TOKENS}, {args.rounds} rounds; floor at {READ_TBPS} TB/s")
    for name, runs in rates.items():
        median = statistics.median(runs)
        print(f"{median:8.1f} tok/s = {median * floor_s:6.1%}  {name}   (runs {' '.join(f'{x:.1f}' for x in runs)})")


if __name__ == "__main__":
    main()
