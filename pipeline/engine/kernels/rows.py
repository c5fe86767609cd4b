"""Products of a few rows (2-64 tokens: trees, batched decode rows) on tensor cores, as torch custom ops:
rows_gemm (with the RMS norm before it, SiLU-and-multiply or the residual add after it) and the QKV product
with the norm, rotary and the cache write inside (rows_rope_store). A program owns a tile of outputs for a
tile of rows and streams its weight tile once for all of them. Roundings as in gemv.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.engine.kernels.gemv import _silu_times
from pipeline.engine.kernels.rotary import _cache_offsets, _rope_rows, _rotary
from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning


@triton.jit
def _rows_products(
    x_ptr,
    w_ptr,
    norm_ptr,
    tokens,
    outs,
    live_tokens,
    live_outs,
    n,
    k,
    eps,
    dtype,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The float32 sums x[tokens] W[outs]^T on tensor cores, and (GATED) those of W's rows n further on.
    NORM: each row of x is first RMS-normalised and scaled by norm_ptr with the unfused norm's roundings,
    its scale from a first pass over the row (from L2: k values a row, against BLOCK_N * k weights)."""
    scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    if NORM:
        squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(
                x_ptr + tokens[:, None] * k + cols[None, :], mask=live_tokens[:, None] & (cols < k)[None, :], other=0.0
            ).to(tl.float32)
            squares += xs * xs
        scale = tl.rsqrt(tl.sum(squares, axis=1) / k + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        inside = cols < k
        x = tl.load(x_ptr + tokens[:, None] * k + cols[None, :], mask=live_tokens[:, None] & inside[None, :], other=0.0)
        if NORM:
            g = tl.load(norm_ptr + cols, mask=inside, other=0.0).to(tl.float32)
            x = (g[None, :] * (x.to(tl.float32) * scale[:, None]).to(dtype).to(tl.float32)).to(dtype)
        tile = outs[:, None] * k + cols[None, :]
        mask = live_outs[:, None] & inside[None, :]
        acc = tl.dot(x, tl.trans(tl.load(w_ptr + tile, mask=mask, other=0.0)), acc, input_precision=PRECISION)
        if GATED:
            wg = tl.load(w_ptr + n * k + tile, mask=mask, other=0.0)
            gate = tl.dot(x, tl.trans(wg), gate, input_precision=PRECISION)
    return acc, gate


@triton.jit
def _rows_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    res_ptr,
    norm_ptr,
    m,
    n,
    k,
    eps,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[m, n] = x[m, k] W[n, k]^T for the few rows of a tree step: a program owns BLOCK_N outputs of
    BLOCK_M rows of x and streams their rows of W once for them, on tensor cores. GATED and RESIDUAL
    are _gemv_kernel's epilogues (SiLU(fc) * gate over W's two halves; + res), NORM its prologue
    (see _rows_products). With the norm inside, the 8B shape's products are slower than cuBLAS's plus a
    norm kernel: only small layers use NORM (KernelTuning.rows_layer)."""
    dtype = y_ptr.dtype.element_ty
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_tokens, live_outs = tokens < m, outs < n
    acc, gate = _rows_products(
        x_ptr,
        w_ptr,
        norm_ptr,
        tokens,
        outs,
        live_tokens,
        live_outs,
        n,
        k,
        eps,
        dtype,
        NORM,
        GATED,
        PRECISION,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    y = acc
    if GATED:
        y = _silu_times(acc, gate, dtype)
    offsets = tokens[:, None] * n + outs[None, :]
    live = live_tokens[:, None] & live_outs[None, :]
    if RESIDUAL:
        y = y.to(dtype).to(tl.float32) + tl.load(res_ptr + offsets, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, y.to(dtype), mask=live)


def _rows_tile(
    m: int, w: torch.Tensor, small_weights: int, small_tile: list[int], tile: list[int], min_rows: int, max_tokens: int
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a rows kernel for m rows of x: weights of at most
    small_weights elements take small_tile, others `tile` with all of x's rows in one tile."""
    if w.numel() <= small_weights:
        block_m, block_n, block_k, warps, stages = small_tile
        return block_m, block_n, block_k, warps, stages
    block_n, block_k, warps, stages = tile
    return max(min_rows, min(max_tokens, triton.next_power_of_2(m))), block_n, block_k, warps, stages


def _tile_args(tuning: KernelTuning, kind: str) -> tuple[int, list[int], list[int], int, int, str]:
    """The rows ops' tuning arguments for a kernel of this kind (rope, gated or plain): small_weights,
    small_tile, tile, min_rows, max_tokens, float32_dot."""
    small = {
        "rope": tuning.rows_small_rope_tile,
        "gated": tuning.rows_small_gated_tile,
        "plain": tuning.rows_small_tile,
    }[kind]
    tile = tuning.rows_gemm_gated_tile if kind == "gated" else tuning.rows_gemm_tile
    return (
        tuning.rows_small_weights,
        list(small),
        list(tile),
        tuning.tree_min_rows,
        tuning.rows_gemm_max_tokens,
        tuning.float32_dot,
    )


def _precision(x: torch.Tensor, float32_dot: str) -> str:
    return float32_dot if x.dtype == torch.float32 else "tf32"


@torch.library.custom_op("specpipe::rows_gemm", mutates_args=())
def _rows_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor | None,
    gated: bool,
    norm: torch.Tensor | None,
    eps: float,
    small_weights: int,
    small_tile: list[int],
    tile: list[int],
    min_rows: int,
    max_tokens: int,
    float32_dot: str,
) -> torch.Tensor:
    x, w = x.contiguous(), w.contiguous()
    (m, k), n = x.shape, w.shape[0] // 2 if gated else w.shape[0]
    y = x.new_empty(m, n)
    block_m, block_n, block_k, warps, stages = _rows_tile(m, w, small_weights, small_tile, tile, min_rows, max_tokens)
    _rows_gemm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x,
        w,
        y,
        x if residual is None else residual.contiguous(),
        x if norm is None else norm.contiguous(),
        m,
        n,
        k,
        eps,
        RESIDUAL=residual is not None,
        GATED=gated,
        NORM=norm is not None,
        PRECISION=_precision(x, float32_dot),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return y


