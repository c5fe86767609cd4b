"""The Triton kernels behind fused.py, as torch custom ops so torch.compile keeps each whole in a graph.

Every rounding the unfused layer does in the model's half dtype (the norm's output, rotary's two
products, the projection before its residual add, the residual sum) is repeated here at the same
point, so a fused step
computes what the unfused one computes up to the order of float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.engine.fused import (ATTENTION_CHUNK_SLOTS, ATTENTION_MAX_SPLITS, ATTENTION_PROGRAMS, BLOCK_K,
                                   BLOCK_ROWS, DRAFT_TOPK_BLOCK_H, DRAFT_TOPK_MAX_ROWS, DRAFT_TOPK_TILE,
                                   DRAFT_TOPK_WARPS, FLOAT32_DOT, NUM_WARPS, ONE_TOKEN_TILES, ROW_TOPK_MAX,
                                   ROWS_GEMM_GATED_TILE, ROWS_GEMM_MAX_TOKENS, ROWS_GEMM_TILE, ROWS_SMALL_GATED_TILE,
                                   ROWS_SMALL_ROPE_TILE, ROWS_SMALL_TILE, ROWS_SMALL_WEIGHTS, TREE_BLOCK_ROWS,
                                   TREE_BLOCK_SLOTS, TREE_MAX_BLOCKS_PER_SPLIT, TREE_MIN_BLOCKS_PER_SPLIT,
                                   TREE_MIN_ROWS)


@triton.jit
def _gemv_input(x_ptr, norm_ptr, cols, inside, scale, dtype, NORM: tl.constexpr):
    """A tile of x in float32, RMS-normalised and scaled by norm_ptr with the unfused norm's roundings."""
    x = tl.load(x_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if NORM:
        g = tl.load(norm_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        x = (g * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x


@triton.jit
def _gemv_rows(w_ptr, x_ptr, norm_ptr, rows, live, n, k, eps, dtype, NORM: tl.constexpr, GATED: tl.constexpr,
               BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
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
def _gemv_kernel(w_ptr, x_ptr, y_ptr, norm_ptr, res_ptr, n, k, eps, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                 GATED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
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
def gemv(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x [K] times w [N, K] (row-major) -> [N] in x's dtype ([N / 2] gated), see _gemv_kernel."""
    x, w = x.contiguous(), w.contiguous()
    n, k = w.shape
    n = n // 2 if gated else n
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, BLOCK_ROWS),)](
        w, x, y, x if norm is None else norm.contiguous(), x if residual is None else residual.contiguous(),
        n, k, eps, NORM=norm is not None, RESIDUAL=residual is not None, GATED=gated, BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return y


@gemv.register_fake
def _(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
      residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    return x.new_empty(w.shape[0] // 2 if gated else w.shape[0])


@triton.jit
def _rows_products(x_ptr, w_ptr, norm_ptr, tokens, outs, live_tokens, live_outs, n, k, eps, dtype, NORM: tl.constexpr,
                   GATED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """The float32 sums x[tokens] W[outs]^T on tensor cores, and (GATED) those of W's rows n further on.
    NORM: each row of x is first RMS-normalised and scaled by norm_ptr with the unfused norm's roundings,
    its scale from a first pass over the row (from L2: k values a row, against BLOCK_N * k weights; that
    pass in steps of 512 or 1,024 columns instead of BLOCK_K measured slower on the H200, session t). Neither
    the squares from the product loop's own x tiles nor the norm's g folded into W (x's tiles straight into
    the products, the scale on their sums) was faster there (session u)."""
    scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    if NORM:
        squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + tokens[:, None] * k + cols[None, :], mask=live_tokens[:, None] & (cols < k)[None, :],
                         other=0.0).to(tl.float32)
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
def _rows_gemm_kernel(x_ptr, w_ptr, y_ptr, res_ptr, norm_ptr, m, n, k, eps, RESIDUAL: tl.constexpr,
                      GATED: tl.constexpr, NORM: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = x[m, k] W[n, k]^T for the few rows of a tree step: a program owns BLOCK_N outputs of
    BLOCK_M rows of x and streams their rows of W once for them, on tensor cores. GATED and RESIDUAL
    are _gemv_kernel's epilogues (SiLU(fc) * gate over W's two halves; + res), NORM its prologue
    (see _rows_products). At the 8B shape a 64-token pass's four products with the norms inside took
    7.31 ms against the 3.96 their tiles take plain (H200, session k): there only small layers use it.
    (Splitting K, the last of a tile's programs adding the parts, measured slower at SmolLM2's shapes
    on the H200: 7.8 against 6.5 us for gate/up, 4.9 against 4.6 for down; session t.)"""
    dtype = y_ptr.dtype.element_ty
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_tokens, live_outs = tokens < m, outs < n
    acc, gate = _rows_products(x_ptr, w_ptr, norm_ptr, tokens, outs, live_tokens, live_outs, n, k, eps, dtype, NORM,
                               GATED, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    y = acc
    if GATED:
        y = _silu_times(acc, gate, dtype)
    offsets = tokens[:, None] * n + outs[None, :]
    live = live_tokens[:, None] & live_outs[None, :]
    if RESIDUAL:
        y = y.to(dtype).to(tl.float32) + tl.load(res_ptr + offsets, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, y.to(dtype), mask=live)


def _rows_tile(m: int, w: torch.Tensor, kind: str) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a rows kernel (kind rope, gated or plain): small weights
    (see ROWS_SMALL_WEIGHTS) take their kind's small tile, others the gated or plain tile with all of x's
    rows in one tile."""
    if w.numel() <= ROWS_SMALL_WEIGHTS:
        return {"rope": ROWS_SMALL_ROPE_TILE, "gated": ROWS_SMALL_GATED_TILE, "plain": ROWS_SMALL_TILE}[kind]
    block_m = max(TREE_MIN_ROWS, min(ROWS_GEMM_MAX_TOKENS, triton.next_power_of_2(m)))
    return (block_m, *(ROWS_GEMM_GATED_TILE if kind == "gated" else ROWS_GEMM_TILE))


def _precision(x: torch.Tensor) -> str:
    return FLOAT32_DOT if x.dtype == torch.float32 else "tf32"


@torch.library.custom_op("specpipe::rows_gemm", mutates_args=())
def rows_gemm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False,
              norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x [M, K] (RMS-normalised with weight `norm` first, if given) times w [N, K]^T -> [M, N] in x's dtype
    ([M, N / 2] gated), see _rows_gemm_kernel. Float32 multiplies as FLOAT32_DOT says (the tests' CPU
    models; the engine sends half dtypes only)."""
    x, w = x.contiguous(), w.contiguous()
    (m, k), n = x.shape, w.shape[0] // 2 if gated else w.shape[0]
    y = x.new_empty(m, n)
    block_m, block_n, block_k, warps, stages = _rows_tile(m, w, "gated" if gated else "plain")
    _rows_gemm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, w, y, x if residual is None else residual.contiguous(), x if norm is None else norm.contiguous(), m, n, k,
        eps, RESIDUAL=residual is not None, GATED=gated, NORM=norm is not None, PRECISION=_precision(x),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


@rows_gemm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False,
      norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0] // 2 if gated else w.shape[0])


@triton.jit
def _rotary(x, rotated, cos_ptr, sin_ptr, offsets, dtype):
    """x cos + rotated sin (rotate-half RoPE) with the unfused rotary's roundings: the float32 tables
    and both products in dtype."""
    cos = tl.load(cos_ptr + offsets).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + offsets).to(dtype).to(tl.float32)
    return (x * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                       layer_offset, stride_slot, stride_head,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD: tl.constexpr):
    """One head of a token's QKV row: q and k heads rotated (rotate-half RoPE, the unfused layer's
    roundings), q heads written to q_ptr, k and v heads to the cache at the token's slot."""
    head = tl.program_id(0)
    dtype = q_ptr.dtype.element_ty
    dims = tl.arange(0, HEAD)
    x = tl.load(qkv_ptr + head * HEAD + dims).to(tl.float32)
    if head < HEADS + KV_HEADS:
        pos = tl.load(pos_ptr)
        partner = tl.load(qkv_ptr + head * HEAD + (dims + HEAD // 2) % HEAD).to(tl.float32)
        x = _rotary(x, tl.where(dims < HEAD // 2, -partner, partner), cos_ptr, sin_ptr, pos * HEAD + dims, dtype)
    if head < HEADS:
        tl.store(q_ptr + head * HEAD + dims, x.to(dtype))
    else:
        slot = tl.load(slot_ptr)
        if head < HEADS + KV_HEADS:
            tl.store(k_ptr + layer_offset + slot * stride_slot + (head - HEADS) * stride_head + dims, x.to(dtype))
        else:
            tl.store(v_ptr + layer_offset + slot * stride_slot + (head - HEADS - KV_HEADS) * stride_head + dims,
                     x.to(dtype))


@triton.jit
def _rope_rows(HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """A rotary kernel program's BLOCK rows of the QKV weight: (rotated, head, dims, rows). Rotate-half RoPE
    pairs dim j of a head with dim j + HEAD / 2, so a program of the q and k heads takes BLOCK / 2 such pairs
    of rows side by side (j, j + HEAD / 2, j + 1, ...), its dims j in the head's first half: it then holds
    every partner it rotates with. Each row of W is contiguous, so the reads coalesce as well. Programs of
    the v heads (not rotated) take consecutive rows, which they only store."""
    PAIRS: tl.constexpr = BLOCK // 2
    HALF: tl.constexpr = HEAD // 2
    program = tl.program_id(0)
    rotated = program < (HEADS + KV_HEADS) * HEAD // BLOCK
    i = tl.arange(0, BLOCK)
    head, first = program * PAIRS // HALF, program * PAIRS % HALF
    dims = first + tl.arange(0, PAIRS)
    rows = tl.where(rotated, head * HEAD + first + i // 2 + i % 2 * HALF, program * BLOCK + i)
    return rotated, head, dims, rows


@triton.jit
def _gemv_rope_kernel(w_ptr, x_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, k, eps,
                      layer_offset, stride_slot, stride_head, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                      HEAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """_rope_store_kernel as the epilogue of the QKV GEMV (_gemv_kernel with NORM), one kernel a layer
    fewer, each program summing the rows _rope_rows gives it."""
    dtype = q_ptr.dtype.element_ty
    PAIRS: tl.constexpr = BLOCK_ROWS // 2
    HALF: tl.constexpr = HEAD // 2
    rotated, head, dims, rows = _rope_rows(HEADS, KV_HEADS, HEAD, BLOCK_ROWS)
    pos, slot = tl.load(pos_ptr), tl.load(slot_ptr)  # in flight during the products, not after them
    n = (HEADS + 2 * KV_HEADS) * HEAD
    y, _ = _gemv_rows(w_ptr, x_ptr, norm_ptr, rows, rows < n, n, k, eps, dtype, True, False, BLOCK_ROWS, BLOCK_K)
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


def _cache_offsets(k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   layer: int) -> tuple[int, int, int]:
    """(layer offset, slot stride, head stride) of the caches [layers, rows, slots, Hkv, D] for the rotary kernels."""
    assert k_cache.stride() == v_cache.stride() and cos.is_contiguous() and sin.is_contiguous()
    return layer * k_cache.stride(0), k_cache.stride(2), k_cache.stride(3)


@torch.library.custom_op("specpipe::rope_store", mutates_args=("k_cache", "v_cache"))
def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor, slot: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, heads: int) -> torch.Tensor:
    """One token's qkv [(H + 2 Hkv) D] -> rotated q [H D]; rotated k and v land in batch row 0 of
    k_cache, v_cache [layers, rows, slots, Hkv, D] at layer `layer`, slot slot[0], RoPE position position[0]."""
    kv_heads, head = k_cache.shape[-2], k_cache.shape[-1]
    q = qkv.new_empty(heads * head)
    _rope_store_kernel[(heads + 2 * kv_heads,)](
        qkv.contiguous(), cos, sin, position, slot, q, k_cache, v_cache,
        *_cache_offsets(k_cache, v_cache, cos, sin, layer), HEADS=heads, KV_HEADS=kv_heads, HEAD=head)
    return q


@rope_store.register_fake
def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor, slot: torch.Tensor,
      k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, heads: int) -> torch.Tensor:
    return qkv.new_empty(heads * k_cache.shape[-1])


@torch.library.custom_op("specpipe::gemv_rope_store", mutates_args=("k_cache", "v_cache"))
def gemv_rope_store(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor, position: torch.Tensor, slot: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, layer: int, heads: int) -> torch.Tensor:
    """rope_store(gemv(x, w, norm, eps), cos, sin, position, slot, k_cache, v_cache, layer, heads) in
    one kernel (_gemv_rope_kernel): x [K] RMS-normalised times w [(H + 2 Hkv) D, K] -> rotated q [H D]."""
    kv_heads, head = k_cache.shape[-2], k_cache.shape[-1]
    assert w.shape[0] == (heads + 2 * kv_heads) * head
    rows = min(BLOCK_ROWS, head)  # both powers of two: a program's row pairs lie in one head
    assert rows >= 2, "rotate-half pairs need a head of two dimensions at least"
    x, w = x.contiguous(), w.contiguous()
    q = x.new_empty(heads * head)
    _gemv_rope_kernel[(w.shape[0] // rows,)](
        w, x, norm.contiguous(), cos, sin, position, slot, q, k_cache, v_cache, w.shape[1], eps,
        *_cache_offsets(k_cache, v_cache, cos, sin, layer), HEADS=heads, KV_HEADS=kv_heads, HEAD=head,
        BLOCK_ROWS=rows, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return q


@gemv_rope_store.register_fake
def _(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
      position: torch.Tensor, slot: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
      heads: int) -> torch.Tensor:
    return x.new_empty(heads * k_cache.shape[-1])


@triton.jit
def _rows_rope_kernel(x_ptr, w_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, m, k, eps,
                      layer_offset, stride_slot, stride_head, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                      HEAD: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """_gemv_rope_kernel for several tokens: the QKV product of BLOCK_M tokens (their norm inside, see
    _rows_products) with rotary and the cache write as its epilogue, a program's BLOCK_N outputs the rows
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
    y, _ = _rows_products(x_ptr, w_ptr, norm_ptr, tokens, outs, live, outs < n, n, k, eps, dtype, True, False,
                          PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
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
        v_out = v_ptr + (layer_offset + slot * stride_slot)[:, None] + (v_cols // HEAD * stride_head + v_cols % HEAD)[None, :]
        tl.store(v_out, y.to(dtype), mask=live[:, None])


@torch.library.custom_op("specpipe::rows_rope_store", mutates_args=("k_cache", "v_cache"))
def rows_rope_store(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, layer: int, heads: int) -> torch.Tensor:
    """gemv_rope_store for tokens x [M, K] at RoPE positions `positions` and cache slots `slots` [M]
    (_rows_rope_kernel) -> rotated q [M, H D]. The head size is a power of two of 16 at least."""
    kv_heads, head = k_cache.shape[-2], k_cache.shape[-1]
    assert w.shape[0] == (heads + 2 * kv_heads) * head
    x, w = x.contiguous(), w.contiguous()
    m = x.shape[0]
    q = x.new_empty(m, heads * head)
    block_m, block_n, block_k, warps, stages = _rows_tile(m, w, "rope")
    block_n = min(block_n, head)  # a program's row pairs lie in one head
    _rows_rope_kernel[(w.shape[0] // block_n, triton.cdiv(m, block_m))](
        x, w, norm.contiguous(), cos, sin, positions.contiguous(), slots.contiguous(), q, k_cache, v_cache,
        m, w.shape[1], eps, *_cache_offsets(k_cache, v_cache, cos, sin, layer), HEADS=heads, KV_HEADS=kv_heads,
        HEAD=head, PRECISION=_precision(x), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages)
    return q


@rows_rope_store.register_fake
def _(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
      positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
      heads: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], heads * k_cache.shape[-1])


@triton.jit
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, length_ptr, rows_ptr, m_ptr, l_ptr, o_ptr, num_slots, region,
                            sm_scale, stride_slot, stride_head, num_splits, span,
                            GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD: tl.constexpr,
                            CHUNK: tl.constexpr, REGION: tl.constexpr):
    _attention_split(q_ptr, k_ptr, v_ptr, length_ptr, rows_ptr, m_ptr, l_ptr, o_ptr, num_slots, region, sm_scale,
                     stride_slot, stride_head, num_splits, span, GROUP, GROUP_ROWS, HEAD, CHUNK, REGION)


@triton.jit
def _attention_split(q_ptr, k_ptr, v_ptr, length_ptr, rows_ptr, m_ptr, l_ptr, o_ptr, num_slots, region,
                     sm_scale, stride_slot, stride_head, num_splits, span,
                     GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD: tl.constexpr,
                     CHUNK: tl.constexpr, REGION: tl.constexpr):
    """Program (kv head, split): one token's query group of one kv head over one span of cache slots,
    CHUNK slots at a time with a running softmax: the span's max, sum and unnormalised output per query
    head (flash-decoding's first half).

    Visible: slots below the device length, and slot length + j where rows[0, j] (REGION), or the
    token's own slot, length itself (not REGION). Nothing past length + region is read, so a step
    costs the text's length, not the cache's. Products and sums are float32 on CUDA cores: a step's
    attention is a few MFLOP, and a group of a few query heads would mostly pad a tensor-core tile."""
    kv_head, split = tl.program_id(0), tl.program_id(1)
    group = tl.arange(0, GROUP_ROWS)
    dims = tl.arange(0, HEAD)
    heads = kv_head * GROUP + group
    live = group < GROUP
    q = tl.load(q_ptr + heads[:, None] * HEAD + dims[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    length = tl.load(length_ptr)
    start = split * span
    stop = tl.minimum(start + span, tl.minimum(length + region, num_slots))
    peak = tl.full((GROUP_ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_ROWS,), tl.float32)
    acc = tl.zeros((GROUP_ROWS, HEAD), tl.float32)
    for c0 in range(start, stop, CHUNK):
        slots = c0 + tl.arange(0, CHUNK)
        visible = slots < stop
        if REGION:
            rel = slots - length
            seen = tl.load(rows_ptr + rel, mask=visible & (rel >= 0), other=0)
            visible = visible & ((rel < 0) | (seen != 0))
        offsets = slots[:, None] * stride_slot + kv_head * stride_head + dims[None, :]
        keys = tl.load(k_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
        values = tl.load(v_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * sm_scale  # [GROUP_ROWS, CHUNK]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        top = tl.maximum(peak, tl.max(scores, axis=1))
        safe = top
        if REGION:  # a region row can hide a whole chunk (otherwise every chunk has a visible slot). The
            # peak stays -inf: a stand-in 0 stored as a hidden split's peak would, against scores all
            # below about -87, underflow every other split's merge weight to zero
            safe = tl.where(top == float("-inf"), 0.0, top)
        rescale = tl.exp(peak - safe)
        p = tl.exp(scores - safe[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * values[None, :, :], axis=1)
        peak = top
    rows = heads * num_splits + split
    tl.store(m_ptr + rows, peak, mask=live)
    tl.store(l_ptr + rows, total, mask=live)
    tl.store(o_ptr + rows[:, None] * HEAD + dims[None, :], acc, mask=live[:, None])


@triton.jit
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, length_ptr, rows_ptr, m_ptr, l_ptr, o_ptr, num_slots, region,
                           sm_scale, stride_slot, stride_head, num_splits, tokens, out_ptr, stride_token,
                           GROUP: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           FLOAT32: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr,
                           OWN_SLOT: tl.constexpr):
    """The split kernel for several tokens: one kv head's query rows (token, group member) in
    tiles of BLOCK_M against every num_splits-th block of BLOCK_N slots, both products on tensor
    cores (a 64-node tree of an 8B model has 256 query rows a kv head, which CUDA cores took ~100 us
    a layer for). Same visibility and partial outputs as _attention_split_kernel with REGION.
    DIRECT (one split): the normalised output goes straight to out_ptr, and no merge runs.
    OWN_SLOT: one token with no region rows (a decode step), seeing every slot up to its own at length.
    q's tokens lie stride_token apart (a view of the QKV rows, copied by nothing)."""
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = r // GROUP
    live = token < tokens
    head = kv_head * GROUP + r % GROUP
    query = token * tl.num_programs(1) * GROUP + head  # rows of the output [T * H, D]
    dims = tl.arange(0, HEAD)
    q = tl.load(q_ptr + (token * stride_token + head * HEAD)[:, None] + dims[None, :], mask=live[:, None], other=0.0)
    length = tl.load(length_ptr)
    bound = tl.minimum(length + region, num_slots)
    peak = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD), tl.float32)
    for block in range(split, (bound + BLOCK_N - 1) // BLOCK_N, num_splits):
        slots = block * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = slots < bound
        base = slots * stride_slot + kv_head * stride_head
        keys = tl.load(k_ptr + base[None, :] + dims[:, None], mask=inside[None, :], other=0.0)  # [HEAD, BLOCK_N]
        scores = tl.dot(q, keys, input_precision=PRECISION) * sm_scale
        if OWN_SLOT:
            scores = tl.where(inside[None, :], scores, float("-inf"))
        else:
            rel = slots - length
            seen = tl.load(rows_ptr + token[:, None] * region + rel[None, :],
                           mask=live[:, None] & (inside & (rel >= 0))[None, :], other=0)
            visible = ((rel < 0) & inside)[None, :] | (seen != 0)
            scores = tl.where(visible, scores, float("-inf"))
        top = tl.maximum(peak, tl.max(scores, axis=1))
        safe = tl.where(top == float("-inf"), 0.0, top)
        rescale = tl.exp(peak - safe)
        p = tl.exp(scores - safe[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        values = tl.load(v_ptr + base[:, None] + dims[None, :], mask=inside[:, None], other=0.0)  # [BLOCK_N, HEAD]
        if FLOAT32:
            acc = acc * rescale[:, None] + tl.dot(p, values, input_precision=PRECISION)
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(values.dtype), values)
        peak = top
    if DIRECT:
        out = acc / total[:, None]
        tl.store(out_ptr + query[:, None] * HEAD + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None])
    else:
        part = query * num_splits + split
        tl.store(m_ptr + part, peak, mask=live)
        tl.store(l_ptr + part, total, mask=live)
        tl.store(o_ptr + part[:, None] * HEAD + dims[None, :], acc, mask=live[:, None])


@triton.jit
def _attention_merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, num_splits,
                            HEAD: tl.constexpr, SPLIT_ROWS: tl.constexpr):
    """One query row (token, head): the splits' partial softmaxes rescaled to a common max and summed."""
    query = tl.program_id(0)
    splits = tl.arange(0, SPLIT_ROWS)
    dims = tl.arange(0, HEAD)
    live = splits < num_splits
    rows = query * num_splits + splits
    peak = tl.load(m_ptr + rows, mask=live, other=float("-inf"))
    top = tl.max(peak, axis=0)
    weight = tl.where(peak == float("-inf"), 0.0, tl.exp(peak - top))
    total = tl.sum(weight * tl.load(l_ptr + rows, mask=live, other=0.0), axis=0)
    parts = tl.load(o_ptr + rows[:, None] * HEAD + dims[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / total
    tl.store(out_ptr + query * HEAD + dims, out.to(out_ptr.dtype.element_ty))


@torch.library.custom_op("specpipe::slot_attention", mutates_args=())
def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor,
                   rows: torch.Tensor | None) -> torch.Tensor:
    """Tokens' heads q [T, H, D] over cache slots k, v [S, Hkv, D] (slot rows may be strided):
    softmax(q k^T / sqrt(D)) v in q's dtype, token t seeing slots below length[0] and slot
    length[0] + j where rows[t, j] (rows [T, R] bool). rows None: one token at slot length[0],
    seeing every slot up to its own."""
    tokens, heads, head = q.shape
    slots, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    assert rows is not None or tokens == 1, "several tokens need their rows of the region"
    region = 1 if rows is None else rows.shape[1]
    cuda_cores = tokens == 1 and not ONE_TOKEN_TILES
    if cuda_cores:  # one token's few query heads on CUDA cores; spans of whole chunks, at most MAX_SPLITS
        span = ATTENTION_CHUNK_SLOTS * triton.cdiv(triton.cdiv(slots, ATTENTION_CHUNK_SLOTS), ATTENTION_MAX_SPLITS)
        splits = triton.cdiv(slots, span)
    else:  # query rows in tensor-core tiles of 16 rows at least; blocks dealt round-robin to the splits
        block_m = max(TREE_MIN_ROWS, min(TREE_BLOCK_ROWS, triton.next_power_of_2(tokens * group)))
        tiles = triton.cdiv(tokens * group, block_m)
        blocks = triton.cdiv(slots, TREE_BLOCK_SLOTS)
        splits = min(triton.cdiv(blocks, TREE_MIN_BLOCKS_PER_SPLIT), max(1, ATTENTION_PROGRAMS // (tiles * kv_heads)))
        splits = min(ATTENTION_MAX_SPLITS, max(splits, triton.cdiv(blocks, TREE_MAX_BLOCKS_PER_SPLIT)))
    direct = not cuda_cores and splits == 1
    m = torch.empty(0 if direct else tokens * heads * splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    o = torch.empty(m.shape[0], head, dtype=torch.float32, device=q.device)
    out = q.new_empty(q.shape)  # contiguous whatever q's strides: the kernels write rows of [T * H, D]
    if q.stride(2) != 1 or q.stride(1) != head:  # heads side by side; tokens may lie at any stride
        q = q.contiguous()
    args = (q, k, v, length, k if rows is None else rows.contiguous().view(torch.uint8), m, l, o, slots,
            region, head ** -0.5, k.stride(0), k.stride(1), splits)
    if cuda_cores:
        _attention_split_kernel[(kv_heads, splits)](
            *args, span, GROUP=group, GROUP_ROWS=triton.next_power_of_2(group), HEAD=head,
            CHUNK=ATTENTION_CHUNK_SLOTS, REGION=rows is not None)
    else:
        _tree_attention_kernel[(tiles, kv_heads, splits)](
            *args, tokens, out, q.stride(0), GROUP=group, HEAD=head, BLOCK_M=block_m, BLOCK_N=TREE_BLOCK_SLOTS,
            FLOAT32=q.dtype == torch.float32, PRECISION=FLOAT32_DOT if q.dtype == torch.float32 else "tf32",
            DIRECT=direct, OWN_SLOT=rows is None)
    if not direct:
        _attention_merge_kernel[(tokens * heads,)](m, l, o, out, splits, HEAD=head,
                                                   SPLIT_ROWS=max(2, triton.next_power_of_2(splits)))
    return out


@slot_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor,
      rows: torch.Tensor | None) -> torch.Tensor:
    return q.new_empty(q.shape)


@triton.jit
def _lm_head_topk_kernel(h_ptr, w_ptr, val_ptr, idx_ptr, max_ptr, sum_ptr, rows, vocab, hidden,
                         ROWS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, K: tl.constexpr):
    """One vocabulary tile for every row: logits in float32, then the tile's k best (value, token), its
    maximum and its sum of exp(logit - maximum), at [row, tile] of the outputs."""
    tile = tl.program_id(0)
    tiles = tl.num_programs(0)
    r = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_V)
    v = tile * BLOCK_V + cols
    acc = tl.zeros((ROWS, BLOCK_V), tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(h_ptr + r[:, None] * hidden + c[None, :], mask=(r[:, None] < rows) & (c[None, :] < hidden),
                    other=0.0)
        w = tl.load(w_ptr + v[:, None] * hidden + c[None, :], mask=(v[:, None] < vocab) & (c[None, :] < hidden),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    acc = tl.where(v[None, :] < vocab, acc, float("-inf"))
    live = r < rows
    out = r * tiles + tile
    top = tl.max(acc, axis=1)
    tl.store(max_ptr + out, top, mask=live)
    tl.store(sum_ptr + out, tl.sum(tl.exp(acc - top[:, None]), axis=1), mask=live)
    for j in tl.static_range(K):  # k rounds of max-and-remove: k is small, the tile is in registers
        best = tl.max(acc, axis=1)
        at = tl.argmax(acc, axis=1)
        tl.store(val_ptr + out * K + j, best, mask=live)
        tl.store(idx_ptr + out * K + j, tile * BLOCK_V + at, mask=live)
        acc = tl.where(cols[None, :] == at[:, None], float("-inf"), acc)


def tiled_topk(h: torch.Tensor, weight: torch.Tensor, k: int, block_v: int = DRAFT_TOPK_TILE,
               warps: int = DRAFT_TOPK_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """lm_head_topk with a chosen tile and warp count (build/probe_draft_topk.py compares them)."""
    rows, hidden = h.shape
    assert rows <= DRAFT_TOPK_MAX_ROWS, "one tl.dot tile of rows"
    h, weight = h.contiguous(), weight.contiguous()
    vocab = weight.shape[0]
    tiles = triton.cdiv(vocab, block_v)
    val = torch.empty(rows, tiles * k, dtype=torch.float32, device=h.device)
    idx = torch.empty(rows, tiles * k, dtype=torch.int32, device=h.device)
    tile_max = torch.empty(rows, tiles, dtype=torch.float32, device=h.device)
    tile_sum = torch.empty_like(tile_max)
    _lm_head_topk_kernel[(tiles,)](h, weight, val, idx, tile_max, tile_sum, rows, vocab, hidden,
                                   ROWS=DRAFT_TOPK_MAX_ROWS, BLOCK_V=block_v, BLOCK_H=DRAFT_TOPK_BLOCK_H, K=k,
                                   num_warps=warps)
    logp = torch.empty(rows, k, dtype=torch.float32, device=h.device)
    tokens = torch.empty(rows, k, dtype=torch.long, device=h.device)
    _topk_merge_kernel[(rows,)](val, idx, tile_max, tile_sum, logp, tokens, tiles, K=k,
                                N=triton.next_power_of_2(tiles * k), TILES=triton.next_power_of_2(tiles))
    return logp, tokens


_REMOVED = tl.constexpr(-0x7FFFFFFFFFFFFFFF)  # below every _descending_keys key


@triton.jit
def _descending_keys(x, i, N: tl.constexpr):
    """int64 keys that sort float32 x descending by value, then ascending by position i (< N): the
    value's bits mapped to a signed integer of the same order, above the reversed position."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: the magnitude bits reversed
    return (ordered.to(tl.int64) << 32) | (N - 1 - i).to(tl.int64)


@triton.jit
def _decode_keys(keys, N: tl.constexpr):
    """(float32 values, positions) of _descending_keys."""
    ordered = (keys >> 32).to(tl.int32)
    values = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return values, N - 1 - (keys & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _topk_merge_kernel(val_ptr, idx_ptr, max_ptr, sum_ptr, logp_ptr, token_ptr, tiles,
                       K: tl.constexpr, N: tl.constexpr, TILES: tl.constexpr):
    """One row of _lm_head_topk_kernel's output: the log-softmax normaliser from the tiles' maxima and
    sums, and the k best of the tiles' tiles * k candidates, as log-probabilities and tokens. k rounds of
    max-and-remove over the candidates' keys, 4.7 us for SmolLM2's 8 rows (H200, session s), where a
    bitonic sort of the 2,048 took 37 us."""
    row = tl.program_id(0)
    t = tl.arange(0, TILES)
    tile_max = tl.load(max_ptr + row * tiles + t, mask=t < tiles, other=float("-inf"))
    tile_sum = tl.load(sum_ptr + row * tiles + t, mask=t < tiles, other=0.0)
    top = tl.max(tile_max, axis=0)
    log_norm = top + tl.log(tl.sum(tile_sum * tl.exp(tile_max - top), axis=0))
    i = tl.arange(0, N)
    candidates = tl.load(val_ptr + row * tiles * K + i, mask=i < tiles * K, other=float("-inf"))
    keys = _descending_keys(candidates, i, N)
    for j in tl.static_range(K):
        best = tl.max(keys, axis=0)
        value, pos = _decode_keys(best, N)
        tl.store(logp_ptr + row * K + j, value - log_norm)
        tl.store(token_ptr + row * K + j, tl.load(idx_ptr + row * tiles * K + pos).to(tl.int64))
        keys = tl.where(keys == best, _REMOVED, keys)


@triton.jit
def _row_topk_kernel(x_ptr, val_ptr, idx_ptr, n, K: tl.constexpr, N: tl.constexpr):
    """One row's k largest values and their positions, best first, through one sort in registers."""
    row = tl.program_id(0)
    i = tl.arange(0, N)
    x = tl.load(x_ptr + row * n + i, mask=i < n, other=float("-inf")).to(tl.float32)
    best, pos = _decode_keys(tl.sort(_descending_keys(x, i, N), descending=True), N)
    keep = i < K
    tl.store(val_ptr + row * K + i, best.to(val_ptr.dtype.element_ty), mask=keep)
    tl.store(idx_ptr + row * K + i, pos.to(tl.int64), mask=keep)


@torch.library.custom_op("specpipe::row_topk", mutates_args=())
def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) along x's last dimension (at most ROW_TOPK_MAX values) in one kernel, one program a
    row: (values in x's dtype, int64 positions), best first, equal values by position. torch.topk's
    radix select took 6.7-13.9 us a call for an EAGLE step's few hundred candidates (H200, session r)."""
    n = x.shape[-1]
    assert 0 < k <= n <= ROW_TOPK_MAX, f"row_topk: rows of at most {ROW_TOPK_MAX} values, 0 < k <= their length"
    x = x.contiguous()
    values = x.new_empty(*x.shape[:-1], k)
    positions = torch.empty(values.shape, dtype=torch.long, device=x.device)
    _row_topk_kernel[(x.numel() // n,)](x, values, positions, n, K=k, N=triton.next_power_of_2(n))
    return values, positions


@row_topk.register_fake
def _(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.long)


@torch.library.custom_op("specpipe::lm_head_topk", mutates_args=())
def lm_head_topk(h: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities float32, tokens) of the k most likely tokens of each row of h [rows, H] @ weight.T,
    [rows, k] each, best first: log_softmax(F.linear(h, weight).float()).topk(k) without the logits."""
    return tiled_topk(h, weight, k)


@lm_head_topk.register_fake
def _(h: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (h.new_empty(h.shape[0], k, dtype=torch.float32), h.new_empty(h.shape[0], k, dtype=torch.long))
