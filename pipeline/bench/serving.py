"""Serving overhead: the same prompts in-process and through the real Triton server, token ids compared.

    python3 -m pipeline.bench.serving --engine DIR [--device cuda] [--num-prompts 16] [--max-tokens 256]

In-process: `Engine.generate` per prompt, timed with device synchronisation (as `specpipe bench`'s
smollm2 suite). Through Triton: a portable model repository for the same engine and device, the bundled
tritonserver, one request at a time to the engine model (`tensorrt_llm`, token ids in and out) over gRPC,
streaming and non-streaming; wall time per request is taken by the client. Both ways are greedy with the
end id ignored (fixed length). Writes <output>/serving-<device>.json and prints a table.
tritonclient is imported only here, never by the other bench suites.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.prompts import load_prompts
from pipeline.bench.speed import SEED, device_tag, environment, save_json, sync
from pipeline.client.verify import first_divergence
from pipeline.engine.loader import open_engine
from pipeline.engine.runner import Engine
from pipeline.engine.sampling import RequestError, SamplingParams
from pipeline.errors import USER_ERROR_EXIT_CODE, UserError

IGNORE_END = -1  # end_id that no token matches: every request runs to max_tokens
WARMUP_TOKENS = 32
# The serving goal: through Triton at most this far below in-process tokens/s.
MAX_SLOWDOWN = 0.10
MODES = ("grpc-stream", "grpc")


@dataclass(frozen=True)
class ServingConfig:
    engine: Path
    device: str = "cuda"
    prompts: Path | None = None  # None: MT-bench first turns
    num_prompts: int = 16
    max_tokens: int = 256
    output: Path = Path("bench")

    def __post_init__(self) -> None:
        if not (self.engine / "config.json").is_file():
            raise UserError(f"--engine {self.engine}: no config.json; build one with `specpipe build`")
        if self.num_prompts < 1 or self.max_tokens < 1:
            raise UserError("--num-prompts and --max-tokens must be >= 1")


@dataclass(frozen=True)
class Run:
    """One way of serving the prompts: per-request wall seconds and the generated ids."""

    seconds: list[float]
    outputs: list[list[int]]

    def summary(self) -> dict[str, Any]:
        tokens = sum(len(o) for o in self.outputs)
        total = sum(self.seconds)
        return {
            "tokens": tokens,
            "seconds": total,
            "tokens_per_s": tokens / total,
            "median_request_ms": statistics.median(self.seconds) * 1e3,
            "request_s": self.seconds,
        }


def prompt_token_ids(engine: Engine, texts: list[str]) -> tuple[list[list[int]], bool]:
    """Chat-templated ids when the tokenizer has a template (as the smollm2 suite), else the plain text's."""
    from pipeline.engine.cli import prompt_ids

    chat = bool(getattr(engine.tokenizer, "chat_template", None))
    return [prompt_ids(engine.tokenizer, t, chat=chat) for t in texts], chat


def time_each(
    prompts: list[list[int]], generate: Callable[[list[int]], list[int]], desc: str, device: torch.device
) -> Run:
    seconds, outputs = [], []
    for ids in tqdm(prompts, desc=desc, unit="prompt"):
        sync(device)
        start = time.perf_counter()
        outputs.append(generate(ids))
        sync(device)
        seconds.append(time.perf_counter() - start)
    return Run(seconds, outputs)


def run_in_process(engine: Engine, prompts: list[list[int]], max_tokens: int) -> Run:
    params = SamplingParams(max_tokens=max_tokens, end_id=IGNORE_END)
    with torch.inference_mode():
        engine.generate(prompts[0], SamplingParams(max_tokens=WARMUP_TOKENS, end_id=IGNORE_END))  # graphs, kernels
        return time_each(prompts, lambda ids: engine.generate(ids, params).token_ids, "in-process", engine.device)


def run_triton(cfg: ServingConfig, prompts: list[list[int]], work: Path) -> dict[str, Run]:
    from pipeline.client.client import Sampling, generate_ids
    from pipeline.triton.repo import write_repository
    from pipeline.triton.server import TritonServer, free_ports

    repo = write_repository(cfg.engine, work / "repo", device=cfg.device)
    sampling = Sampling(max_tokens=cfg.max_tokens, end_id=IGNORE_END)
    runs = {}
    with open(cfg.output / "tritonserver.log", "w") as log, TritonServer(repo, free_ports(), log=log) as server:
        for mode in MODES:
            stream = mode == "grpc-stream"
            generate_ids(
                server.grpc_url, prompts[0], Sampling(max_tokens=WARMUP_TOKENS, end_id=IGNORE_END), stream=stream
            )

            def served_ids(ids: list[int], stream: bool = stream) -> list[int]:
                return generate_ids(server.grpc_url, ids, sampling, stream=stream).output_ids

            runs[mode] = time_each(
                prompts,
                served_ids,
                f"triton {mode}",
                torch.device("cpu"),
            )  # the client waits for the server
    return runs


