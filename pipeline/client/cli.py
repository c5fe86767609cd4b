"""`specpipe client` (one request, timed) and `specpipe verify` (server vs Hugging Face, token by token)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from pipeline.client.client import ENSEMBLE, TEXT_MODELS, Sampling, TritonRequestError, generate
from pipeline.errors import UserError
from pipeline.triton.server import TritonServer, free_ports

DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_VERIFY_PROMPTS = 8
DEFAULT_REPORT = "reports/verify.json"


def register(sub: argparse._SubParsersAction) -> None:
    client = sub.add_parser("client", help="send one prompt to the Triton server and time it")
    client.add_argument("--url", default=DEFAULT_GRPC_URL, help="host:port (gRPC port for grpc, HTTP port for http)")
    client.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    client.add_argument("--stream", action="store_true")
    client.add_argument("--prompt", required=True)
    client.add_argument("--max-tokens", type=int, default=64)
    client.add_argument("--temperature", type=float)
    client.add_argument("--model", choices=TEXT_MODELS, default=ENSEMBLE)
    client.add_argument("--json", action="store_true", help="print the whole reply as JSON")
    client.set_defaults(func=run_client)

    verify = sub.add_parser("verify", help="compare the server's greedy tokens with Hugging Face generate")
    verify.add_argument("--url", default=DEFAULT_GRPC_URL, help="the server's gRPC host:port")
    verify.add_argument(
        "--repo",
        type=Path,
        help="start tritonserver on this model repository for the run (free local ports) instead of using --url",
    )
    verify.add_argument("--prompts", type=Path, help="JSONL with `prompt` or `turns` (default: MT-bench first turns)")
    verify.add_argument("--target", required=True, help="the engine's target: smollm2, a model folder or a .gguf file")
    verify.add_argument("--max-tokens", type=int, default=64)
    verify.add_argument("--num-prompts", type=int, default=DEFAULT_VERIFY_PROMPTS)
    verify.add_argument("--report", type=Path, default=Path(DEFAULT_REPORT))
    verify.set_defaults(func=run_verify)


def run_client(args: argparse.Namespace) -> int:
    try:
        reply = generate(
            args.url,
            args.prompt,
            Sampling(max_tokens=args.max_tokens, temperature=args.temperature),
            stream=args.stream,
            protocol=args.protocol,
            model=args.model,
        )
    except TritonRequestError as exc:
        raise UserError(f"{args.model} at {args.url}: {exc}") from None
    except ConnectionError as exc:
        raise UserError(f"{args.url}: cannot connect ({exc}); start the server with `specpipe serve`") from None
    if args.json:
        print(json.dumps(reply.to_dict(), indent=2))
        return 0
    print(reply.text)
    itl = reply.inter_token_latencies_s
    mean_itl = f"{1000 * sum(itl) / len(itl):.1f} ms" if itl else "n/a"
    print(
        f"--- {reply.num_input_tokens} prompt + {reply.num_output_tokens} generated tokens, "
        f"TTFT {1000 * reply.ttft_s:.1f} ms, mean inter-chunk {mean_itl}, total {reply.total_s:.2f} s, "
        f"acceptance rate {reply.acceptance_rate:.3f} ({reply.total_accepted_draft_tokens}/"
        f"{reply.total_draft_tokens}), acceptance length {reply.acceptance_length:.2f}",
        file=sys.stderr,
    )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from pipeline.bench.prompts import load_prompts
    from pipeline.client.verify import format_table, verify, write_report

    prompts = load_prompts(args.prompts, args.num_prompts)
    with contextlib.ExitStack() as stack:
        url = args.url
        if args.repo is not None:
            log_file = args.report.with_name(f"{args.report.stem}-tritonserver.log")
            log_file.parent.mkdir(parents=True, exist_ok=True)
            print(f"starting tritonserver on {args.repo} (log: {log_file})", file=sys.stderr)
            log = stack.enter_context(open(log_file, "w"))
            url = stack.enter_context(TritonServer(args.repo, free_ports(), log=log)).grpc_url
        try:
            results = verify(url, args.target, prompts, args.max_tokens)
        except TritonRequestError as exc:
            raise UserError(f"tensorrt_llm at {url}: {exc}") from None
    print(format_table(results))
    write_report(
        results,
        args.report,
        {
            "url": url,
            "repo": None if args.repo is None else str(args.repo),
            "target": str(args.target),
            "max_tokens": args.max_tokens,
        },
    )
    print(f"report: {args.report}", file=sys.stderr)
    return 1 if any(not r.match for r in results) else 0