@_rows_gemm.register_fake
def _(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor | None,
    gated: bool,
    norm: torch.Tensor | None,
    eps: float,
    small_weights: int,
    small_tile: list[int],
    tile: list[int],
    min_rows: int,
    max_tokens: int,
    float32_dot: str,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0] // 2 if gated else w.shape[0])


def rows_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> torch.Tensor:
    """x [M, K] (RMS-normalised with weight `norm` first, if given) times w [N, K]^T -> [M, N] in x's dtype
    ([M, N / 2] gated), see _rows_gemm_kernel. Float32 multiplies as tuning.float32_dot says (the tests' CPU
    models; the engine sends half dtypes only)."""
    return _rows_gemm(x, w, residual, gated, norm, eps, *_tile_args(tuning, "gated" if gated else "plain"))


@triton.jit
def _rows_rope_kernel(
    x_ptr,
    w_ptr,
    norm_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    m,
    k,
    eps,
    layer_offset,
    stride_slot,
    stride_head,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    NORM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_gemv_rope_kernel for several tokens: the QKV product of BLOCK_M tokens (with NORM their norm inside,
    see _rows_products) with rotary and the cache write as its epilogue, a program's BLOCK_N outputs the rows
    _rope_rows gives it. Each token has its own position and slot."""
    dtype = q_ptr.dtype.element_ty
    PAIRS: tl.constexpr = BLOCK_N // 2
    HALF: tl.constexpr = HEAD // 2
    rotated, head, dims, outs = _rope_rows(HEADS, KV_HEADS, HEAD, BLOCK_N)
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = tokens < m
    pos = tl.load(pos_ptr + tokens, mask=live, other=0)
    slot = tl.load(slot_ptr + tokens, mask=live, other=0)
    n = (HEADS + 2 * KV_HEADS) * HEAD
    y, _ = _rows_products(
        x_ptr,
        w_ptr,
        norm_ptr,
        tokens,
        outs,
        live,
        outs < n,
        n,
        k,
        eps,
        dtype,
        NORM,
        False,
        PRECISION,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    y = y.to(dtype).to(tl.float32)  # the unfused product's output
    if rotated:
        low, high = tl.split(tl.reshape(y, (BLOCK_M, PAIRS, 2)))
        angles = pos[:, None] * HEAD + dims[None, :]
        out_low = _rotary(low, -high, cos_ptr, sin_ptr, angles, dtype).to(dtype)
        out_high = _rotary(high, low, cos_ptr, sin_ptr, angles + HALF, dtype).to(dtype)
        if head < HEADS:
            out = q_ptr + (tokens * HEADS * HEAD + head * HEAD)[:, None] + dims[None, :]
        else:
            out = k_ptr + (layer_offset + slot * stride_slot + (head - HEADS) * stride_head)[:, None] + dims[None, :]
        tl.store(out, out_low, mask=live[:, None])
        tl.store(out + HALF, out_high, mask=live[:, None])
    else:
        v_cols = outs - (HEADS + KV_HEADS) * HEAD
        v_out = (
            v_ptr
            + (layer_offset + slot * stride_slot)[:, None]
            + (v_cols // HEAD * stride_head + v_cols % HEAD)[None, :]
        )
        tl.store(v_out, y.to(dtype), mask=live[:, None])


@torch.library.custom_op("specpipe::rows_rope_store", mutates_args=("k_cache", "v_cache"))
def _rows_rope_store(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    heads: int,
    small_weights: int,
    small_tile: list[int],
    tile: list[int],
    min_rows: int,
    max_tokens: int,
    float32_dot: str,
) -> torch.Tensor:
    kv_heads, head = k_cache.shape[-2], k_cache.shape[-1]
    assert w.shape[0] == (heads + 2 * kv_heads) * head
    x, w = x.contiguous(), w.contiguous()
    m = x.shape[0]
    q = x.new_empty(m, heads * head)
    block_m, block_n, block_k, warps, stages = _rows_tile(m, w, small_weights, small_tile, tile, min_rows, max_tokens)
    block_n = min(block_n, head)  # a program's row pairs lie in one head
    _rows_rope_kernel[(w.shape[0] // block_n, triton.cdiv(m, block_m))](
        x,
        w,
        x if norm is None else norm.contiguous(),
        cos,
        sin,
        positions.contiguous(),
        slots.contiguous(),
        q,
        k_cache,
        v_cache,
        m,
        w.shape[1],
        eps,
        *_cache_offsets(k_cache, v_cache, cos, sin, layer),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD=head,
        NORM=norm is not None,
        PRECISION=_precision(x, float32_dot),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return q


@_rows_rope_store.register_fake
def _(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    heads: int,
    small_weights: int,
    small_tile: list[int],
    tile: list[int],
    min_rows: int,
    max_tokens: int,
    float32_dot: str,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], heads * k_cache.shape[-1])


def rows_rope_store(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    heads: int,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> torch.Tensor:
    """gemv_rope_store for tokens x [M, K] at RoPE positions `positions` and cache slots `slots` [M]
    (_rows_rope_kernel) -> rotated q [M, H D]; norm None: no input norm. The head size is a power of two of
    16 at least."""
    return _rows_rope_store(
        x, w, norm, eps, cos, sin, positions, slots, k_cache, v_cache, layer, heads, *_tile_args(tuning, "rope")
    )
