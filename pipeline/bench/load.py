"""Serving under load: a concurrency sweep, measured the way vLLM's and TensorRT-LLM's users measure it.

    python -m pipeline.bench.load --engine DIR [--engine DIR ...] [--device cuda] [--triton] [--concurrency 1,4,16]
    python -m pipeline.bench.load --shape smollm2|llama3-8b --device cuda   # random weights, ids only

At each concurrency C, C clients each send their next request as soon as the previous one ends (closed
loop; with --request-rate R requests arrive as a Poisson process of R a second instead, at most C in
flight), MT-bench first turns with the chat template, the end id ignored so every reply has max_tokens tokens
(or with --length-spread a seeded length around it), until max(N * C, --min-requests) requests have
finished, N = --requests-per-client (8: a level's start and end, when fewer than C requests run, are a small
share of it). Reported per level: output tokens/s over the level's wall time, time to first token and
inter-token latency (p50, p99: each gap between streamed chunks shared by the tokens it brought), and peak
GPU memory. In-process the clients stream from `Engine.stream`; with --triton also through the bundled
tritonserver (gRPC streaming to the engine model, token ids in and out). --shape builds a plain engine of
random weights in that model's shape (output speed does not depend on the weights at a fixed length): the
prompts keep their token counts.
Writes <output>/load-<label>-<device>-<date>.json and a PNG of throughput and TTFT against concurrency.
With several --engine, each is swept in turn (one loaded at a time) and the speed-up of each over the first
(the plain engine) is printed and plotted against concurrency (speedup.py):
<output>/speedup-<first engine>-<device>-<date>.png.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.probes.variants import BASE, HELP, format_variant, parse_fields, parse_variant
from pipeline.bench.prompts import load_prompt_ids, load_prompts
from pipeline.bench.speed import SEED, SHAPES, _IdsOnly, device_tag, environment, random_model, save_json
from pipeline.engine.adaptive import AdaptiveConfig, TierController
from pipeline.engine.config import DynamicTreeConfig, EngineLimits, SpecConfig
from pipeline.engine.kernels.routing import attach
from pipeline.engine.kernels.tuning import KernelTuning
from pipeline.engine.loader import open_engine
from pipeline.engine.model import ModelConfig, Transformer
from pipeline.engine.runner import Engine
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.scheduler import Scheduler, SchedulerConfig
from pipeline.errors import USER_ERROR_EXIT_CODE, UserError

IGNORE_END = -1
CUDA_LEVELS = (1, 2, 4, 8, 16, 32, 64)
CPU_LEVELS = (1, 4, 16)
# A level's requests at least: a fresh batch bucket's first windows take turns between plain and drafting
# (adaptive.AdaptiveConfig: 7 windows of 32 steps), which must be a small share of a low-concurrency level.
MIN_REQUESTS = 32
REQUESTS_PER_CLIENT = 8
BANDWIDTH_BYTES = 1 << 31
BANDWIDTH_REPEATS = 20
PERCENTILES = (50, 99)
# Limits of the random-weight engines (--shape): MT-bench prompts fit, with room for 256 new tokens.
SHAPE_LIMITS = EngineLimits(max_batch_size=64, max_input_len=1024, max_seq_len=1536, max_draft_len=0)
# The tree of a random EAGLE drafter (--shape --draft eagle): the CUDA build's EAGLE-2 tree.
SHAPE_TREE = DynamicTreeConfig(top_k=8, depth=4, max_non_leaves_per_layer=8)
SHAPE_TREE_NODES = 63


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    gaps_s: list[float]  # one entry per token after the first: its share of the gap it arrived in
    total_s: float
    tokens: int
    steps: int = 0  # the engine's decode steps for the request (in-process only): tokens per step


Client = Callable[[list[int], SamplingParams], Timing]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def in_process_client(engine: Engine) -> Client:
    def run(ids: list[int], params: SamplingParams) -> Timing:
        start = last = time.perf_counter()
        ttft, gaps, tokens, steps = 0.0, [], 0, 0
        for chunk in engine.stream(ids, params):
            now = time.perf_counter()
            if chunk.result is not None:
                steps = chunk.result.stats.steps
            if chunk.token_ids:
                if tokens == 0:
                    ttft = now - start
                    gaps += [0.0] * (len(chunk.token_ids) - 1)
                else:
                    gaps += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
                tokens += len(chunk.token_ids)
                last = now
        return Timing(ttft, gaps, time.perf_counter() - start, tokens, steps)

    return run


def triton_client(url: str) -> Client:
    from pipeline.client.client import Sampling, generate_ids

    def run(ids: list[int], params: SamplingParams) -> Timing:
        reply = generate_ids(
            url,
            ids,
            Sampling(
                max_tokens=params.max_tokens,
                temperature=params.temperature or None,
                seed=params.seed,
                end_id=IGNORE_END,
            ),
            stream=True,
        )
        tokens = len(reply.output_ids)
        per_chunk = max(1, reply.responses - 1)
        share = (tokens - 1) / per_chunk if tokens > 1 else 1
        gaps = [g / share for g in reply.inter_token_latencies_s for _ in range(round(share))]
        return Timing(reply.ttft_s, gaps, reply.total_s, tokens)

    return run


@dataclass(frozen=True)
class LevelSize:
    """Requests a level sends: per_client for each client, at least minimum; request i's max_tokens is the
    level's times 1 + length_spread * u_i, u_i uniform in [-1, 1] and seeded by i (0: every reply alike, so
    requests started together end together, and their successors' prompts arrive together)."""

    per_client: int = REQUESTS_PER_CLIENT
    minimum: int = MIN_REQUESTS
    length_spread: float = 0.0
    # None: closed loop (each client sends its next request when the last ends); R: requests arrive as a
    # Poisson process of R a second (seeded), at most the level's concurrency in flight, later ones waiting.
    request_rate: float | None = None

    def total(self, concurrency: int) -> int:
        return max(self.per_client * concurrency, self.minimum)

    def max_tokens(self, i: int, max_tokens: int) -> int:
        if not self.length_spread:
            return max_tokens
        return max(1, round(max_tokens * (1 + self.length_spread * random.Random(SEED + i).uniform(-1, 1))))

    def gaps(self, total: int) -> list[float]:
        """Seconds before each request's arrival after the one before (the first arrives at once)."""
        assert self.request_rate is not None
        draw = random.Random(SEED)
        return [0.0] + [draw.expovariate(self.request_rate) for _ in range(total - 1)]


