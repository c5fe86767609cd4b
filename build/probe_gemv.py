#!/usr/bin/env python3
"""Batch-1 products of the Llama-3-8B shapes on CUDA: cuBLAS vs an inductor mul+sum reduction vs the
engine's Triton GEMV kernel over a sweep of its block sizes. Each product runs 40 times inside one
CUDA graph; prints microseconds and GB/s per shape and the sum over the 129 products of one token.

  python3 build/probe_gemv.py          # on a CUDA machine with Triton (about 10 s on an H200)
"""
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from pipeline.engine.fused_kernels import _gemv_kernel  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PER_MODEL = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
REPS = 40
SWEEP = list(itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8)))  # rows, columns, warps


def triton_gemv(x, w, y, rows, cols, warps):
    n, k = w.shape
    _gemv_kernel[(triton.cdiv(n, rows),)](w, x, y, x, x, n, k, 0.0, NORM=False, RESIDUAL=False, SWIGLU=False,
                                          BLOCK_ROWS=rows, BLOCK_K=cols, num_warps=warps)
    return y


def timed(fn):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay(); torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / REPS * 1e3)
    return best  # microseconds


def main():
    torch.manual_seed(0)
    mulsum = torch.compile(lambda x, w: (w.float() * x.float()).sum(-1).to(torch.bfloat16))
    totals = {"cublas": 0.0, "mulsum": 0.0, "triton": 0.0}
    t0 = time.time()
    print(f"{'shape':<8} {'MB':>6} {'cublas us':>9} {'GB/s':>6} {'mulsum':>7} {'GB/s':>6} {'triton':>7} {'GB/s':>6} best cfg")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), w.float())[0]
        mb = n * k * 2 / 1e6
        t_cb = timed(lambda: F.linear(x, w))
        got = mulsum(x[0], w)
        err_ms = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        t_ms = timed(lambda: mulsum(x[0], w))
        best = (float("inf"), None)
        for bn, bk, warps in SWEEP:
            if bk > k:
                continue
            got = triton_gemv(x[0], w, y, bn, bk, warps)
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, (name, bn, bk, warps, err)
            t = timed(lambda: triton_gemv(x[0], w, y, bn, bk, warps))
            best = min(best, (t, (bn, bk, warps)))
        gbs = lambda t: mb * 1e-3 / (t * 1e-6)
        print(f"{name:<8} {mb:6.1f} {t_cb:9.1f} {gbs(t_cb):6.0f} {t_ms:7.1f} {gbs(t_ms):6.0f} {best[0]:7.1f} "
              f"{gbs(best[0]):6.0f} {best[1]} mulsum_err={err_ms:.1e}", flush=True)
        for key, t in (("cublas", t_cb), ("mulsum", t_ms), ("triton", best[0])):
            totals[key] += PER_MODEL[name] * t
        del w
    print("per-token sum of the 129 products (ms):", {k: round(v / 1e3, 3) for k, v in totals.items()},
          f"probe {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
