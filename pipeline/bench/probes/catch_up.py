"""EAGLE's drafter after runs of plain steps: acceptance of the drafting steps that follow, with the drafter's
catch-up deferred over the run (the scheduler's default) or done at every plain step.

    python -m pipeline.bench.probes.catch_up --engine engines/smollm2-eagle --prompt-ids IDS [--device cuda]

Each pattern runs period - 1 plain steps, then one step of the largest tier, over every prompt. A drafter
kept in sync accepts the same tokens either way (a stale one accepts fewer, silently): prints one line a
(period, catch-up) pair.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from pipeline.engine.loader import open_engine
from pipeline.engine.runner import Engine
from pipeline.engine.sampling import SamplingParams

PERIODS = (2, 4, 7)


def accepted_after_runs(engine: Engine, prompts: list[list[int]], period: int, defer: bool, tokens: int) -> list[int]:
    """Accepted draft tokens of every drafting step of the pattern (period - 1 plain steps, one drafting)."""
    spec, controller = engine.scheduler.spec, engine.scheduler.controller
    assert spec is not None and controller is not None
    top, decode, observe = len(controller.tiers) - 1, spec.decode, controller.observe
    steps, counts = [0], []

    def choose(bucket: int, rows: int, drafting: int) -> int:
        steps[0] += 1
        controller.steps += 1
        return top if steps[0] % period == 0 else 0

    def seen(index: int, accepted: list[int]) -> None:
        counts.extend(accepted if index else [])
        observe(index, accepted)

    def plain(ints: np.ndarray, floats: np.ndarray, defer: bool = False) -> torch.Tensor:
        return decode(ints, floats, defer and deferred)

    deferred = defer
    controller.choose, controller.observe, spec.decode = choose, seen, plain  # type: ignore[method-assign]
    try:
        for ids in prompts:
            engine.generate(ids, SamplingParams(max_tokens=tokens, end_id=-1))
    finally:
        del controller.choose, controller.observe, spec.decode  # the class's methods again
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an EAGLE engine")
    p.add_argument("--prompt-ids", type=Path, required=True, help="JSON list of prompts' token ids")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    engine = open_engine(args.engine, device=args.device)
    if engine.spec.mode not in ("eagle", "eagle3"):
        raise SystemExit(f"--engine {args.engine}: not an EAGLE engine")
    prompts = json.loads(args.prompt_ids.read_text())[: args.num_prompts]
    for period in PERIODS:
        for defer in (True, False):
            accepted = accepted_after_runs(engine, prompts, period, defer, args.max_tokens)
            print(
                f"period {period}  catch-up {'deferred' if defer else 'every step':10}  drafting steps "
                f"{len(accepted):4}  mean accepted {sum(accepted) / max(len(accepted), 1):.3f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