def run_level(
    client: Client, prompts: list[list[int]], concurrency: int, params: SamplingParams, size: LevelSize
) -> dict[str, Any]:
    total = size.total(concurrency)
    lock = threading.Lock()
    queue = list(range(total))
    timings: list[Timing] = []
    errors: list[str] = []

    def send(i: int) -> None:
        seed = SEED + i if params.temperature else params.seed
        request = SamplingParams(
            **{**params.__dict__, "seed": seed, "max_tokens": size.max_tokens(i, params.max_tokens)}
        )
        try:
            timing = client(prompts[i % len(prompts)], request)
        except Exception as exc:  # noqa: BLE001 - counted and reported, the sweep goes on
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")
            return
        with lock:
            timings.append(timing)

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            send(i)

    slots = threading.Semaphore(concurrency)

    def arriving(i: int) -> None:
        try:
            send(i)
        finally:
            slots.release()

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if size.request_rate is None:
        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
    else:  # each request at its arrival, once one of the `concurrency` slots is free
        threads = []
        for i, gap in enumerate(size.gaps(total)):
            time.sleep(gap)
            slots.acquire()
            threads.append(threading.Thread(target=arriving, args=(i,)))
            threads[-1].start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(t.tokens for t in timings)
    ttft = [t.ttft_s * 1e3 for t in timings]
    itl = [g * 1e3 for t in timings for g in t.gaps_s]
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "request_rate": size.request_rate,
        "requests": len(timings),
        "errors": errors,
        "output_tokens": tokens,
        "seconds": wall,
        "output_tokens_per_s": tokens / wall,
    }
    steps = sum(t.steps for t in timings)
    if steps:  # tokens a decode step emitted (1.0: plain; more: accepted drafts), the first token excluded
        out["tokens_per_step"] = (tokens - len(timings)) / steps
    for q in PERCENTILES:
        out[f"ttft_ms_p{q}"] = percentile(ttft, q)
        out[f"itl_ms_p{q}"] = percentile(itl, q)
    if torch.cuda.is_available():
        out["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


def sweep(
    client: Client,
    prompts: list[list[int]],
    levels: tuple[int, ...],
    params: SamplingParams,
    size: LevelSize,
    label: str,
    scheduler: Scheduler | None = None,
) -> list[dict[str, Any]]:
    """Each level's row; with the in-process engine's `scheduler`, its prefill share and, for a speculative
    engine, the tiers its controller chose and what it believed after the level."""
    controller = scheduler.controller if scheduler is not None else None
    client(prompts[0], SamplingParams(max_tokens=8, end_id=IGNORE_END))  # first-use costs out of the numbers
    rows = []
    for c in levels:
        before = dict(controller.chosen) if controller is not None else {}
        why = dict(controller.plain_why) if controller is not None else {}
        chunks, seconds = (scheduler.prefill_chunks, scheduler.prefill_seconds) if scheduler else (0, 0.0)
        closed = controller.closed if controller is not None else 0
        row = run_level(client, prompts, c, params, size)
        if scheduler is not None:  # the share of the level's wall time its prefills held the scheduler
            row["prefill_chunks"] = scheduler.prefill_chunks - chunks
            row["prefill_share"] = (scheduler.prefill_seconds - seconds) / row["seconds"]
        if controller is not None:  # the tiers a speculative engine's controller chose at this level
            row["tiers"] = {
                controller.names[i]: n - before.get(i, 0)
                for i, n in sorted(controller.chosen.items())
                if n > before.get(i, 0)
            }
            row["plain_why"] = {k: n - why.get(k, 0) for k, n in controller.plain_why.items() if n > why.get(k, 0)}
            row["controller"] = controller_state(controller, closed)
        rows.append(row)
        print(
            f"{label:>24}  C={c:>3}  {row['output_tokens_per_s']:9.1f} tok/s  TTFT p50 {row['ttft_ms_p50']:8.1f} "
            f"p99 {row['ttft_ms_p99']:8.1f} ms  ITL p50 {row['itl_ms_p50']:6.2f} p99 {row['itl_ms_p99']:6.2f} ms"
            + (f"  tokens/step {row['tokens_per_step']:.2f}" if row.get("tokens_per_step") else "")
            + (f"  prefill {row['prefill_share']:.0%}" if "prefill_share" in row else "")
            + (f"  tiers {row['tiers']}" if row.get("tiers") else "")
            + (f"  plain: {row['plain_why']}" if row.get("plain_why") else "")
            + (f"  errors {len(row['errors'])}" if row["errors"] else ""),
            flush=True,
        )
    return rows


def controller_state(controller: TierController, closed_before: int = 0) -> dict[str, Any]:
    """What the controller believes after a level: each bucket's expected step ms a tier, each tier's expected
    accepted tokens a drafting row (for comparing its choices with what the tiers did), the tokens a second
    each bucket's windows delivered, plain and drafting, with how many windows were measured, and the windows
    closed since `closed_before` (bucket, mode, steps, tokens, seconds, prompt chunks prefilled)."""
    new = min(controller.closed - closed_before, len(controller.history))
    windows = list(controller.history)[len(controller.history) - new :] if new else []
    return {
        "step_ms": {b: [round(c * 1e3, 3) for c in controller.costs(b)] for b in sorted(controller.ratio)},
        "expected_accepted": [round(controller.expected(i), 3) for i in range(len(controller.tiers))],
        "tiers": controller.names,
        "window_tokens_per_s": {
            f"{b} {'drafting' if d else 'plain'}": round(rate) for (b, d), rate in sorted(controller.delivered.items())
        },
        "windows_measured": {
            f"{b} {'drafting' if d else 'plain'}": n for (b, d), n in sorted(controller.measured.items())
        },
        "windows": [
            [
                w.bucket,
                "drafting" if w.drafting else "plain" if w.measured else "warm-up",
                w.steps,
                w.tokens,
                round(w.seconds, 6),
                w.prefills,
            ]
            for w in windows
        ],
    }


def plot(results: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in results.items():
        cs = [r["concurrency"] for r in rows]
        left.plot(cs, [r["output_tokens_per_s"] for r in rows], marker="o", label=label)
        right.plot(cs, [r["ttft_ms_p50"] for r in rows], marker="o", label=f"{label} p50")
        right.plot(cs, [r["ttft_ms_p99"] for r in rows], marker="x", linestyle="--", label=f"{label} p99")
    for ax, ylabel in ((left, "output tokens/s"), (right, "time to first token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bytes_floor(engine: Engine, prompts: list[list[int]], args: argparse.Namespace) -> Callable[[int], float]:
    """ms a decode step of C rows needs at least: every weight once plus each row's KV (at the mean prompt
    plus half the reply) read at the device's measured bandwidth."""
    from pipeline.bench.speed import measure_bandwidth, streamed_bytes

    bandwidth = measure_bandwidth(engine.device, BANDWIDTH_BYTES, BANDWIDTH_REPEATS)
    best = max(bandwidth["copy_gbps"], bandwidth["read_gbps"]) * 1e9
    cfg = engine.target.cfg
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_size * engine.target.lm_head.weight.element_size()
    context = statistics.mean(len(p) for p in prompts) + args.max_tokens / 2
    weights = streamed_bytes(engine.target)
    return lambda c: (weights + c * context * kv_per_token) / best * 1e3


def tuning_variant(text: str) -> KernelTuning:
    try:
        return parse_variant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def adaptive_variant(text: str) -> tuple[str, AdaptiveConfig]:
    """A controller variant from the command line (its text, its config): "base" or FIELD=VALUE pairs."""
    try:
        return text, AdaptiveConfig() if text == BASE else parse_fields(text, AdaptiveConfig())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def controller_sweeps(
    engine: Engine,
    prompts: list[list[int]],
    levels: tuple[int, ...],
    params: SamplingParams,
    size: LevelSize,
    variants: list[tuple[str, AdaptiveConfig]],
    rounds: int,
) -> dict[str, list[dict[str, Any]]]:
    """A speculative engine's sweep under each controller variant, interleaved in one process: each level
    runs every variant in turn (so that a drifting machine shifts them alike), `rounds` times over with
    fresh controllers; every controller starts from the tier costs measured at load."""
    scheduler = engine.scheduler
    loaded = scheduler.controller
    assert loaded is not None and scheduler.spec is not None
    out: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):
        controllers = {}
        for text, config in variants:
            c = TierController(scheduler.spec.tiers, config)
            c.plain_cost = dict(loaded.plain_cost)
            c.ratio = {b: list(ratio) for b, ratio in loaded.ratio.items()}
            name = f"in-process T={params.temperature:g} {text}" + (f" round {r + 1}" if rounds > 1 else "")
            controllers[name] = c
        for level in levels:
            for name, c in controllers.items():
                scheduler.controller = c
                out.setdefault(name, []).extend(
                    sweep(in_process_client(engine), prompts, (level,), params, size, name, scheduler)
                )
    scheduler.controller = loaded
    return out


def load_engine(args: argparse.Namespace) -> tuple[Engine, str, Any]:
    serving = SchedulerConfig(
        max_batch_size=args.max_batch_size,
        batched=not args.single_stream,
        speculation=args.adaptive[0][1].policy,
        adaptive=args.adaptive[0][1],
        invariant=args.invariant,
        stream_interval=args.stream_interval,
        compile_tiers=None if args.compile_tiers is None else tuple(t for t in args.compile_tiers.split(",") if t),
    )
    if args.shape:
        engine = random_engine(SHAPES[args.shape], torch.device(args.device), args.max_batch_size, args.draft, serving)
        retune(engine, args.tuning)
        engine.warm_up(tuple(1.0 if t else 0.0 for t in args.temperatures))
        return engine, f"{args.shape}-random" + (f"-{args.draft}" if args.draft else ""), None
    engine = open_engine(args.engine, device=args.device, serving=serving)
    retune(engine, args.tuning)
    if engine.device.type == "cuda":  # every bucket's graphs (each tier's, and its cost) now, not in a level
        engine.warm_up(tuple(1.0 if t else 0.0 for t in args.temperatures))
    return engine, args.engine.name, engine.tokenizer


def random_engine(
    shape: ModelConfig, device: torch.device, max_batch_size: int | None, draft: str | None, serving: SchedulerConfig
) -> Engine:
    """An engine over random weights of `shape` (bf16 on CUDA), plain or with a random EAGLE drafter (draft
    "eagle": nothing is accepted, the floor of speculation) and the CUDA build's tree."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape, device, dtype)
    assert isinstance(model, Transformer)
    limits = EngineLimits(
        max_batch_size or SHAPE_LIMITS.max_batch_size, SHAPE_LIMITS.max_input_len, SHAPE_LIMITS.max_seq_len, 0
    )
    if draft != "eagle":
        return Engine(model, _IdsOnly(), limits, SpecConfig(), serving=serving)
    from pipeline.bench.probes.eagle_step import random_drafter
    from pipeline.engine.eagle import EagleProposer
    from pipeline.engine.loader import batched_proposer

    spec = SpecConfig(mode="eagle", max_draft_len=SHAPE_TREE_NODES, dynamic_tree=SHAPE_TREE)
    limits = replace(limits, max_draft_len=SHAPE_TREE_NODES)
    net = random_drafter(shape, device, dtype, "eagle", None)
    slots = limits.max_seq_len + SHAPE_TREE_NODES + 1
    proposer = EagleProposer(net, slots, None, SHAPE_TREE, SHAPE_TREE_NODES)
    rows = batched_proposer(spec, proposer, device, dtype)
    return Engine(model, _IdsOnly(), limits, spec, proposer, serving=serving, rows=rows)


def retune(engine: Engine, tuning: KernelTuning | None) -> None:
    """The target's and the drafter's kernels re-routed with this tuning (CUDA), before any graph is
    captured."""
    if tuning is None or engine.device.type != "cuda":
        return
    attach(engine.target, tuning=tuning)
    net = getattr(engine.proposer, "net", None)  # EAGLE's draft network
    if isinstance(net, torch.nn.Module):
        attach(net, tuning=tuning)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", type=Path, action="append", help="an engine directory; several: each over the first")
    p.add_argument("--shape", choices=sorted(SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--compile-tiers",
        default=None,
        help="drafting tiers whose steps run compiled in buckets of up to 4 rows, comma-separated, '' for none "
        "(CUDA; default: the engine's dynamic tiers)",
    )
    p.add_argument("--temperatures", type=lambda s: tuple(float(x) for x in s.split(",")), default=(0.0,))
    p.add_argument("--min-requests", type=int, default=MIN_REQUESTS)
    p.add_argument("--requests-per-client", type=int, default=REQUESTS_PER_CLIENT)
    p.add_argument(
        "--length-spread",
        type=float,
        default=0.0,
        help="F in [0, 1): each request's max_tokens drawn from max_tokens * [1 - F, 1 + F], seeded by its index "
        "(0: all alike, and requests that start together end together)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests a second arriving as a Poisson process (seeded), at most the level's concurrency in flight "
        "(default: closed loop, each client sending its next request when the last ends)",
    )
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument(
        "--prompts", type=Path, default=None, help="JSONL of prompts (`prompt` or `turns`; default: MT-bench's)"
    )
    p.add_argument(
        "--prompt-ids",
        type=Path,
        default=None,
        help="JSON list of prompts' token ids (with --shape; see --write-prompt-ids)",
    )
    p.add_argument(
        "--write-prompt-ids",
        type=Path,
        default=None,
        help="with --engine: write its tokenizer's ids of the prompts there, then stop",
    )
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument(
        "--single-stream", action="store_true", help="a plain engine off the batches (one request at a time)"
    )
    p.add_argument("--stream-interval", type=int, default=None, help="SchedulerConfig.stream_interval (default auto)")
    p.add_argument("--invariant", action="store_true", help="batch-invariant kernels (SchedulerConfig.invariant)")
    p.add_argument("--speculation", default="adaptive", help="speculative engines' tiers: adaptive, off, full, TIER")
    p.add_argument(
        "--adaptive",
        type=adaptive_variant,
        action="append",
        help="the tier controller's tuning: base or FIELD=VALUE[,FIELD=VALUE...] of AdaptiveConfig; given more "
        "than once, the variants run interleaved level by level",
    )
    p.add_argument("--rounds", type=int, default=1, help="with several --adaptive: the interleaved sweeps' count")
    p.add_argument("--triton", action="store_true", help="also through the bundled tritonserver (gRPC streaming)")
    p.add_argument(
        "--tuning", type=tuning_variant, default=None, help=f"CUDA: the target's and drafter's kernel tuning, {HELP}"
    )
    p.add_argument("--draft", choices=("eagle",), default=None, help="with --shape: a random EAGLE drafter")
    p.add_argument("--label", default=None, help="the results' name (default: the engine's or shape's)")
    p.add_argument("--output", type=Path, default=Path("bench"))
    args = p.parse_args(argv)
    engines = args.engine or []
    if bool(engines) == (args.shape is not None):
        raise SystemExit("give --engine DIR (one or more) or --shape NAME")
    for folder in engines:
        if not (folder / "config.json").is_file():
            raise SystemExit(f"--engine {folder}: no config.json; build one with `make build-engines`")
    if len({folder.name for folder in engines}) < len(engines):
        raise SystemExit("--engine: two engines have the same name (their results would overwrite); rename one")
    if len(engines) > 1 and (args.label is not None or args.write_prompt_ids is not None):
        raise SystemExit("--label and --write-prompt-ids take one --engine")
    paths = []
    for folder in engines or [None]:
        try:
            paths.append(run(argparse.Namespace(**{**vars(args), "engine": folder})))
        except UserError as exc:
            print(f"load: error: {exc}", file=sys.stderr)
            return USER_ERROR_EXIT_CODE
        gc.collect()  # the engine just swept, its pool and graphs freed before the next loads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if len(paths) > 1:
        from pipeline.bench import speedup

        name = (
            f"speedup-{engines[0].name}-{device_tag(torch.device(args.device))}-{datetime.date.today().isoformat()}.png"
        )
        methods = {folder.name: speedup.greedy_rows(path) for folder, path in zip(engines[1:], paths[1:])}
        speedup.plot_speedups(speedup.greedy_rows(paths[0]), methods, args.output / name)
    return 0


def run(args: argparse.Namespace) -> Path:
    """One engine's (or shape's) sweep, every temperature and variant: its JSON's path (with
    --write-prompt-ids: that file's, written instead)."""
    levels = args.concurrency or (CUDA_LEVELS if args.device.startswith("cuda") else CPU_LEVELS)
    # Each variant's policy: its own if it sets one, else --speculation's.
    args.adaptive = [
        (text, c if c.policy != AdaptiveConfig.policy else replace(c, policy=args.speculation))
        for text, c in args.adaptive or [(BASE, AdaptiveConfig())]
    ]
    # What the user gave is checked before the engine loads (a minute or more on a GPU).
    if not 0 <= args.length_spread < 1:
        raise SystemExit(f"--length-spread {args.length_spread}: use a fraction in [0, 1)")
    if args.request_rate is not None and args.request_rate <= 0:
        raise SystemExit(f"--request-rate {args.request_rate}: use requests a second > 0")
    if args.shape and args.prompt_ids is None:
        raise SystemExit("--shape needs --prompt-ids FILE (written by --engine DIR --write-prompt-ids FILE)")
    texts = load_prompts(args.prompts, args.num_prompts) if args.prompt_ids is None else []
    engine, label, tokenizer = load_engine(args)
    label = (args.label or label) + ("-invariant" if args.invariant else "")
    if args.prompt_ids is not None:
        prompts = load_prompt_ids(args.prompt_ids, args.num_prompts)
    else:
        from pipeline.engine.cli import prompt_ids

        chat = bool(getattr(tokenizer, "chat_template", None))
        prompts = [prompt_ids(tokenizer, t, chat=chat) for t in texts]
        if args.write_prompt_ids:
            args.write_prompt_ids.write_text(json.dumps(prompts))
            return Path(args.write_prompt_ids)
    print(f"{label} on {args.device}: capacity {engine.capacity}", flush=True)
    batch = engine.capacity["max_batch_size"]
    if max(levels) > batch:
        print(f"note: levels over {batch} requests queue the rest (--max-batch-size N runs more)", flush=True)
    results: dict[str, list[dict[str, Any]]] = {}
    size = LevelSize(args.requests_per_client, args.min_requests, args.length_spread, args.request_rate)
    for temperature in args.temperatures:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, end_id=IGNORE_END)
        if len(args.adaptive) > 1 or args.rounds > 1:
            if engine.scheduler.controller is None:
                raise SystemExit("several --adaptive variants need a speculative engine")
            results.update(controller_sweeps(engine, prompts, levels, params, size, args.adaptive, args.rounds))
            continue
        name = f"in-process T={temperature:g}"
        results[name] = sweep(in_process_client(engine), prompts, levels, params, size, name, engine.scheduler)
    if args.triton:
        results.update(run_triton(args, prompts, levels, size))
    floor = bytes_floor(engine, prompts, args) if args.shape and args.device.startswith("cuda") else None
    if floor is not None:
        for rows in results.values():
            for row in rows:
                row["floor_step_ms"] = floor(row["concurrency"])
                row["step_over_floor"] = row["itl_ms_p50"] / row["floor_step_ms"]
                print(
                    f"C={row['concurrency']:>3}: step (ITL p50) {row['itl_ms_p50']:.3f} ms, bytes floor "
                    f"{row['floor_step_ms']:.3f} ms: {row['step_over_floor']:.2f}x",
                    flush=True,
                )
    args.output.mkdir(parents=True, exist_ok=True)
    stem = f"load-{label}-{device_tag(torch.device(args.device))}-{datetime.date.today().isoformat()}"
    save_json(
        args.output / f"{stem}.json",
        {
            "label": label,
            "device": args.device,
            "max_tokens": args.max_tokens,
            "length_spread": args.length_spread,
            "request_rate": args.request_rate,
            "capacity": engine.capacity,
            "tuning": format_variant(args.tuning) if args.tuning is not None else "base",
            "invariant": args.invariant,
            "environment": environment(torch.device(args.device)),
            "results": results,
        },
    )
    plot(results, args.output / f"{stem}.png", f"{label}, {args.device}, {args.max_tokens} new tokens")
    print(f"wrote {args.output / stem}.json and .png")
    return args.output / f"{stem}.json"


def run_triton(
    args: argparse.Namespace, prompts: list[list[int]], levels: tuple[int, ...], size: LevelSize
) -> dict[str, list[dict[str, Any]]]:
    from pipeline.triton.repo import write_repository
    from pipeline.triton.server import TritonServer, free_ports

    if args.engine is None:
        raise UserError("--triton needs --engine (the server loads an engine directory)")
    out = {}
    with tempfile.TemporaryDirectory() as work:
        serving = {"max_batch_size": args.max_batch_size} if args.max_batch_size else None
        repo = write_repository(args.engine, Path(work) / "repo", device=args.device, serving=serving)
        with open(Path(work) / "tritonserver.log", "w") as log, TritonServer(repo, free_ports(), log=log) as server:
            for temperature in args.temperatures:
                params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, end_id=IGNORE_END)
                name = f"triton grpc-stream T={temperature:g}"
                out[name] = sweep(triton_client(server.grpc_url), prompts, levels, params, size, name)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
