"""Single-token products (GEMV) of a half-precision Linear, as torch custom ops so that torch.compile keeps
each whole in a graph: plain, with the RMS norm before it, with SiLU-and-multiply or the residual add after
it (gemv), and the QKV product with rotary and the cache write as its epilogue (gemv_rope_store).

At batch 1 a decode step is one row times every weight matrix, so its speed is how fast those matrices stream
from memory: each program sums whole rows in float32. Every rounding the unfused layer does in the model's
half dtype (the norm's output, the projection before its residual add, the residual sum) is repeated at the
same point, so a fused step computes what the unfused one computes up to the order of float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.engine.kernels.rotary import _cache_offsets, _rope_rows, _rotary
from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning


@triton.jit
def _gemv_input(x_ptr, norm_ptr, cols, inside, scale, dtype, NORM: tl.constexpr):
    """A tile of x in float32, RMS-normalised and scaled by norm_ptr with the unfused norm's roundings."""
    x = tl.load(x_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if NORM:
        g = tl.load(norm_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        x = (g * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x


@triton.jit
def _gemv_rows(
    w_ptr,
    x_ptr,
    norm_ptr,
    rows,
    live,
    n,
    k,
    eps,
    dtype,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The float32 sums of W's rows `rows` (and, GATED, of the rows n further on) times x: the loop
    over K of _gemv_kernel, whose docstring says what NORM and GATED do. Returns (sums, gate sums)."""
    cols = tl.arange(0, BLOCK_K)
    inside = cols < k
    tile = rows[:, None] * k + cols[None, :]
    mask = live[:, None] & inside[None, :]
    w = tl.load(w_ptr + tile, mask=mask, other=0.0)
    wg = tl.zeros((BLOCK_ROWS, BLOCK_K), dtype=w.dtype)
    if GATED:
        wg = tl.load(w_ptr + n * k + tile, mask=mask, other=0.0)
    scale = 1.0
    if NORM:
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            xs = tl.load(x_ptr + k0 + cols, mask=k0 + cols < k, other=0.0).to(tl.float32)
            squares += xs * xs
        scale = tl.rsqrt(tl.sum(squares, axis=0) / k + eps)
    x = _gemv_input(x_ptr, norm_ptr, cols, inside, scale, dtype, NORM)[None, :]
    acc = w.to(tl.float32) * x
    gate = wg.to(tl.float32) * x
    for k0 in range(BLOCK_K, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        inside = cols < k
        tile = rows[:, None] * k + cols[None, :]
        mask = live[:, None] & inside[None, :]
        w = tl.load(w_ptr + tile, mask=mask, other=0.0)
        if GATED:
            wg = tl.load(w_ptr + n * k + tile, mask=mask, other=0.0)
        x = _gemv_input(x_ptr, norm_ptr, cols, inside, scale, dtype, NORM)[None, :]
        acc += w.to(tl.float32) * x
        if GATED:
            gate += wg.to(tl.float32) * x
    return tl.sum(acc, axis=1), tl.sum(gate, axis=1)


@triton.jit
def _gemv_kernel(
    w_ptr,
    x_ptr,
    y_ptr,
    norm_ptr,
    res_ptr,
    n,
    k,
    eps,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[n] = W[n, k] x, each program summing BLOCK_ROWS whole rows in float32.

    NORM: x is first RMS-normalised and scaled by norm_ptr (every program recomputes the scale from
    the whole of x: k values from L2, against BLOCK_ROWS * k weights from memory).
    GATED: W has 2n rows, fc over gate (MLP.fc_gate), and y = SiLU(fc x) * (gate x): each program
    also sums the gate rows of its fc rows, so the MLP needs no kernel between its two GEMVs.
    RESIDUAL: y += res.
    The first weight tile is requested before the norm's pass over x, so that its latency overlaps it.
    """
    dtype = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = rows < n
    y, gate = _gemv_rows(w_ptr, x_ptr, norm_ptr, rows, live, n, k, eps, dtype, NORM, GATED, BLOCK_ROWS, BLOCK_K)
    if GATED:
        y = _silu_times(y, gate, dtype)
    if RESIDUAL:
        y = y.to(dtype).to(tl.float32) + tl.load(res_ptr + rows, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(dtype), mask=live)


@triton.jit
def _silu_times(fc, gate, dtype):
    """SiLU(fc) * gate from float32 sums, with the unfused MLP's roundings: both outputs, SiLU, the product."""
    fc = fc.to(dtype).to(tl.float32)
    act = (fc / (1.0 + tl.exp(-fc))).to(dtype).to(tl.float32)
    return act * gate.to(dtype).to(tl.float32)


@torch.library.custom_op("specpipe::gemv", mutates_args=())
def _gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    gated: bool,
    block_rows: int,
    block_k: int,
    warps: int,
) -> torch.Tensor:
    x, w = x.contiguous(), w.contiguous()
    n, k = w.shape
    n = n // 2 if gated else n
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_rows),)](
        w,
        x,
        y,
        x if norm is None else norm.contiguous(),
        x if residual is None else residual.contiguous(),
        n,
        k,
        eps,
        NORM=norm is not None,
        RESIDUAL=residual is not None,
        GATED=gated,
        BLOCK_ROWS=block_rows,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return y


@_gemv.register_fake
def _(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    gated: bool,
    block_rows: int,
    block_k: int,
    warps: int,
) -> torch.Tensor:
    return x.new_empty(w.shape[0] // 2 if gated else w.shape[0])


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> torch.Tensor:
    """x [K] times w [N, K] (row-major) -> [N] in x's dtype ([N / 2] gated), see _gemv_kernel."""
    return _gemv(x, w, norm, eps, residual, gated, tuning.block_rows, tuning.block_k, tuning.num_warps)


@triton.jit
def _gemv_rope_kernel(
    w_ptr,
    x_ptr,
    norm_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    k,
    eps,
    layer_offset,
    stride_slot,
    stride_head,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_rope_store_kernel as the epilogue of the QKV GEMV (_gemv_kernel, with NORM or, for a layer without
    an input norm such as an EAGLE-1 draft's first, without), one kernel a layer fewer, each program summing
    the rows _rope_rows gives it."""
    dtype = q_ptr.dtype.element_ty
    PAIRS: tl.constexpr = BLOCK_ROWS // 2
    HALF: tl.constexpr = HEAD // 2
    rotated, head, dims, rows = _rope_rows(HEADS, KV_HEADS, HEAD, BLOCK_ROWS)
    pos, slot = tl.load(pos_ptr), tl.load(slot_ptr)  # in flight during the products, not after them
    n = (HEADS + 2 * KV_HEADS) * HEAD
    y, _ = _gemv_rows(w_ptr, x_ptr, norm_ptr, rows, rows < n, n, k, eps, dtype, NORM, False, BLOCK_ROWS, BLOCK_K)
    y = y.to(dtype).to(tl.float32)  # the unfused GEMV's output
    if rotated:
        low, high = tl.split(tl.reshape(y, (PAIRS, 2)))
        out_low = _rotary(low, -high, cos_ptr, sin_ptr, pos * HEAD + dims, dtype)
        out_high = _rotary(high, low, cos_ptr, sin_ptr, pos * HEAD + HALF + dims, dtype)
        if head < HEADS:
            out_ptr = q_ptr + head * HEAD
        else:
            out_ptr = k_ptr + layer_offset + slot * stride_slot + (head - HEADS) * stride_head
        tl.store(out_ptr + dims, out_low.to(dtype))
        tl.store(out_ptr + HALF + dims, out_high.to(dtype))
    else:
        v_rows = rows - (HEADS + KV_HEADS) * HEAD
        tl.store(v_ptr + layer_offset + slot * stride_slot + v_rows // HEAD * stride_head + v_rows % HEAD, y.to(dtype))


@torch.library.custom_op("specpipe::gemv_rope_store", mutates_args=("k_cache", "v_cache"))
def _gemv_rope_store(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position: torch.Tensor,
    slot: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    heads: int,
    block_rows: int,
    block_k: int,
    warps: int,
) -> torch.Tensor:
    kv_heads, head = k_cache.shape[-2], k_cache.shape[-1]
    assert w.shape[0] == (heads + 2 * kv_heads) * head
    rows = min(block_rows, head)  # both powers of two: a program's row pairs lie in one head
    assert rows >= 2, "rotate-half pairs need a head of two dimensions at least"
    x, w = x.contiguous(), w.contiguous()
    q = x.new_empty(heads * head)
    _gemv_rope_kernel[(w.shape[0] // rows,)](
        w,
        x,
        x if norm is None else norm.contiguous(),
        cos,
        sin,
        position,
        slot,
        q,
        k_cache,
        v_cache,
        w.shape[1],
        eps,
        *_cache_offsets(k_cache, v_cache, cos, sin, layer),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD=head,
        NORM=norm is not None,
        BLOCK_ROWS=rows,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return q


@_gemv_rope_store.register_fake
def _(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position: torch.Tensor,
    slot: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    heads: int,
    block_rows: int,
    block_k: int,
    warps: int,
) -> torch.Tensor:
    return x.new_empty(heads * k_cache.shape[-1])


def gemv_rope_store(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position: torch.Tensor,
    slot: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    heads: int,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> torch.Tensor:
    """rope_store(gemv(x, w, norm, eps), cos, sin, position, slot, k_cache, v_cache, layer, heads) in
    one kernel (_gemv_rope_kernel): x [K] RMS-normalised (unless norm is None) times w [(H + 2 Hkv) D, K] ->
    rotated q [H D]."""
    return _gemv_rope_store(
        x,
        w,
        norm,
        eps,
        cos,
        sin,
        position,
        slot,
        k_cache,
        v_cache,
        layer,
        heads,
        tuning.block_rows,
        tuning.block_k,
        tuning.num_warps,
    )
