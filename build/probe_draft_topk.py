#!/usr/bin/env python3
"""An EAGLE drafter's top-k on CUDA: the LM head, log-softmax and torch.topk the engine runs at every draft
depth, against one kernel that computes a vocabulary tile's logits and keeps only that tile's top k, its
maximum and its sum of exponentials (a small torch.topk over the tiles' candidates finishes).

Why: in the H200 profile of session n (BENCHMARKS.md §2) torch.topk's radix kernels took 0.23 ms of
EAGLE-3 deep's 1.92 ms step (seven depths, 10 rows each, 49,152 tokens). The fused path never writes the
[rows, vocab] logits, and what is left for torch.topk is [rows, tiles x k] instead of [rows, vocab].

Each case is timed as probe_gemv.py times a product (one CUDA graph of calls; the same LM head every
call, as at the drafter's consecutive depths), eagerly and through torch.compile (the "+c" columns: the
engine compiles its drafter, which may fuse either side's small ops), and checked against float32
log-softmax + topk. Session p timed the eager columns only: fused 60-65 us against 82-92 a depth; session
q the compiled ones too (SmolLM2, 8 rows, k 8): 45.9 against 83.7. The kernel is the engine's
(fused_kernels.lm_head_topk, SPECPIPE_DRAFT_TOPK=fused); this probe times its tile and warp variants. Under
TRITON_INTERPRET=1 on the CPU it checks correctness only, in float32 (the interpreter's bfloat16 tl.dot
returns garbage).

  python3 build/probe_draft_topk.py                                   # CUDA: table of us a depth
  TRITON_INTERPRET=1 python3 build/probe_draft_topk.py --device cpu   # correctness only
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from probe_gemv import probe_device, timed  # noqa: E402

from pipeline.engine.fused_kernels import tiled_topk as fused_topk  # noqa: E402

VARIANTS = ((128, 4), (256, 4), (256, 8))  # vocabulary tile, warps
CELL = 12  # table column width
# name: rows (a depth's nodes), vocabulary, hidden, k
CASES = {"root, SmolLM2": (1, 49152, 576, 10), "depth, SmolLM2": (10, 49152, 576, 10),
         "depth, k 8": (8, 49152, 576, 8), "depth, 8B": (10, 128256, 4096, 10)}


def engine_topk(h: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What EagleProposer does at a depth: logits in the weights' dtype, float32 log-softmax, topk."""
    return F.log_softmax(F.linear(h, weight).float(), dim=-1).topk(k, dim=-1)


def compiled_us(fn) -> str:
    """Microseconds of fn compiled by inductor (as the engine compiles its drafter), or why it failed."""
    torch._dynamo.reset()  # every case compiles the same lambda: without a reset dynamo's recompile limit ends it
    try:
        step = torch.compile(fn, fullgraph=True, dynamic=False)
        return f"{timed(lambda i: step()):.1f}"
    except Exception as e:  # a probe reports a compiler failure as a cell and goes on
        return f"fail:{type(e).__name__}"[:CELL - 1]


def main() -> None:
    device = probe_device(__doc__)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    ok = True
    # "+c": the same function through torch.compile, which fuses the fused path's small epilogue ops
    names = ["engine", "engine+c"] + [f"{b}/{w}w{c}" for b, w in VARIANTS for c in ("", "+c")]
    print(f"{'case':<18}" + "".join(f"{n:>{CELL}}" for n in names) + "   (us a depth; fused: tokens equal to float32's)")
    for case, (rows, vocab, hidden, k) in CASES.items():
        if not cuda and hidden > 1024:
            continue  # the interpreter is slow; the 8B shape adds nothing to a correctness check
        dtype = torch.bfloat16 if cuda else torch.float32
        weight = (torch.randn(vocab, hidden, device=device) * hidden ** -0.5).to(dtype)
        h = (torch.randn(rows, hidden, device=device) * 3).to(dtype)
        want_logp, want_tok = F.log_softmax(h.float() @ weight.float().T, dim=-1).topk(k, dim=-1)
        cells = [f"{timed(lambda i: engine_topk(h, weight, k)):.1f}" if cuda else "nan",
                 compiled_us(lambda: engine_topk(h, weight, k)) if cuda else "nan"]
        for block_v, warps in VARIANTS:
            logp, tok = fused_topk(h, weight, k, block_v, warps)
            if not (torch.equal(tok, want_tok) and torch.allclose(logp, want_logp, atol=1e-3)):
                # on the GPU a near-tie may order differently in bf16; say so and keep timing
                print(f"{case}, tile {block_v}: {(tok != want_tok).sum().item()} tokens differ, max log-prob error "
                      f"{(logp - want_logp).abs().max().item():.2e}")
                ok = False
            fused = lambda: fused_topk(h, weight, k, block_v, warps)  # noqa: E731
            cells += [f"{timed(lambda i: fused()):.1f}", compiled_us(fused)] if cuda else ["nan", "nan"]
        print(f"{case:<18}" + "".join(f"{c:>{CELL}}" for c in cells), flush=True)
    print("fused top-k ok" if ok else "fused top-k: differences above")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
