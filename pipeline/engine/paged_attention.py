"""Attention over the paged KV cache: many query tokens, rows of different lengths, one launch.

Each query reads a *virtual sequence*: the first `prefix` tokens of its row's sequence, then `count`
more tokens taken from anywhere in the row (`region`, sequence indices). A decode token's region is
itself; a tree node's region is its path from the root (the ancestors' slots past the prefix), so a
node reads exactly what the same token would read once the accepted path is compacted, in the same
order. Program (query, kv head, split) walks the virtual sequence in blocks, taking every `splits`-th
one, with an online softmax for the kv head's query group; a second kernel merges the splits. The split
count depends only on the table's width, never on the batch or the tree: a query's sums run in the same
order alone, in a batch of 64, or as a tree node (bitwise the same output). Runs on CUDA, and on CPU
tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Splits per (query, kv head): enough programs for one row of a few kv heads to spread over the GPU.
MAX_SPLITS = 16


@triton.jit
def _paged_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    prefix_ptr,
    region_ptr,
    count_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    scale,
    table_stride,
    queries_per_row,
    region_width,
    splits,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    query, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = query // queries_per_row
    members = tl.arange(0, GROUP)
    live_members = members < HEADS // KV_HEADS
    heads = kv_head * (HEADS // KV_HEADS) + members
    dims = tl.arange(0, HEAD)
    q = tl.load(q_ptr + (query * HEADS + heads[:, None]) * HEAD + dims[None, :], mask=live_members[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    prefix = tl.load(prefix_ptr + query)
    length = prefix + tl.load(count_ptr + query)
    offsets = tl.arange(0, BLOCK)
    m = tl.full((GROUP,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP,), tl.float32)
    acc = tl.zeros((GROUP, HEAD), tl.float32)
    for b in range(split, tl.cdiv(length, BLOCK), splits):
        virtual = b * BLOCK + offsets
        live = virtual < length
        past = live & (virtual >= prefix)
        moved = tl.load(region_ptr + query * region_width + (virtual - prefix), mask=past, other=0)
        position = tl.where(past, moved, virtual)
        block = tl.load(table_ptr + row * table_stride + position // BLOCK, mask=live, other=0).to(tl.int64)
        slots = block * BLOCK + position % BLOCK
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
    out = (query * HEADS + heads) * splits + split
    tl.store(m_ptr + out, m, mask=live_members)
    tl.store(l_ptr + out, total, mask=live_members)
    tl.store(o_ptr + out[:, None] * HEAD + dims[None, :], acc, mask=live_members[:, None])


@triton.jit
def _merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, splits, SPLITS: tl.constexpr, HEAD: tl.constexpr):
    """Program (query, head): its splits' partial softmaxes into the output, in split order. A split that
    saw no block holds m = -inf and l = 0: its weight is 0."""
    pair = tl.program_id(0)
    index = tl.arange(0, SPLITS)
    used = index < splits
    dims = tl.arange(0, HEAD)
    m = tl.load(m_ptr + pair * splits + index, mask=used, other=float("-inf"))
    total = tl.load(l_ptr + pair * splits + index, mask=used, other=0.0)
    o = tl.load(o_ptr + (pair * splits + index[:, None]) * HEAD + dims[None, :], mask=used[:, None], other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))
    out = tl.sum(o * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    tl.store(out_ptr + pair * HEAD + dims, out.to(out_ptr.dtype.element_ty))


def num_splits(max_blocks: int) -> int:
    return max(1, min(MAX_SPLITS, max_blocks))


@torch.library.custom_op("specpipe::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    prefix: torch.Tensor,
    region: torch.Tensor,
    count: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """q [B, T, H, D] (T queries a row) over the pool's k, v [slots, Hkv, D] through block tables
    table [B, blocks] -> softmax(q k^T / sqrt(D)) v [B, T, H, D] in q's dtype. Query (b, t) reads its
    row's sequence indices 0 .. prefix[b, t] - 1, then region[b, t, :count[b, t]] (written before the call)."""
    rows, per_row, heads, head = q.shape
    kv_heads = k.shape[1]
    queries = rows * per_row
    splits = num_splits(table.shape[1])
    m = torch.empty(queries, heads, splits, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(m)
    o = torch.empty(queries, heads, splits, head, dtype=torch.float32, device=q.device)
    _paged_kernel[(queries, kv_heads, splits)](
        q.contiguous(),
        k,
        v,
        table,
        prefix.contiguous(),
        region.contiguous(),
        count.contiguous(),
        m,
        sums,
        o,
        head**-0.5,
        table.stride(0),
        per_row,
        region.shape[-1],
        splits,
        HEADS=heads,
        KV_HEADS=kv_heads,
        GROUP=triton.next_power_of_2(heads // kv_heads),
        HEAD=head,
        BLOCK=block_size,
    )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _merge_kernel[(queries * heads,)](m, sums, o, out, splits, SPLITS=triton.next_power_of_2(splits), HEAD=head)
    return out


@paged_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    prefix: torch.Tensor,
    region: torch.Tensor,
    count: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def paged_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, block_size: int
) -> torch.Tensor:
    """One token a row: q [B, H, D]; row b reads its first lengths[b] tokens (its new one last)."""
    last = (lengths - 1)[:, None]
    out = paged_attention(q[:, None], k, v, table, last, last[:, :, None], torch.ones_like(last), block_size)
    return out[:, 0]
