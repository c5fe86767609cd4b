"""The EAGLE dynamic step on random bf16 weights, A/B by kernel settings, on CUDA (EAGLE-2 or EAGLE-3 drafter).

A dynamic tree always keeps max_draft_len nodes and the catch-up always runs max_depth + 1 pairs, so a
step's kernels, and its time, do not depend on the weights: random ones measure what the trained draft's
step costs, with no model to carry. Each variant (a KernelTuning: "base" or FIELD=VALUE,...) gets its
own engines, compiled and captured under its tuning; then requests of --tokens tokens after a
--prompt-token prompt run round by round, variants interleaved, each beside a plain engine of the same
target. Printed per variant: ms a decode step ((request - 1-token request) / steps), the plain engine's
ms a token, and the tokens/s and × plain these give at --acceptance tokens a step (the trained draft's
on MT-bench; the real bench measures it). --profile adds, per variant, one profiled request: kernels,
device-busy and launch-gap microseconds a step, and the kernels by time.

  python -m pipeline.bench.probes.eagle_step base tree_min_blocks_per_split=16 --profile
  python -m pipeline.bench.probes.eagle_step base --shape llama3-8b --draft eagle3 --draft-vocab 32000
  python -m pipeline.bench.probes.eagle_step base --device cpu --shape tiny --tokens 16 --rounds 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.bench.probes.variants import HELP, parse_variants
from pipeline.bench.speed import SEED, SHAPES, SINGLE_STREAM, _IdsOnly, random_model
from pipeline.engine.config import DynamicTreeConfig, EngineLimits, SpecConfig
from pipeline.engine.eagle import Eagle3Net, EagleNet, EagleProposer
from pipeline.engine.kernels.routing import attach
from pipeline.engine.kernels.tuning import KernelTuning
from pipeline.engine.loader import eagle3_capture_layers
from pipeline.engine.model import ModelConfig
from pipeline.engine.request import SamplingParams
from pipeline.engine.runner import Engine, prepare_kernels

# The trained EAGLE-2 draft's tokens a step on all 80 MT-bench first turns, bf16, depth 4 / top-k 8 / 63 nodes.
TRAINED_ACCEPTANCE = 3.326
STEP_GAP_US = 50.0  # a device gap longer than this is the host's (a read-back, a new request), not a launch's
ROWS = 30


def random_drafter(
    shape: ModelConfig, device: torch.device, dtype: torch.dtype, kind: str, draft_vocab: int | None
) -> EagleNet | Eagle3Net:
    """EAGLE-2's drafter (the target's whole LM head) or EAGLE-3's (its own, over draft_vocab tokens)."""
    one_layer = replace(shape, num_layers=1)
    net: EagleNet | Eagle3Net
    if kind == "eagle":
        net = random_model(one_layer, device, dtype, lambda cfg: EagleNet(cfg, fc_bias=False), SEED + 1)
    else:
        vocab = draft_vocab or shape.vocab_size
        # Clamped for the tiny smoke-test shape, whose 2 layers TensorRT-LLM's default does not fit.
        layers = tuple(sorted({min(max(i, 0), shape.num_layers - 1) for i in eagle3_capture_layers(shape.num_layers)}))
        net = random_model(one_layer, device, dtype, lambda cfg: Eagle3Net(cfg, layers, vocab), SEED + 1)
    if kind == "eagle3" and draft_vocab:
        assert isinstance(net, Eagle3Net)
        # Any set of target ids keeps the step's kernels, hence its time: the first draft_vocab of a permutation.
        keep = torch.randperm(shape.vocab_size, generator=torch.Generator().manual_seed(SEED))[:draft_vocab].sort()[0]
        net.set_d2t((keep - torch.arange(draft_vocab)).to(device))
    prepare_kernels(net)
    return net


def timed(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, int]:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = engine.generate(prompt, SamplingParams(max_tokens=tokens, end_id=-1))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result.stats.steps


