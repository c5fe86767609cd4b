"""Decode attention over the paged KV cache: one new token per row, rows of different lengths, one launch.

Program (row, kv head, split) walks the row's block table, taking every `splits`-th block below the
row's length, and keeps an online softmax for the kv head's query group; a few torch ops merge the
splits. The split count depends only on the table's width, never on the batch: a row's sums run in
the same order alone or among 64 rows (bitwise the same output). Splits give a short batch enough
programs to fill the GPU. Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Splits per (row, kv head): enough programs for one row of a few kv heads to spread over the GPU.
MAX_SPLITS = 16


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    len_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    scale,
    table_stride,
    splits,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    members = tl.arange(0, GROUP)
    live_members = members < HEADS // KV_HEADS
    heads = kv_head * (HEADS // KV_HEADS) + members
    dims = tl.arange(0, HEAD)
    q = tl.load(q_ptr + (row * HEADS + heads[:, None]) * HEAD + dims[None, :], mask=live_members[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    length = tl.load(len_ptr + row)
    offsets = tl.arange(0, BLOCK)
    m = tl.full((GROUP,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP,), tl.float32)
    acc = tl.zeros((GROUP, HEAD), tl.float32)
    for b in range(split, tl.cdiv(length, BLOCK), splits):
        block = tl.load(table_ptr + row * table_stride + b).to(tl.int64)
        slots = block * BLOCK + offsets
        live = b * BLOCK + offsets < length
        where = (slots[:, None] * KV_HEADS + kv_head) * HEAD + dims[None, :]
        k = tl.load(k_ptr + where, mask=live[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + where, mask=live[:, None], other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = (row * HEADS + heads) * splits + split
    tl.store(m_ptr + out, m, mask=live_members)
    tl.store(l_ptr + out, total, mask=live_members)
    tl.store(o_ptr + out[:, None] * HEAD + dims[None, :], acc, mask=live_members[:, None])


def num_splits(max_blocks: int) -> int:
    return max(1, min(MAX_SPLITS, max_blocks))


@torch.library.custom_op("specpipe::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, block_size: int
) -> torch.Tensor:
    """q [B, H, D] (one token a row) over the pool's k, v [slots, Hkv, D] through block tables
    table [B, blocks] -> softmax(q k^T / sqrt(D)) v [B, H, D] in q's dtype; row b reads its first
    lengths[b] tokens (its own new token included: written before the call)."""
    rows, heads, head = q.shape
    kv_heads = k.shape[1]
    splits = num_splits(table.shape[1])
    m = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(m)
    o = torch.empty(rows, heads, splits, head, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(rows, kv_heads, splits)](
        q.contiguous(),
        k,
        v,
        table,
        lengths,
        m,
        sums,
        o,
        head**-0.5,
        table.stride(0),
        splits,
        HEADS=heads,
        KV_HEADS=kv_heads,
        GROUP=triton.next_power_of_2(heads // kv_heads),
        HEAD=head,
        BLOCK=block_size,
    )
    # Splits that saw no block hold m = -inf and l = 0: their weight below is 0.
    best = m.max(-1, keepdim=True).values
    weight = torch.exp(m - best)
    total = (sums * weight).sum(-1)
    return ((o * weight[..., None]).sum(-2) / total[..., None]).to(q.dtype)


@paged_decode_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, block_size: int
) -> torch.Tensor:
    return q.new_empty(q.shape)
