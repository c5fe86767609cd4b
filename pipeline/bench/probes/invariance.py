"""Batch-invariant products on CUDA: invariant_linear (two tiles) against cuBLAS (F.linear) and the engine's GEMV,
at M = 1, 8, 32 and 64 rows of the Llama-3-8B and SmolLM2 projection shapes in bf16, and whether each is row
invariant on the GPU: row r of a B-row call equal, bit for bit, to the 1-row call on that row, for every row and B.
The norms too: invariant_rms_norm, torch's eager ops and torch.compile's (Inductor's) RMSNorm.

Timings as in probes/gemv.py: each product REPS times in one CUDA graph over cold copies of the weights.

  PYTHONPATH=. python3 -m pipeline.bench.probes.invariance   # on a CUDA machine (under 2 minutes on an H200)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pipeline.bench.probes.gemv import REPS, cold_copies, timed
from pipeline.engine.kernels.gemv import gemv
from pipeline.engine.kernels.invariant import invariant_linear, invariant_rms_norm, k_span
from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning
from pipeline.engine.model import RMSNorm

# name: (N outputs, K columns)
SHAPES = {
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336),
    "smol qkv": (960, 576),  # 9 heads + 2 x 3 kv heads of 64
    "smol o": (576, 576),
    "smol gate_up": (3072, 576),
    "smol down": (576, 1536),
    "smol lm_head": (49152, 576),
}
ROWS = (1, 8, 32, 64)
# The engine's tile (64 rows, wgmma-sized), and a 16-row tile for comparison.
VARIANTS = {
    "inv": DEFAULT_TUNING,
    "inv16": dataclasses.replace(DEFAULT_TUNING, invariant_tile=(16, 64, 128, 4, 4)),
}
NORM_SIZES = (4096, 576)
EPS = 1e-5
COMPILED_SHAPES = 64  # dynamo's recompile limit for the compiled norm: the row counts of both sizes, and more
MAX_REL_ERR = 2e-2  # bf16 products against float32
DTYPE = torch.bfloat16


def rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Whether fn(x[:B])[r] == fn(x[r : r + 1]) bitwise for every B in ROWS and every row r < B."""
    singles = torch.cat([fn(x[r : r + 1]) for r in range(x.shape[0])])
    return all(torch.equal(fn(x[:b]), singles[:b]) for b in ROWS)


def cublas(x: torch.Tensor, ws: list[torch.Tensor], i: int) -> torch.Tensor:
    """cuBLAS's product of x and the i-th cold copy of W (cycling)."""
    return F.linear(x, ws[i % len(ws)])


def invariant(x: torch.Tensor, ws: list[torch.Tensor], tuning: KernelTuning, i: int) -> torch.Tensor:
    """invariant_linear of x and the i-th cold copy of W (cycling)."""
    return invariant_linear(x, ws[i % len(ws)], tuning=tuning)


def one_row_gemv(x: torch.Tensor, ws: list[torch.Tensor], i: int) -> torch.Tensor:
    """The engine's GEMV of x [K] and the i-th cold copy of W (cycling)."""
    return gemv(x, ws[i % len(ws)])


def product_line(name: str, n: int, k: int) -> list[str]:
    """The table's lines for one shape: a line per row count, then whether each route is row invariant."""
    nbytes = n * k * DTYPE.itemsize
    copies = cold_copies(nbytes)
    reps = max(REPS, copies)
    ws = [torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5 for _ in range(copies)]
    x = torch.randn(max(ROWS), k, device="cuda", dtype=DTYPE)
    want = F.linear(x.float(), ws[0].float())
    for label, tuning in VARIANTS.items():
        got = invariant_linear(x, ws[0], tuning=tuning).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < MAX_REL_ERR, (name, label, err)
    lines = []
    for m in ROWS:
        xs = x[:m]
        t = {"cublas": timed(partial(cublas, xs, ws), reps)}
        for label, tuning in VARIANTS.items():
            t[label] = timed(partial(invariant, xs, ws, tuning), reps)
        gemv_us = f"{timed(partial(one_row_gemv, x[0], ws), reps):7.1f}" if m == 1 else f"{'-':>7}"
        gbs = nbytes / t["inv"] / 1e3  # the weights' bytes over the invariant product's time
        lines.append(
            f"{name:<13}{n:>6}{k:>6}{m:>4}  {t['cublas']:8.1f}  {gemv_us}  {t['inv']:8.1f}  {t['inv16']:8.1f}"
            f"  {t['inv'] / t['cublas']:6.2f}  {gbs:6.0f}"
        )
    checks = {"cublas": rows_invariant(partial(F.linear, weight=ws[0]), x)}
    for label, tuning in VARIANTS.items():
        checks[label] = rows_invariant(partial(invariant_linear, weight=ws[0], tuning=tuning), x)
    splits = -(-k // k_span(n, k))
    lines.append(f"{'':<13}K spans {splits}; row invariant: " + ", ".join(f"{a} {b}" for a, b in checks.items()))
    return lines


def norm_line(size: int, tuning: KernelTuning = DEFAULT_TUNING) -> str:
    """Whether each RMS norm route is row invariant at `size` columns."""
    norm = RMSNorm(size, EPS).to(device="cuda", dtype=DTYPE)
    # One static graph a row count (as the engine's captured steps): more than dynamo's default recompile limit.
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=COMPILED_SHAPES):
        norm.weight.normal_()
        x = torch.randn(max(ROWS), size, device="cuda", dtype=DTYPE)
        compiled = torch.compile(norm.forward, dynamic=False)
        checks = {
            "kernel": rows_invariant(partial(invariant_rms_norm, weight=norm.weight, eps=EPS, tuning=tuning), x),
            "eager": rows_invariant(norm, x),
            "inductor": rows_invariant(compiled, x),
        }
    return f"rms norm {size}: row invariant: " + ", ".join(f"{a} {b}" for a, b in checks.items())


def main() -> None:
    torch.manual_seed(0)
    t0 = time.time()
    tiles = ", ".join(f"{label} {tuning.invariant_tile}" for label, tuning in VARIANTS.items())
    print(f"bf16, microseconds a product; tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): {tiles}")
    heads = ("cublas", "gemv", "inv", "inv16", "inv/cb", "GB/s")
    widths = (8, 7, 8, 8, 6, 6)
    print(f"{'shape':<13}{'N':>6}{'K':>6}{'M':>4}" + "".join(f"  {h:>{w}}" for h, w in zip(heads, widths, strict=True)))
    for name, (n, k) in SHAPES.items():
        for line in product_line(name, n, k):
            print(line, flush=True)
        torch.cuda.empty_cache()
    for size in NORM_SIZES:
        print(norm_line(size), flush=True)
    print(f"probe {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
