"""Batch-invariant products and RMS norm, as torch custom ops: each row's float32 sums run in one order whatever
the number of rows, so a token's outputs are the same bits in a decode step of one row, a tree of 64 or a batch.

cuBLAS picks its kernel, tiles and split over K from the whole shape, row count included, and Inductor picks its
reductions' blocks and warps from the row count too (torch's own heuristics say so: TORCHINDUCTOR_BATCH_INVARIANT
exists to pin them); either can change the order of a row's sums and so its last bits.

invariant_linear: a program owns a (BLOCK_M rows, BLOCK_N outputs) tile over one span of K, walked BLOCK_K columns
at a time in order on tensor cores. Tiles are fixed (KernelTuning), and the split of K into spans comes from (N, K)
only: enough programs for a one-row product, which streams the weights, to fill the GPU. A split's float32
partials are summed span by span, in order, by a second kernel (no atomics). A row's position in its tile and
the rows beside it never enter its sums: the tensor-core product computes every output alike.

invariant_rms_norm: one program a row, its squares summed BLOCK columns at a time into a fixed vector, then
reduced; RMSNorm.forward's roundings (the normalised row in x's dtype, then times the weight).

On CPU tensors (Triton's interpreter: the tests) a tile product is float32 products summed over the block of K
instead of tl.dot: the interpreter's tl.dot multiplies bf16 tiles as raw integers, and its float32 one is numpy's
matmul, whose BLAS kernels sum a row in an order that depends on the row's position in the tile. Everything else
(tiles, spans, the order of the blocks and of the partials) is the GPU's code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning


@triton.jit(do_not_specialize=["m"])
def _invariant_matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    part_ptr,
    m,
    n,
    k,
    span,
    stride_x,
    stride_w,
    BIAS: tl.constexpr,
    PARTIALS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[m, n] = x[m, k] W[n, k]^T (+ bias), or, PARTIALS, the float32 sums of K span program_id(2) into
    part[split, m, n]. Spans are whole BLOCK_K blocks, so every column block is the same whatever the split.
    m is not specialised: a one-row call compiles to the code of a many-row one."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_rows, live_outs = rows < m, outs < n
    start = tl.program_id(2) * span
    end = tl.minimum(start + span, k)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        inside = cols[None, :] < end
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=live_rows[:, None] & inside, other=0.0)
        w = tl.load(w_ptr + outs[:, None] * stride_w + cols[None, :], mask=live_outs[:, None] & inside, other=0.0)
        if INTERPRETED:
            products = x.to(tl.float32)[:, :, None] * tl.trans(w.to(tl.float32))[None, :, :]
            acc += tl.sum(products, axis=1)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    offsets = rows[:, None] * n + outs[None, :]
    live = live_rows[:, None] & live_outs[None, :]
    if PARTIALS:
        tl.store(part_ptr + tl.program_id(2) * m * n + offsets, acc, mask=live)
    else:
        if BIAS:
            acc += tl.load(bias_ptr + outs, mask=live_outs, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["m"])
def _sum_partials_kernel(part_ptr, bias_ptr, y_ptr, m, n, splits, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = the sum of part[0..splits) in that order (+ bias), each output alone: its order is the split's."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offsets < m * n
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):
        total += tl.load(part_ptr + s * m * n + offsets, mask=live, other=0.0)
    if BIAS:
        total += tl.load(bias_ptr + offsets % n, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, total.to(y_ptr.dtype.element_ty), mask=live)


def k_span(n: int, k: int, tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """The columns of one span of K for a weight [n, k]: K split until the output tiles times the splits reach
    tuning.invariant_programs, at most invariant_max_splits spans of invariant_min_blocks_per_split blocks at
    least. From (n, k) and the tuning only, never from the row count: that is what keeps rows invariant."""
    _, block_n, block_k, _, _ = tuning.invariant_tile
    blocks = triton.cdiv(k, block_k)
    wanted = triton.cdiv(tuning.invariant_programs, triton.cdiv(n, block_n))
    splits = max(1, min(wanted, tuning.invariant_max_splits, blocks // tuning.invariant_min_blocks_per_split))
    return triton.cdiv(blocks, splits) * block_k


@torch.library.custom_op("specpipe::invariant_linear", mutates_args=())
def _invariant_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    tile: list[int],
    span: int,
    max_rows: int,
    sum_block: int,
    precision: str,
) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages = tile
    x, w = x.contiguous(), w.contiguous()
    (m, k), n = x.shape, w.shape[0]
    y = x.new_empty(m, n)
    splits = triton.cdiv(k, span)
    b = x if bias is None else bias.contiguous()
    # Rows in launches of at most max_rows (a prefill's thousands): bounds the partials, changes no row's sums.
    for r0 in range(0, m, max_rows):
        rows = min(max_rows, m - r0)
        xs, ys = x[r0 : r0 + rows], y[r0 : r0 + rows]
        part = xs.new_empty(splits, rows, n, dtype=torch.float32) if splits > 1 else ys
        _invariant_matmul_kernel[(triton.cdiv(rows, block_m), triton.cdiv(n, block_n), splits)](
            xs,
            w,
            b,
            ys,
            part,
            rows,
            n,
            k,
            span,
            xs.stride(0),
            w.stride(0),
            BIAS=bias is not None,
            PARTIALS=splits > 1,
            INTERPRETED=x.device.type == "cpu",
            PRECISION=precision,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=warps,
            num_stages=stages,
        )
        if splits > 1:
            _sum_partials_kernel[(triton.cdiv(rows * n, sum_block),)](
                part, b, ys, rows, n, splits, BIAS=bias is not None, BLOCK=sum_block
            )
    return y


@_invariant_linear.register_fake
def _(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    tile: list[int],
    span: int,
    max_rows: int,
    sum_block: int,
    precision: str,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tuning: KernelTuning = DEFAULT_TUNING
) -> torch.Tensor:
    """F.linear(x [M, K], weight [N, K], bias) -> [M, N] in x's dtype, float32 sums, each row's in one order for
    every M (see the module's docstring)."""
    n, k = weight.shape
    return _invariant_linear(
        x,
        weight,
        bias,
        list(tuning.invariant_tile),
        k_span(n, k, tuning),
        tuning.invariant_max_rows,
        tuning.invariant_sum_block,
        tuning.dot_precision(x.dtype),
    )


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, rows, k, eps, BLOCK: tl.constexpr):
    """y[row] = w * (x[row] / rms(x[row])).to(x's dtype), one program a row: squares summed BLOCK columns at a
    time into one vector, then reduced, an order set by BLOCK and the warps alone."""
    dtype = x_ptr.dtype.element_ty
    row = tl.program_id(0)
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, k, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        xs = tl.load(x_ptr + row * k + cols, mask=cols < k, other=0.0).to(tl.float32)
        squares += xs * xs
    scale = tl.rsqrt(tl.sum(squares, axis=0) / k + eps)
    for k0 in range(0, k, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        inside = cols < k
        xs = tl.load(x_ptr + row * k + cols, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        normed = (xs * scale).to(dtype).to(tl.float32)
        tl.store(y_ptr + row * k + cols, (g * normed).to(y_ptr.dtype.element_ty), mask=inside)


@torch.library.custom_op("specpipe::invariant_rms_norm", mutates_args=())
def _invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, block: int, warps: int) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    count = rows.shape[0]
    if count:
        _rms_norm_kernel[(count,)](rows, weight.contiguous(), y, count, k, eps, BLOCK=block, num_warps=warps)
    return y


@_invariant_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, block: int, warps: int) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)


def invariant_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, tuning: KernelTuning = DEFAULT_TUNING
) -> torch.Tensor:
    """RMSNorm.forward (x [..., K], weight [K]) with each row's sum in one order for every row count."""
    return _invariant_rms_norm(x, weight, eps, tuning.invariant_norm_block, tuning.invariant_norm_warps)
