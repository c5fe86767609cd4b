"""Benchmark subcommands. Each adds itself in `register`; `compare` is the engine-vs-vLLM harness."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.errors import UserError

DEFAULT_ENGINE = "engines/smollm2-ngram"


def register(sub: argparse._SubParsersAction) -> None:
    for add in (_add_compare,):  # another benchmark subcommand: one more `_add_<name>` here
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

    p = sub.add_parser("compare", help="measure our engine and vLLM with the same client; write reports/compare-<date>/")
    p.add_argument("--engine", type=Path, default=Path(DEFAULT_ENGINE), help=f"our engine directory (default {DEFAULT_ENGINE})")
    p.add_argument("--prompts", type=Path, help="JSONL with a `prompt` or `turns` field (default: MT-bench first turns)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=_int_list, default=(1, 4, 16), help="comma-separated, default 1,4,16")
    p.add_argument("--systems", type=_name_list, default=("ours", "vllm", "vllm-ngram"),
                   help=f"comma-separated from {', '.join(SYSTEMS)} (default ours,vllm,vllm-ngram)")
    p.add_argument("--target", default="smollm2", help="the target vLLM serves; must be the one --engine was built from")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per server")
    p.add_argument("--output-root", type=Path, default=Path("reports"))
    p.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--vllm-eager", action="store_true", help="vLLM --enforce-eager: starts in ~25 s, decodes ~20%% slower")
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
        engine=args.engine, prompts=args.prompts, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
        concurrency=args.concurrency, systems=args.systems, target=args.target, warmup=args.warmup,
        output_root=args.output_root, vllm_eagle=args.vllm_eagle, vllm_medusa=args.vllm_medusa,
        vllm=VllmOptions(dtype=args.vllm_dtype, enforce_eager=args.vllm_eager, startup_timeout_s=args.vllm_timeout),
    )
    out = run_compare(cfg)
    print(f"wrote {out}/report.md")
    return 0
