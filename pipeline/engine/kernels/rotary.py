"""Rotary embedding and the cache write of one token's QKV row (rope_store), and the Triton helpers the
GEMV and rows kernels reuse to do the same in their epilogues (_rotary, _rope_rows, _cache_offsets).

Every rounding the unfused rotary does in the model's half dtype is repeated at the same point.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary(x, rotated, cos_ptr, sin_ptr, offsets, dtype):
    """x cos + rotated sin (rotate-half RoPE) with the unfused rotary's roundings: the float32 tables
    and both products in dtype."""
    cos = tl.load(cos_ptr + offsets).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + offsets).to(dtype).to(tl.float32)
    return (x * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    layer_offset,
    stride_slot,
    stride_head,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
):
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
            tl.store(
                v_ptr + layer_offset + slot * stride_slot + (head - HEADS - KV_HEADS) * stride_head + dims, x.to(dtype)
            )


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


def _cache_offsets(
    k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int
) -> tuple[int, int, int]:
    """(layer offset, slot stride, head stride) of the caches [layers, rows, slots, Hkv, D] for the rotary kernels."""
    assert k_cache.stride() == v_cache.stride() and cos.is_contiguous() and sin.is_contiguous()
    return layer * k_cache.stride(0), k_cache.stride(2), k_cache.stride(3)


@torch.library.custom_op("specpipe::rope_store", mutates_args=("k_cache", "v_cache"))
def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position: torch.Tensor,
    slot: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    heads: int,
) -> torch.Tensor:
    """One token's qkv [(H + 2 Hkv) D] -> rotated q [H D]; rotated k and v land in batch row 0 of
    k_cache, v_cache [layers, rows, slots, Hkv, D] at layer `layer`, slot slot[0], RoPE position position[0]."""
    kv_heads, head = k_cache.shape[-2], k_cache.shape[-1]
    q = qkv.new_empty(heads * head)
    _rope_store_kernel[(heads + 2 * kv_heads,)](
        qkv.contiguous(),
        cos,
        sin,
        position,
        slot,
        q,
        k_cache,
        v_cache,
        *_cache_offsets(k_cache, v_cache, cos, sin, layer),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD=head,
    )
    return q


@rope_store.register_fake
def _(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position: torch.Tensor,
    slot: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    heads: int,
) -> torch.Tensor:
    return qkv.new_empty(heads * k_cache.shape[-1])
