#!/usr/bin/env python3
"""How far the speculative loop's queue runs past each request's end: steps queued against steps used,
and reads that found no group queued behind them (on CUDA the device then idles until the host queues
more), for an engine on the prompts of MT-bench, with the CUDA run-ahead (8 steps) on any device.

  .venv/bin/python build/probe_queue.py engines/smollm2-eagle3 [--num-prompts 10] [--share 0.5]

--share overrides runner.QUEUE_SHARE (the share of the request's expected steps a queue may cover).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.bench.prompts import load_prompts  # noqa: E402
from pipeline.bench.speed import chat_ids  # noqa: E402
from pipeline.engine import runner  # noqa: E402
from pipeline.engine.request import SamplingParams  # noqa: E402

CUDA_RUN_AHEAD = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--share", type=float, default=runner.QUEUE_SHARE)
    args = ap.parse_args()
    runner.QUEUE_SHARE = args.share
    engine = runner.Engine.from_dir(args.engine)
    engine.run_ahead = CUDA_RUN_AHEAD
    events: list[int] = []  # in order: a group queued (its steps), a group read (0)
    queue, start = engine._queue, engine.readback.start

    def queued(steps: int, *rest):
        events.append(steps)
        return queue(steps, *rest)

    def started(values: torch.Tensor):
        pending = start(values)
        read = pending.read
        pending.read = lambda: events.append(0) or read()
        return pending

    engine._queue, engine.readback.start = queued, started
    past = used = idle = 0
    for prompt in load_prompts(None, args.num_prompts):
        events.clear()
        with torch.inference_mode():
            result = engine.generate(chat_ids(engine.tokenizer, [prompt])[0],
                                     SamplingParams(max_tokens=args.max_tokens, end_id=-1))
        outstanding, reads = 0, events.count(0)
        for event in events:  # a read (not the last) of the only group queued: nothing behind it
            if event:
                outstanding += 1
            else:
                reads -= 1
                idle += outstanding == 1 and reads > 0
                outstanding -= 1
        past += sum(events) - result.stats.steps
        used += result.stats.steps
        print(f"steps {result.stats.steps}, queued past the end {sum(events) - result.stats.steps}, "
              f"acceptance {result.stats.acceptance_length:.2f}", flush=True)
    n = args.num_prompts
    print(f"share {args.share}: {used / n:.1f} steps a request, {past / n:.2f} queued past its end "
          f"({past / used:.1%}), {idle / n:.2f} reads a request with nothing queued behind")


if __name__ == "__main__":
    main()
