"""The Triton kernel behind gemv.py, as a torch custom op so torch.compile keeps it whole in a graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.engine.gemv import BLOCK_K, BLOCK_ROWS, NUM_WARPS


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, n, k, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * k + cols[None, :], mask=(rows[:, None] < n) & (cols[None, :] < k),
                    other=0.0)
        x = tl.load(x_ptr + cols, mask=cols < k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < n)


@torch.library.custom_op("specpipe::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [K] times w [N, K] (row-major) -> [N] in x's dtype, accumulated in float32."""
    x, w = x.contiguous(), w.contiguous()
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, BLOCK_ROWS),)](w, x, y, n, k, BLOCK_ROWS=BLOCK_ROWS, BLOCK_K=BLOCK_K,
                                               num_warps=NUM_WARPS)
    return y


@gemv.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(w.shape[0])
