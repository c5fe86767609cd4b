"""`specpipe triton-repo` (write a model repository) and `specpipe serve` (run tritonserver on it)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.errors import UserError
from pipeline.triton.repo import ENSEMBLE, PREPROCESSING, write_repository
from pipeline.triton.server import LOCALHOST, MAX_RESTARTS, RESTART_WINDOW_S, Ports, TritonServer

DEFAULT_REPO = "triton_repo"
OPENAI_FRONT_MODULE = "pipeline.openai_front"


def register(sub: argparse._SubParsersAction) -> None:
    repo = sub.add_parser("triton-repo", help="write a Triton model repository for an engine directory")
    repo.add_argument("--engine", required=True, help="engine directory (from `specpipe build`)")
    repo.add_argument("--output", default=DEFAULT_REPO, help=f"repository folder to write (default {DEFAULT_REPO})")
    repo.add_argument("--device", default="cpu", help="device of the portable engine model (cpu, cuda)")
    serving = repo.add_argument_group("serving (portable engine; stored in the repository)")
    serving.add_argument("--max-batch-size", type=int, help="requests a step runs at once (default: the engine's)")
    serving.add_argument("--max-queue", type=int, help="requests waiting before new ones get 'busy, retry'")
    serving.add_argument("--prefill-chunk", type=int, help="prompt tokens prefilled between two decode steps")
    serving.add_argument(
        "--stream-interval",
        type=int,
        help="tokens a streamed response holds at least, first and last aside (default on CUDA: 1 up to 8 "
        "running requests, then running/8 rounded up: fewer consumer wake-ups a step under load; on a CPU: 1 "
        "for one request, else 4)",
    )
    serving.add_argument("--kv-cache-fraction", type=float, help="share of free GPU memory for the KV cache pool")
    serving.add_argument("--max-num-tokens", type=int, help="KV cache pool size in tokens (instead of the fraction)")
    serving.add_argument("--kv-block-size", type=int, help="tokens per KV cache block")
    serving.add_argument(
        "--speculation",
        help="speculative engines: adaptive (default: the tier expected fastest each step), off (plain steps), "
        "full (the engine's largest tree every step), or one tier by name (plain, chain1.., tree8..)",
    )
    serving.add_argument(
        "--invariant",
        action="store_true",
        default=None,
        help="CUDA: batch-invariant kernels, so that a request's bf16 output does not depend on the batch or on "
        "speculation (costs speed; BENCHMARKS.md)",
    )
    serving.add_argument(
        "--serial",
        dest="batched",
        action="store_const",
        const=False,
        help="serve one request at a time through the engine's own decode loop (the single-stream path)",
    )
    repo.set_defaults(func=run_triton_repo)

    serve = sub.add_parser("serve", help="run tritonserver on a model repository until Ctrl-C")
    serve.add_argument("--repo", default=DEFAULT_REPO, help=f"model repository (default {DEFAULT_REPO})")
    defaults = Ports()
    serve.add_argument("--http-port", type=int, default=defaults.http)
    serve.add_argument("--grpc-port", type=int, default=defaults.grpc)
    serve.add_argument("--metrics-port", type=int, default=defaults.metrics)
    serve.add_argument("--openai-port", type=int, help="also serve the OpenAI-compatible API on this port")
    serve.add_argument(
        "--served-model-name",
        default=ENSEMBLE,
        help=f"the model name the OpenAI API answers to (default {ENSEMBLE})",
    )
    serve.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    serve.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help=f"restart a crashed tritonserver up to this many times within {RESTART_WINDOW_S:.0f} s, then exit "
        f"non-zero (default {MAX_RESTARTS}; 0: exit on the first crash)",
    )
    serve.set_defaults(func=run_serve)


SERVING_OPTIONS = (
    "max_batch_size",
    "max_queue",
    "prefill_chunk",
    "stream_interval",
    "kv_cache_fraction",
    "max_num_tokens",
    "kv_block_size",
    "speculation",
    "invariant",
    "batched",
)


def run_triton_repo(args: argparse.Namespace) -> int:
    serving = {k: getattr(args, k) for k in SERVING_OPTIONS if getattr(args, k) is not None}
    out = write_repository(args.engine, args.output, args.device, serving)
    models = ", ".join(sorted(p.name for p in out.iterdir() if p.is_dir()))
    print(f"wrote Triton model repository {out} (models: {models})")
    return 0


def repo_tokenizer_dir(repo: Path) -> Path:
    """The tokenizer the repository's preprocessing model loads."""
    config_file = repo / PREPROCESSING / "config.pbtxt"
    if not config_file.is_file():
        raise UserError(f"{config_file}: missing; regenerate the repository with `specpipe triton-repo`")
    config = text_format.Parse(config_file.read_text(), mc.ModelConfig())
    return Path(config.parameters["tokenizer_dir"].string_value)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _interrupt_on_give_up(server: TritonServer) -> None:
    """The OpenAI front holds the main thread: once the restarts are given up, stop it as SIGTERM does."""
    server.wait()
    if server.failure:
        os.kill(os.getpid(), signal.SIGTERM)


def run_serve(args: argparse.Namespace) -> int:
    repo = Path(args.repo)
    openai_serve = None
    if args.openai_port is not None:
        try:
            openai_serve = importlib.import_module(OPENAI_FRONT_MODULE).serve
        except ModuleNotFoundError as exc:
            if exc.name != OPENAI_FRONT_MODULE:
                raise
            raise UserError(
                f"--openai-port: module {OPENAI_FRONT_MODULE} is not available in this checkout; "
                "serve without --openai-port"
            ) from None
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops the server like Ctrl-C does
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    server = TritonServer(repo, ports, log_verbose=args.log_verbose, max_restarts=args.max_restarts)
    try:
        with server:
            print(
                json.dumps(
                    {"http": f"http://{server.http_url}", "grpc": server.grpc_url, "metrics": server.metrics_url}
                ),
                file=sys.stderr,
                flush=True,
            )
            if openai_serve is not None:
                print(f"OpenAI API on http://{LOCALHOST}:{args.openai_port}/v1", file=sys.stderr, flush=True)
                threading.Thread(target=_interrupt_on_give_up, args=(server,), daemon=True).start()
                openai_serve(
                    server.grpc_url, LOCALHOST, args.openai_port, args.served_model_name, repo_tokenizer_dir(repo)
                )
            else:
                code = server.wait()
                if code and not server.failure:
                    raise UserError(f"tritonserver exited with code {code}; its last log lines: {server.tail_text()}")
    except KeyboardInterrupt:
        pass
    if server.failure:
        raise UserError(server.failure)
    print("stopped tritonserver", file=sys.stderr)
    return 0
