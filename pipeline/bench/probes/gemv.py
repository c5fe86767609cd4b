"""Batch-1 products of the Llama-3-8B (or SmolLM2) shapes on CUDA: cuBLAS against the engine's Triton GEMV
kernel (plain, with the fused RMS norm, with the fused residual add) over a sweep of block sizes.

Each product runs REPS times inside one CUDA graph, cycling through distinct weight matrices (cold_copies):
repeating one matrix lets the smaller ones (QKV 50 MB, output 34 MB) sit in the 50 MB L2 and read
faster than memory, which once made a configuration look best that is slow in a real decode step.
Prints microseconds and GB/s per shape and variant, and the sum over the products of one token.

  python -m pipeline.bench.probes.gemv [--shape smollm2]   # on a CUDA machine (about 15 s on an H200)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton

from pipeline.engine.kernels.gemv import _gemv_kernel
from pipeline.engine.kernels.tuning import DEFAULT_TUNING

# name: (rows, columns, products per token, the variant a fused decoder layer uses)
SHAPES = {
    "qkv": (6144, 4096, 32, "norm"),
    "o": (4096, 4096, 32, "residual"),
    "gate_up": (28672, 4096, 32, "norm"),
    "down": (4096, 14336, 32, "residual"),
    "lm_head": (128256, 4096, 1, "plain"),
}
MODEL_SHAPES = {
    "llama3-8b": SHAPES,
    "smollm2": {
        "qkv": (960, 576, 30, "norm"),
        "o": (576, 576, 30, "residual"),
        "gate_up": (3072, 576, 30, "norm"),
        "down": (576, 1536, 30, "residual"),
        "lm_head": (49152, 576, 1, "plain"),
    },
}
SWEEP = ((8, 1024, 8), (16, 1024, 8), (4, 1024, 4), (1, 1024, 4), (2, 1024, 4), (8, 512, 8))  # rows, columns, warps
COPIES = 6
REPS = 4 * COPIES
# A real step reads its weights from memory: a timed graph cycles through enough copies of a matrix that each
# comes from memory, not from L2 (a few copies of SmolLM2's 0.7-3.5 MB matrices would sit in an H200's L2).
COLD_L2_MULTIPLE = 3
TIMED_REPLAYS = 5
MAX_REL_ERR = 2e-2  # bf16 products against float32
EPS = 1e-5


def cold_copies(nbytes: int) -> int:
    """How many copies of nbytes of weights a timed graph cycles through for each to come from memory, not L2:
    COLD_L2_MULTIPLE times the L2 streamed between two reads of one copy."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, -(-COLD_L2_MULTIPLE * l2 // nbytes))


def linear_copy(x: torch.Tensor, ws: list[torch.Tensor], i: int) -> torch.Tensor:
    """cuBLAS's product of x and the i-th cold copy of W (cycling)."""
    return F.linear(x[None], ws[i % len(ws)])


def timed(fn: Callable[[int], object], reps: int = REPS) -> float:
    """Median microseconds of fn(i) over one graph of `reps` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(TIMED_REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps * 1e3)
    return sorted(times)[len(times) // 2]


def main(shape: str) -> None:
    torch.manual_seed(0)
    totals = {"cublas": 0.0, "triton": 0.0, "fused": 0.0}
    t0 = time.time()
    engine = (DEFAULT_TUNING.block_rows, DEFAULT_TUNING.block_k, DEFAULT_TUNING.num_warps)
    print(f"engine config {engine}; rows,columns,warps: us (GB/s)")
    for name, (n, k, per_token, variant) in MODEL_SHAPES[shape].items():
        copies = cold_copies(n * k * 2)
        reps = max(REPS, copies)  # a graph's calls read every copy once: fewer would leave the small ones in L2
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        mb = n * k * 2 / 1e6
        gbs = lambda us, mb=mb: mb / us * 1e3
        ref = F.linear(x.float(), ws[0].float())
        t_cublas = timed(partial(linear_copy, x, ws), reps)
        line = f"{name:<8}{mb:7.1f} MB  cublas {t_cublas:6.1f} ({gbs(t_cublas):4.0f})"
        results = {}
        for fused in (False, True):
            norm, res = fused and variant == "norm", fused and variant == "residual"
            if fused and variant == "plain":
                continue
            for rows, cols, warps in SWEEP:

                def run(
                    i,
                    rows=rows,
                    cols=cols,
                    warps=warps,
                    norm=norm,
                    res=res,
                    ws=ws,
                    copies=copies,
                    x=x,
                    y=y,
                    g=g,
                    r=r,
                    n=n,
                    k=k,
                ):
                    _gemv_kernel[(triton.cdiv(n, rows),)](
                        ws[i % copies],
                        x,
                        y,
                        g,
                        r,
                        n,
                        k,
                        EPS,
                        NORM=norm,
                        RESIDUAL=res,
                        GATED=False,
                        BLOCK_ROWS=rows,
                        BLOCK_K=cols,
                        num_warps=warps,
                    )

                if not fused:
                    run(0)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    assert err < MAX_REL_ERR, (name, rows, cols, warps, err)
                results[(fused, rows, cols, warps)] = timed(run, reps)
        for fused in (False, True):
            row = {key[1:]: t for key, t in results.items() if key[0] == fused}
            if row:
                line += f"\n  {variant if fused else 'plain':<9}" + "  ".join(
                    f"{c[0]},{c[1]},{c[2]}: {t:6.1f} ({gbs(t):4.0f})" for c, t in row.items()
                )
        totals["cublas"] += per_token * t_cublas
        plain_key, fused_key = (False, *engine), (True, *engine)
        totals["triton"] += per_token * results[plain_key]
        totals["fused"] += per_token * results.get(fused_key, results[plain_key])
        print(line, flush=True)
        del run  # its defaults hold this shape's copies
        ws = []  # free this shape's copies before the next shape's
    products = sum(per_token for _, _, per_token, _ in MODEL_SHAPES[shape].values())
    print(
        f"per-token sum of the {products} products at the engine's config (ms):",
        {k: round(v / 1e3, 3) for k, v in totals.items()},
        f"probe {time.time() - t0:.0f} s",
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    main(ap.parse_args().shape)
