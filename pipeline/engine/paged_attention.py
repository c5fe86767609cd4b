"""Attention over the paged KV cache: many query tokens, rows of different lengths, one launch.

Each query reads a *virtual sequence*: the first `prefix` tokens of its row's sequence, then `count`
more tokens taken from anywhere in the row (`region`, sequence indices). A decode token's region is
itself; a tree node's region is its path from the root (the ancestors' slots past the prefix), so a
node reads exactly what the same token would read once the accepted path is compacted, in the same
order.

Program (tile, kv head, split) takes a tile of one row's queries: TILE_ROWS query rows (query, group
member), as many queries as fit, and walks their virtual sequences in chunks of CHUNK, taking every
`splits`-th chunk, with an online softmax; a second kernel merges the splits. Both products run on
tensor cores with the tile's shape fixed by the group size alone, and a row's result never depends on
the other rows of its tile: a chunk every query of the tile reads from its prefix is loaded once and
multiplied with the whole tile; a chunk reaching into the queries' regions is loaded and multiplied per
query, the other rows' results dropped. The split count depends only on the table's width. So a query's
sums run in the same order alone, in a batch of 64, or as one of a tree's nodes (bitwise the same output),
and a 64-node tree reads its row's text 13 times (3 query heads a kv head), not 64. Runs on CUDA, and on
CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Splits per (tile, kv head): enough programs for one row of a few kv heads to spread over the GPU.
MAX_SPLITS = 16
# Virtual sequence positions a program reads at a time (the score tile's width).
CHUNK = 32
# Query rows a tile, at least: the smallest tensor-core product's side.
MIN_TILE_ROWS = 16


@triton.jit
def _product(a, b, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """a [M, K] @ b [K, N] in float32 on tensor cores; under the interpreter, whose tl.dot multiplies bf16
    tiles as raw integers and sums float32 rows in an order that depends on the tile, float32 products
    summed over K."""
    if INTERPRETED:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _cache_offsets(
    table_ptr,
    row,
    position,
    live,
    kv_head,
    table_stride,
    KV_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Offsets [CHUNK, HEAD] into the pool's k or v of a row's sequence positions, for one kv head."""
    block = tl.load(table_ptr + row * table_stride + position // BLOCK, mask=live, other=0).to(tl.int64)
    slots = block * BLOCK + position % BLOCK
    return (slots[:, None] * KV_HEADS + kv_head) * HEAD + tl.arange(0, HEAD)[None, :]


@triton.jit
def _query_chunk(
    k_ptr,
    table_ptr,
    region_ptr,
    prefix_ptr,
    count_ptr,
    row,
    query,
    virtual,
    kv_head,
    table_stride,
    region_width,
    KV_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One query's chunk of its virtual sequence: its keys (or values: k_ptr is either) [CHUNK, HEAD],
    zero where the query reads nothing."""
    prefix = tl.load(prefix_ptr + query)
    live = virtual < prefix + tl.load(count_ptr + query)
    past = live & (virtual >= prefix)
    moved = tl.load(region_ptr + query * region_width + (virtual - prefix), mask=past, other=0)
    position = tl.where(past, moved, virtual)
    where = _cache_offsets(table_ptr, row, position, live, kv_head, table_stride, KV_HEADS, HEAD, BLOCK)
    return tl.load(k_ptr + where, mask=live[:, None], other=0.0)


@triton.jit
def _chunk_product(
    lhs,
    ptr,
    KEYS: tl.constexpr,
    shared,
    table_ptr,
    region_ptr,
    prefix_ptr,
    count_ptr,
    row,
    first,
    member,
    queries,
    virtual,
    kv_head,
    table_stride,
    region_width,
    KV_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """A tile's product with one chunk of the cache at ptr: lhs @ chunk^T (KEYS: scores [TILE_ROWS, CHUNK]) or
    lhs @ chunk (values: [TILE_ROWS, HEAD]). shared: the whole tile reads the chunk's positions plainly, one
    load and one product; otherwise each query's own positions, and a tile row keeps its query's product."""
    if shared:
        where = _cache_offsets(table_ptr, row, virtual, virtual >= 0, kv_head, table_stride, KV_HEADS, HEAD, BLOCK)
        out = _operand_product(lhs, tl.load(ptr + where), KEYS, PRECISION, INTERPRETED)
    else:
        out = tl.zeros((lhs.shape[0], virtual.shape[0] if KEYS else HEAD), tl.float32)
        for j in range(queries):
            chunk = _query_chunk(
                ptr,
                table_ptr,
                region_ptr,
                prefix_ptr,
                count_ptr,
                row,
                first + j,
                virtual,
                kv_head,
                table_stride,
                region_width,
                KV_HEADS,
                HEAD,
                BLOCK,
            )
            out = tl.where((member == j)[:, None], _operand_product(lhs, chunk, KEYS, PRECISION, INTERPRETED), out)
    return out


@triton.jit
def _operand_product(lhs, chunk, KEYS: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """lhs @ chunk^T (KEYS) or lhs (cast to the cache's dtype, as flash attention's P) @ chunk."""
    if KEYS:
        out = _product(lhs, tl.trans(chunk), PRECISION, INTERPRETED)
    else:
        out = _product(lhs.to(chunk.dtype), chunk, PRECISION, INTERPRETED)
    return out


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
    tiles_per_row,
    region_width,
    splits,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    GROUP: tl.constexpr = HEADS // KV_HEADS
    QUERIES: tl.constexpr = TILE_ROWS // GROUP
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tile // tiles_per_row
    first = row * queries_per_row + (tile % tiles_per_row) * QUERIES  # the tile's first query
    r = tl.arange(0, TILE_ROWS)
    member = r // GROUP  # which of the tile's queries a tile row belongs to
    queries = tl.minimum(QUERIES, (row + 1) * queries_per_row - first)
    used = member < queries
    query = first + member
    heads = kv_head * GROUP + r % GROUP
    dims = tl.arange(0, HEAD)
    q = tl.load(q_ptr + (query * HEADS + heads)[:, None] * HEAD + dims[None, :], mask=used[:, None], other=0.0)
    prefix = tl.load(prefix_ptr + query, mask=used, other=0)
    length = tl.where(used, prefix + tl.load(count_ptr + query, mask=used, other=0), 0)
    common = tl.min(tl.where(used, prefix, 1 << 30), axis=0)  # positions every query reads plainly
    offsets = tl.arange(0, CHUNK)
    m = tl.full((TILE_ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((TILE_ROWS,), tl.float32)
    acc = tl.zeros((TILE_ROWS, HEAD), tl.float32)
    for c in range(split, tl.cdiv(tl.max(length, axis=0), CHUNK), splits):
        virtual = c * CHUNK + offsets
        shared = (c + 1) * CHUNK <= common
        scores = _chunk_product(
            q,
            k_ptr,
            True,
            shared,
            table_ptr,
            region_ptr,
            prefix_ptr,
            count_ptr,
            row,
            first,
            member,
            queries,
            virtual,
            kv_head,
            table_stride,
            region_width,
            KV_HEADS,
            HEAD,
            BLOCK,
            PRECISION,
            INTERPRETED,
        )
        scores = tl.where(virtual[None, :] < length[:, None], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays empty
        p = tl.exp(scores - safe[:, None])
        alpha = tl.exp(m - safe)
        total = total * alpha + tl.sum(p, axis=1)
        update = _chunk_product(
            p,
            v_ptr,
            False,
            shared,
            table_ptr,
            region_ptr,
            prefix_ptr,
            count_ptr,
            row,
            first,
            member,
            queries,
            virtual,
            kv_head,
            table_stride,
            region_width,
            KV_HEADS,
            HEAD,
            BLOCK,
            PRECISION,
            INTERPRETED,
        )
        acc = acc * alpha[:, None] + update
        m = m_new
    out = (query * HEADS + heads) * splits + split
    tl.store(m_ptr + out, m, mask=used)
    tl.store(l_ptr + out, total, mask=used)
    tl.store(o_ptr + out[:, None] * HEAD + dims[None, :], acc, mask=used[:, None])


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


def num_splits(max_length: int) -> int:
    """Splits for rows of at most max_length tokens (the table's width): a chunk a split at least."""
    return max(1, min(MAX_SPLITS, triton.cdiv(max_length, CHUNK)))


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
    splits = num_splits(table.shape[1] * block_size)
    tile_rows = max(MIN_TILE_ROWS, triton.next_power_of_2(heads // kv_heads))
    tiles_per_row = triton.cdiv(per_row, tile_rows // (heads // kv_heads))
    m = torch.empty(queries, heads, splits, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(m)
    o = torch.empty(queries, heads, splits, head, dtype=torch.float32, device=q.device)
    _paged_kernel[(rows * tiles_per_row, kv_heads, splits)](
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
        tiles_per_row,
        region.shape[-1],
        splits,
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD=head,
        BLOCK=block_size,
        CHUNK=CHUNK,
        TILE_ROWS=tile_rows,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=q.device.type == "cpu",
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
