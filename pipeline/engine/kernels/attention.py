"""Slot attention: the attention of one or several tokens over the cache slots in use, as a torch custom op.

A split kernel gives each program a share of the slots (one token's query group on CUDA cores, or tiles of
several tokens' query rows on tensor cores), each writing a partial softmax; a small merge kernel then
combines the splits (merging inside the split kernel, by the last split to finish, was slower: more
registers a program and a serial merge at the end). Tokens see the text below the device length and the
slots of their own region that the tree mask allows, so a step costs the text's length, not the cache's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning


@triton.jit
def _attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    length_ptr,
    rows_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    num_slots,
    region,
    sm_scale,
    stride_slot,
    stride_head,
    num_splits,
    span,
    GROUP: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    HEAD: tl.constexpr,
    CHUNK: tl.constexpr,
    REGION: tl.constexpr,
):
    _attention_split(
        q_ptr,
        k_ptr,
        v_ptr,
        length_ptr,
        rows_ptr,
        m_ptr,
        l_ptr,
        o_ptr,
        num_slots,
        region,
        sm_scale,
        stride_slot,
        stride_head,
        num_splits,
        span,
        GROUP,
        GROUP_ROWS,
        HEAD,
        CHUNK,
        REGION,
    )


@triton.jit
def _attention_split(
    q_ptr,
    k_ptr,
    v_ptr,
    length_ptr,
    rows_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    num_slots,
    region,
    sm_scale,
    stride_slot,
    stride_head,
    num_splits,
    span,
    GROUP: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    HEAD: tl.constexpr,
    CHUNK: tl.constexpr,
    REGION: tl.constexpr,
):
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
def _tree_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    length_ptr,
    rows_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    num_slots,
    region,
    sm_scale,
    stride_slot,
    stride_head,
    num_splits,
    tokens,
    out_ptr,
    stride_token,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FLOAT32: tl.constexpr,
    PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
    OWN_SLOT: tl.constexpr,
):
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
            seen = tl.load(
                rows_ptr + token[:, None] * region + rel[None, :],
                mask=live[:, None] & (inside & (rel >= 0))[None, :],
                other=0,
            )
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
def _attention_merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, num_splits, HEAD: tl.constexpr, SPLIT_ROWS: tl.constexpr):
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
def _slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    length: torch.Tensor,
    rows: torch.Tensor | None,
    one_token_tiles: bool,
    chunk_slots: int,
    max_splits: int,
    programs: int,
    block_rows: int,
    block_slots: int,
    min_rows: int,
    min_blocks_per_split: int,
    max_blocks_per_split: int,
    float32_dot: str,
) -> torch.Tensor:
    tokens, heads, head = q.shape
    slots, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    assert rows is not None or tokens == 1, "several tokens need their rows of the region"
    region = 1 if rows is None else rows.shape[1]
    cuda_cores = tokens == 1 and not one_token_tiles
    if cuda_cores:  # one token's few query heads on CUDA cores; spans of whole chunks, at most max_splits
        span = chunk_slots * triton.cdiv(triton.cdiv(slots, chunk_slots), max_splits)
        splits = triton.cdiv(slots, span)
    else:  # query rows in tensor-core tiles of 16 rows at least; blocks dealt round-robin to the splits
        block_m = max(min_rows, min(block_rows, triton.next_power_of_2(tokens * group)))
        tiles = triton.cdiv(tokens * group, block_m)
        blocks = triton.cdiv(slots, block_slots)
        splits = min(triton.cdiv(blocks, min_blocks_per_split), max(1, programs // (tiles * kv_heads)))
        splits = min(max_splits, max(splits, triton.cdiv(blocks, max_blocks_per_split)))
    direct = not cuda_cores and splits == 1
    m = torch.empty(0 if direct else tokens * heads * splits, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(m)
    o = torch.empty(m.shape[0], head, dtype=torch.float32, device=q.device)
    out = q.new_empty(q.shape)  # contiguous whatever q's strides: the kernels write rows of [T * H, D]
    if q.stride(2) != 1 or q.stride(1) != head:  # heads side by side; tokens may lie at any stride
        q = q.contiguous()
    args = (
        q,
        k,
        v,
        length,
        k if rows is None else rows.contiguous().view(torch.uint8),
        m,
        sums,
        o,
        slots,
        region,
        head**-0.5,
        k.stride(0),
        k.stride(1),
        splits,
    )
    if cuda_cores:
        _attention_split_kernel[(kv_heads, splits)](
            *args,
            span,
            GROUP=group,
            GROUP_ROWS=triton.next_power_of_2(group),
            HEAD=head,
            CHUNK=chunk_slots,
            REGION=rows is not None,
        )
    else:
        _tree_attention_kernel[(tiles, kv_heads, splits)](
            *args,
            tokens,
            out,
            q.stride(0),
            GROUP=group,
            HEAD=head,
            BLOCK_M=block_m,
            BLOCK_N=block_slots,
            FLOAT32=q.dtype == torch.float32,
            PRECISION=float32_dot if q.dtype == torch.float32 else "tf32",
            DIRECT=direct,
            OWN_SLOT=rows is None,
        )
    if not direct:
        _attention_merge_kernel[(tokens * heads,)](
            m, sums, o, out, splits, HEAD=head, SPLIT_ROWS=max(2, triton.next_power_of_2(splits))
        )
    return out


@_slot_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    length: torch.Tensor,
    rows: torch.Tensor | None,
    one_token_tiles: bool,
    chunk_slots: int,
    max_splits: int,
    programs: int,
    block_rows: int,
    block_slots: int,
    min_rows: int,
    min_blocks_per_split: int,
    max_blocks_per_split: int,
    float32_dot: str,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    length: torch.Tensor,
    rows: torch.Tensor | None,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> torch.Tensor:
    """Tokens' heads q [T, H, D] over cache slots k, v [S, Hkv, D] (slot rows may be strided):
    softmax(q k^T / sqrt(D)) v in q's dtype, token t seeing slots below length[0] and slot
    length[0] + j where rows[t, j] (rows [T, R] bool). rows None: one token at slot length[0],
    seeing every slot up to its own. The splits and tiles follow `tuning` (see KernelTuning)."""
    t = tuning
    return _slot_attention(
        q,
        k,
        v,
        length,
        rows,
        t.one_token_tiles,
        t.attention_chunk_slots,
        t.attention_max_splits,
        t.attention_programs,
        t.tree_block_rows,
        t.tree_block_slots,
        t.tree_min_rows,
        t.tree_min_blocks_per_split,
        t.tree_max_blocks_per_split,
        t.float32_dot,
    )