def decode_ms(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(ms a decode step, ms of the 1-token request: prefill, the drafter's prompt pass, first token)."""
    first, _ = timed(engine, prompt, 1)
    full, steps = timed(engine, prompt, tokens)
    return (full - first) * 1e3 / steps, first * 1e3


def profile_steps(engine: Engine, prompt: list[int], tokens: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, steps = timed(engine, prompt, tokens)
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])]
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        per_name[e.name][0] += 1
        per_name[e.name][1] += e.time_range.elapsed_us()
    return {
        "steps": steps,
        "kernels": len(kernels) / steps,
        "busy_us": sum(e.time_range.elapsed_us() for e in kernels) / steps,
        "launch_gap_us": sum(g for g in gaps if 0 < g <= STEP_GAP_US) / steps,
        "host_gap_us": sum(g for g in gaps if g > STEP_GAP_US) / steps,
        "per_name": sorted(
            ((n, c / steps, us / steps, us / c) for n, (c, us) in per_name.items()), key=lambda row: -row[2]
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help=HELP)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument(
        "--max-seq-len",
        type=int,
        default=1024,
        help="the engines' cache (make build-engines builds 1024): attention splits follow its size",
    )
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=63, help="draft tokens a tree keeps (max_draft_len)")
    ap.add_argument(
        "--draft",
        default="eagle",
        choices=("eagle", "eagle3"),
        help="EAGLE-2's drafter (the target's LM head) or EAGLE-3's (own LM head, --draft-vocab)",
    )
    ap.add_argument("--draft-vocab", type=int, default=None, help="EAGLE-3: tokens of its LM head (default: all)")
    ap.add_argument("--acceptance", type=float, default=TRAINED_ACCEPTANCE)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the timings and profiles here")
    args = ap.parse_args()
    variants = parse_variants(ap, args.variants)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    if args.draft_vocab and (args.draft != "eagle3" or not 0 < args.draft_vocab <= shape.vocab_size):
        ap.error(f"--draft-vocab {args.draft_vocab}: needs --draft eagle3 and at most {shape.vocab_size} tokens")
    target = random_model(shape, device, dtype)
    # Both attached again under each variant's tuning (use).
    drafter = random_drafter(shape, device, dtype, args.draft, args.draft_vocab)

    def use(tuning: KernelTuning) -> None:
        """Route the target and the drafter through the kernels with `tuning` (CUDA; the CPU keeps oneDNN)."""
        if device.type == "cuda":
            attach(target, tuning=tuning)
            attach(drafter, tuning=tuning)

    prompt = torch.randint(shape.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    slots = max(args.max_seq_len, args.prompt_tokens + args.tokens + 1)
    spec = SpecConfig(
        mode="eagle",
        max_draft_len=args.nodes,
        dynamic_tree=DynamicTreeConfig(top_k=args.top_k, depth=args.depth, max_non_leaves_per_layer=args.top_k),
    )
    limits = EngineLimits(1, args.prompt_tokens, slots, args.nodes)
    engines: dict[str, tuple[Engine, Engine]] = {}
    with torch.inference_mode():
        for name, tuning in variants.items():
            start = time.time()
            use(tuning)
            proposer = EagleProposer(drafter, slots, None, spec.dynamic_tree, args.nodes)
            eagle = Engine(target, _IdsOnly(), limits, spec, proposer)
            plain = Engine(
                target, _IdsOnly(), EngineLimits(1, args.prompt_tokens, slots, 0), SpecConfig(), serving=SINGLE_STREAM
            )
            use(tuning)  # an Engine attaches its target with the default tuning; its graphs are captured below
            for engine in (eagle, plain):
                engine.warm_up()
                engine.generate(prompt, SamplingParams(max_tokens=args.tokens, end_id=-1))
            engines[name] = eagle, plain
            print(f"{name}: engines compiled and captured in {time.time() - start:.1f} s", flush=True)
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in args.variants if r % 2 == 0 else args.variants[::-1]:
                use(variants[name])
                eagle, plain = engines[name]
                step, first = decode_ms(eagle, prompt, args.tokens)
                plain_step, _ = decode_ms(plain, prompt, args.tokens)
                runs[name].append((step, first, plain_step))
        profiles = {}
        if args.profile and device.type == "cuda":
            for name in args.variants:
                use(variants[name])
                profiles[name] = profile_steps(engines[name][0], prompt, args.tokens)
                if name == args.variants[0]:
                    profiles["plain"] = profile_steps(engines[name][1], prompt, args.tokens)

    a = args.acceptance
    drafted = f"{args.draft} drafter" + (f" over {args.draft_vocab} tokens" if args.draft_vocab else "")
    print(
        f"\n{args.shape} random weights, {dtype}, {drafted}, dynamic depth {args.depth} top-k {args.top_k} "
        f"{args.nodes} nodes, {args.tokens} tokens after {args.prompt_tokens}, {args.rounds} rounds; "
        f"at {a} tokens a step:"
    )
    print(f"{'ms/step':>8} {'1-token ms':>10} {'plain ms':>8} {'tok/s':>7} {'x plain':>7}  variant")
    for name, rows in runs.items():
        step, first, plain_step = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"{step:8.3f} {first:10.2f} {plain_step:8.3f} {a / step * 1e3:7.0f} {a * plain_step / step:7.2f}  {name}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "profiles": profiles}, indent=1
            )
        )
    for name, p in profiles.items():
        print(
            f"\n{name}: {p['kernels']:.0f} kernels, busy {p['busy_us']:.0f} us, "
            f"launch gaps {p['launch_gap_us']:.0f} us, host gaps {p['host_gap_us']:.0f} us a step ({p['steps']} steps)"
        )
        print(f"  {'kernel':<78} {'calls':>6} {'us/step':>8} {'us/call':>8}")
        for kernel, calls, us, per in p["per_name"][:ROWS]:
            print(f"  {kernel[:78]:<78} {calls:6.1f} {us:8.1f} {per:8.2f}")


if __name__ == "__main__":
    main()