def compare(in_process: Run, served: Run) -> dict[str, Any]:
    base = in_process.summary()
    out = served.summary()
    ratio = out["tokens_per_s"] / base["tokens_per_s"]
    overhead = [(s - b) * 1e3 for s, b in zip(served.seconds, in_process.seconds)]
    out.update(
        {
            "ratio_vs_in_process": ratio,
            "median_overhead_ms": statistics.median(overhead),
            "ids_identical": served.outputs == in_process.outputs,
            "first_divergence": [first_divergence(a, b) for a, b in zip(in_process.outputs, served.outputs)],
            "within_bar": ratio >= 1.0 - MAX_SLOWDOWN,
            "outputs": served.outputs,
        }
    )
    return out


def run_serving(cfg: ServingConfig) -> tuple[Path, dict[str, Any]]:
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {cfg.device}: no CUDA device here; use --device cpu")
    device = torch.device(cfg.device)
    torch.manual_seed(SEED)
    cfg.output.mkdir(parents=True, exist_ok=True)
    engine = open_engine(cfg.engine, device=cfg.device)
    prompts, chat = prompt_token_ids(engine, load_prompts(cfg.prompts, cfg.num_prompts))
    in_process = run_in_process(engine, prompts, cfg.max_tokens)
    del engine  # the server loads its own copy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="specpipe-serving-") as work:
        served = run_triton(cfg, prompts, Path(work))
    results = {
        "environment": environment(device),
        "config": {
            "engine": str(cfg.engine),
            "device": cfg.device,
            "prompts": str(cfg.prompts or "MT-bench"),
            "num_prompts": len(prompts),
            "max_tokens": cfg.max_tokens,
            "chat_template": chat,
            "greedy": True,
            "end_id_ignored": True,
            "max_slowdown": MAX_SLOWDOWN,
        },
        "in_process": {**in_process.summary(), "outputs": in_process.outputs},
        "triton": {mode: compare(in_process, run) for mode, run in served.items()},
    }
    path = cfg.output / f"serving-{device_tag(device)}.json"
    save_json(path, results)
    return path, results


def format_table(results: dict[str, Any]) -> str:
    base = results["in_process"]
    lines = [
        f"{'way':<20}{'tokens':>8}{'tok/s':>10}{'x in-proc':>11}{'overhead ms':>13}{'ids same':>10}",
        f"{'in-process':<20}{base['tokens']:>8}{base['tokens_per_s']:>10.1f}{1.0:>11.3f}{0.0:>13.1f}{'-':>10}",
    ]
    for mode, r in results["triton"].items():
        lines.append(
            f"{'triton ' + mode:<20}{r['tokens']:>8}{r['tokens_per_s']:>10.1f}{r['ratio_vs_in_process']:>11.3f}"
            f"{r['median_overhead_ms']:>13.1f}{str(r['ids_identical']):>10}"
        )
        if not r["ids_identical"]:
            lines.append(f"{'':<20}first differing token per prompt: {r['first_divergence']}")
    ok = all(r["within_bar"] and r["ids_identical"] for r in results["triton"].values())
    lines.append(f"through Triton at most {MAX_SLOWDOWN:.0%} below in-process, same ids: {'yes' if ok else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    d = {f.name: f.default for f in fields(ServingConfig)}
    p = argparse.ArgumentParser(prog="python3 -m pipeline.bench.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="portable engine directory")
    p.add_argument("--device", default=d["device"])
    p.add_argument(
        "--prompts", type=Path, help="JSONL with a `prompt` or `turns` field (default: MT-bench first turns)"
    )
    p.add_argument("--num-prompts", type=int, default=d["num_prompts"])
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"])
    p.add_argument(
        "--output", type=Path, default=d["output"], help="folder for serving-<device>.json and tritonserver.log"
    )
    args = p.parse_args(argv)
    try:
        cfg = ServingConfig(
            engine=args.engine,
            device=args.device,
            prompts=args.prompts,
            num_prompts=args.num_prompts,
            max_tokens=args.max_tokens,
            output=args.output,
        )
        path, results = run_serving(cfg)
    except (UserError, RequestError) as exc:  # a prompt set the engine cannot take is the user's to fix too
        print(f"serving: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    print(format_table(results))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
