#!/usr/bin/env python3
"""What a request spends before its first decode step: the target's prompt pass and the proposer's start
(an EAGLE drafter's own pass over the prompt), timed with device synchronisation, over the same prompts
three times in one process, so that costs paid once per new prompt length (cuDNN attention plans,
compilation) show as the first pass's excess over the second.

  python3 build/probe_prefill.py ENGINE [ENGINE ...] [--device cuda] [--num-prompts 8] [--eager]

--eager turns the padded prompt graphs off (GraphedTarget.prefill_graphs) to compare with them on.
Seen on the H200 (session m, eager prompts, SmolLM2 bf16, 8 MT-bench turns of 52-87 tokens, 256 tokens
each): EAGLE dynamic 1069, 1524, 1523 tok/s; prompt passes 458, 173, 174 ms and drafter starts 296, 8,
8 ms in all for the eight requests of each pass.
"""
import argparse
import hashlib
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.bench.prompts import load_prompts  # noqa: E402
from pipeline.bench.speed import chat_ids, sync  # noqa: E402
from pipeline.engine.request import SamplingParams  # noqa: E402
from pipeline.engine.runner import Engine  # noqa: E402

PASSES = 3
WARMUP_TOKENS = 32


def timed(spent: dict[str, float], name: str, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sync(device)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(device)
        spent[name] += time.perf_counter() - start
        return out
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", type=Path, nargs="+")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=Path, help="JSONL (default: MT-bench first turns)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--eager", action="store_true", help="run prompts eagerly (no padded prompt graphs)")
    args = ap.parse_args()
    device = torch.device(args.device)
    texts = load_prompts(args.prompts, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, end_id=-1)
    for path in args.engines:
        load_start = time.perf_counter()
        engine = Engine.from_dir(path, device=args.device)
        print(f"{path.name}: loaded and warmed up in {time.perf_counter() - load_start:.1f} s", flush=True)
        if args.eager and engine.graphs is not None:
            engine.graphs.prefill_graphs = False
        prompts = chat_ids(engine.tokenizer, texts)
        engine.generate(prompts[0], SamplingParams(max_tokens=WARMUP_TOKENS, end_id=-1))
        spent: dict[str, float] = defaultdict(float)
        engine.prefill = timed(spent, "prompt pass", engine.prefill, device)
        engine.proposer.start = timed(spent, "proposer start", engine.proposer.start, device)
        for n in range(1, PASSES + 1):
            spent.clear()
            sync(device)
            start, outputs = time.perf_counter(), []
            for ids in prompts:
                outputs.append(engine.generate(ids, params).token_ids)
            sync(device)
            seconds, tokens = time.perf_counter() - start, sum(map(len, outputs))
            # A digest of every id, to compare runs with and without --eager at a glance.
            digest = hashlib.sha256(repr(outputs).encode()).hexdigest()[:12]
            print(f"  pass {n}: {tokens / seconds:7.1f} tok/s, {seconds * 1e3:7.1f} ms, ids {digest}; "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in spent.items()), flush=True)
        print(f"  prompt lengths {[len(p) for p in prompts]}")
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
