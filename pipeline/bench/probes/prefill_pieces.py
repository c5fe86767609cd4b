"""Prefill chunks in pieces through the rows kernels against one pass through the library, both in the
engine's dtype, each against a float32 engine holding the same random weights:

    python -m pipeline.bench.probes.prefill_pieces --device cuda [--shape smollm2]

Prints, a prompt length a line, each path's largest relative hidden-state error against float32 and the share
of positions whose greedy token matches float32's, then the share where the two paths agree. Pieces are as
good as the library when their error and agreement match the whole pass's.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from pipeline.bench import load
from pipeline.bench.speed import SHAPES, _IdsOnly
from pipeline.engine.config import SpecConfig
from pipeline.engine.runner import Engine
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.engine.step import TABLE, _PrefillBuffers

LENGTHS = (40, 68, 100, 128)  # one piece, then two partly filled pieces, two, and the most that go in pieces
TOKEN_IDS_BELOW = 40000  # random prompt ids below this (and the vocabulary)
ROW_BLOCKS = 40  # blocks in the probe row's table, enough for the longest length


def prefill(engine: Engine, ids: list[int], pieces: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [T, H] float32, greedy token a position) of one chunk through the engine's batched step."""
    step = engine.scheduler.batch
    ints, floats = step.new_row()
    ints[TABLE : TABLE + ROW_BLOCKS] = np.arange(1, ROW_BLOCKS + 1)
    step.prefill_pieces_up_to = max(LENGTHS) if pieces else 0
    x = _PrefillBuffers(len(ids), len(ints), step.device)
    step._fill_prefill(x, ids, 0, ints, floats)
    hidden, _ = step._prefill_pass(x, step.max_seq_len)
    return hidden[0].float(), engine.target.logits(hidden[0]).float().argmax(-1)


def error(h: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest relative error of a position's hidden state."""
    return float(((h - truth).norm(dim=-1) / truth.norm(dim=-1)).max())


def same(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions with the same token."""
    return float((a == b).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    args = ap.parse_args()
    device, shape = torch.device(args.device), SHAPES[args.shape]
    serving = SchedulerConfig(max_batch_size=1)
    engine = load.random_engine(shape, device, 1, None, serving)
    reference_model = load.random_model(shape, device, torch.float32)
    reference_model.load_state_dict(engine.target.state_dict())
    reference = Engine(reference_model, _IdsOnly(), engine.limits, SpecConfig(), serving=serving)
    print("length | whole: error, same token as float32 | pieces: error, same token | pieces = whole")
    torch.manual_seed(1)
    with torch.inference_mode():
        for n in LENGTHS:
            ids = torch.randint(1, min(TOKEN_IDS_BELOW, shape.vocab_size), (n,)).tolist()
            truth, truth_tokens = prefill(reference, ids, False)
            whole, whole_tokens = prefill(engine, ids, False)
            pieces, pieces_tokens = prefill(engine, ids, True)
            print(
                f"{n:6d} | {error(whole, truth):.4f} {same(whole_tokens, truth_tokens):.3f} | "
                f"{error(pieces, truth):.4f} {same(pieces_tokens, truth_tokens):.3f} | "
                f"{same(pieces_tokens, whole_tokens):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
