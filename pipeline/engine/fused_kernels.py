"""The Triton kernels behind fused.py, as torch custom ops so torch.compile keeps each whole in a graph.

Every rounding the unfused layer does in the model's half dtype (the norm's output, the projection
before its residual add, the residual sum) is repeated here at the same point, so a fused step
computes what the unfused one computes up to the order of float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.engine.fused import ATTENTION_BLOCK_SLOTS, BLOCK_K, BLOCK_ROWS, DOT_MIN_ROWS, NUM_WARPS


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, norm_ptr, res_ptr, n, k, eps,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = W[n, k] x, each program summing BLOCK_ROWS whole rows in float32.

    NORM: x is first RMS-normalised and scaled by norm_ptr (every program recomputes the scale from
    the whole of x: k values from L2, against BLOCK_ROWS * k weights from memory).
    RESIDUAL: y += res.
    """
    dtype = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    scale = 1.0
    if NORM:
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
            squares += xs * xs
        scale = tl.rsqrt(tl.sum(squares, axis=0) / k + eps)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        inside = cols < k
        x = tl.load(x_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if NORM:
            g = tl.load(norm_ptr + cols, mask=inside, other=0.0).to(tl.float32)
            x = (g * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        wmask = (rows[:, None] < n) & inside[None, :]
        w = tl.load(w_ptr + rows[:, None] * k + cols[None, :], mask=wmask, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if RESIDUAL:
        y = y.to(dtype).to(tl.float32) + tl.load(res_ptr + rows, mask=rows < n, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(dtype), mask=rows < n)


@torch.library.custom_op("specpipe::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [K] times w [N, K] (row-major) -> [N] in x's dtype, see _gemv_kernel."""
    x, w = x.contiguous(), w.contiguous()
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, BLOCK_ROWS),)](
        w, x, y, x if norm is None else norm.contiguous(), x if residual is None else residual.contiguous(),
        n, k, eps, NORM=norm is not None, RESIDUAL=residual is not None, BLOCK_ROWS=BLOCK_ROWS, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return y


@gemv.register_fake
def _(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
      residual: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(w.shape[0])


@triton.jit
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, limit_ptr, m_ptr, l_ptr, o_ptr, num_slots, sm_scale,
                            stride_slot, stride_head, num_splits,
                            GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD: tl.constexpr,
                            BLOCK_SLOTS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """One kv head's query group over one block of cache slots: the block's softmax max, sum and
    unnormalised output per query head (flash-decoding's first half). Slots at or past the limit
    are masked, so their loads never touch memory: a step costs the text's length, not the cache's."""
    kv_head, split = tl.program_id(0), tl.program_id(1)
    group = tl.arange(0, GROUP_ROWS)
    dims = tl.arange(0, HEAD)
    heads = kv_head * GROUP + group
    q = tl.load(q_ptr + heads[:, None] * HEAD + dims[None, :], mask=(group < GROUP)[:, None], other=0.0).to(tl.float32)
    slots = split * BLOCK_SLOTS + tl.arange(0, BLOCK_SLOTS)
    bound = num_slots
    if HAS_LIMIT:
        bound = tl.minimum(tl.load(limit_ptr), num_slots)
    visible = slots < bound
    offsets = slots[:, None] * stride_slot + kv_head * stride_head + dims[None, :]
    keys = tl.load(k_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
    # float32 products on CUDA cores: a decode step's attention is a few MFLOP, and the weights
    # stay exact (Triton's interpreter, which the tests use, also mis-multiplies bf16 dots).
    scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * sm_scale  # [GROUP_ROWS, BLOCK_SLOTS]
    scores = tl.where(visible[None, :], scores, float("-inf"))
    peak = tl.max(scores, axis=1)
    safe_peak = tl.where(peak == float("-inf"), 0.0, peak)  # a block past the text: zero weight, no NaN
    p = tl.exp(scores - safe_peak[:, None])
    values = tl.load(v_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
    out = tl.dot(p, values, input_precision="ieee")  # [GROUP_ROWS, HEAD]
    rows = heads * num_splits + split
    live = group < GROUP
    tl.store(m_ptr + rows, peak, mask=live)
    tl.store(l_ptr + rows, tl.sum(p, axis=1), mask=live)
    tl.store(o_ptr + rows[:, None] * HEAD + dims[None, :], out, mask=live[:, None])


@triton.jit
def _attention_merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, num_splits,
                            HEAD: tl.constexpr, SPLIT_ROWS: tl.constexpr):
    """One query head: the blocks' partial softmaxes rescaled to a common max and summed."""
    head = tl.program_id(0)
    splits = tl.arange(0, SPLIT_ROWS)
    dims = tl.arange(0, HEAD)
    live = splits < num_splits
    rows = head * num_splits + splits
    peak = tl.load(m_ptr + rows, mask=live, other=float("-inf"))
    top = tl.max(peak, axis=0)
    weight = tl.where(peak == float("-inf"), 0.0, tl.exp(peak - top))
    total = tl.sum(weight * tl.load(l_ptr + rows, mask=live, other=0.0), axis=0)
    parts = tl.load(o_ptr + rows[:, None] * HEAD + dims[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / total
    tl.store(out_ptr + head * HEAD + dims, out.to(out_ptr.dtype.element_ty))


@torch.library.custom_op("specpipe::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor | None) -> torch.Tensor:
    """One token's heads q [H, D] over cache slots k, v [S, Hkv, D] (slot rows may be strided):
    softmax(q k^T / sqrt(D)) v over slots [0, min(limit, S)) -> [H, D] in q's dtype."""
    heads, head = q.shape
    slots, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    splits = triton.cdiv(slots, ATTENTION_BLOCK_SLOTS)
    m = torch.empty(heads * splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    o = torch.empty(heads * splits, head, dtype=torch.float32, device=q.device)
    _attention_split_kernel[(kv_heads, splits)](
        q.contiguous(), k, v, k if limit is None else limit, m, l, o, slots, head ** -0.5,
        k.stride(0), k.stride(1), splits, GROUP=group, GROUP_ROWS=max(DOT_MIN_ROWS, triton.next_power_of_2(group)),
        HEAD=head, BLOCK_SLOTS=ATTENTION_BLOCK_SLOTS, HAS_LIMIT=limit is not None)
    out = torch.empty_like(q)
    _attention_merge_kernel[(heads,)](m, l, o, out, splits, HEAD=head,
                                      SPLIT_ROWS=max(2, triton.next_power_of_2(splits)))
    return out


@decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor | None) -> torch.Tensor:
    return torch.empty_like(q)
