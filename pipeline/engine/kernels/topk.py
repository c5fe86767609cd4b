"""A drafter's top-k's as torch custom ops: the LM head, log-softmax and top-k in one pass over the
vocabulary (lm_head_topk: a tile's logits, k best, maximum and sum of exponentials, then a merge of the
tiles), so the [rows, vocab] logits are never written; and a small top-k of a row of at most a few
thousand values in one sort in registers (row_topk), for a dynamic tree's frontier and selection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning


@triton.jit
def _lm_head_topk_kernel(
    h_ptr,
    w_ptr,
    val_ptr,
    idx_ptr,
    max_ptr,
    sum_ptr,
    rows,
    vocab,
    hidden,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    K: tl.constexpr,
):
    """One vocabulary tile for one block of ROWS rows: logits in float32, then the tile's k best (value, token),
    its maximum and its sum of exp(logit - maximum), at [row, tile] of the outputs."""
    tile = tl.program_id(0)
    tiles = tl.num_programs(0)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_V)
    v = tile * BLOCK_V + cols
    acc = tl.zeros((ROWS, BLOCK_V), tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(
            h_ptr + r[:, None] * hidden + c[None, :], mask=(r[:, None] < rows) & (c[None, :] < hidden), other=0.0
        )
        w = tl.load(
            w_ptr + v[:, None] * hidden + c[None, :], mask=(v[:, None] < vocab) & (c[None, :] < hidden), other=0.0
        )
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


def tiled_topk(
    h: torch.Tensor, weight: torch.Tensor, k: int, block_v: int, warps: int, max_rows: int, block_h: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """lm_head_topk's two kernels with vocabulary tiles of block_v rows, `warps` warps a program, blocks of
    max_rows rows of h (one tl.dot tile each; every block reads the weights) and block_h hidden columns a
    step."""
    rows, hidden = h.shape
    h, weight = h.contiguous(), weight.contiguous()
    vocab = weight.shape[0]
    tiles = triton.cdiv(vocab, block_v)
    val = torch.empty(rows, tiles * k, dtype=torch.float32, device=h.device)
    idx = torch.empty(rows, tiles * k, dtype=torch.int32, device=h.device)
    tile_max = torch.empty(rows, tiles, dtype=torch.float32, device=h.device)
    tile_sum = torch.empty_like(tile_max)
    _lm_head_topk_kernel[(tiles, triton.cdiv(rows, max_rows))](
        h,
        weight,
        val,
        idx,
        tile_max,
        tile_sum,
        rows,
        vocab,
        hidden,
        ROWS=max_rows,
        BLOCK_V=block_v,
        BLOCK_H=block_h,
        K=k,
        num_warps=warps,
    )
    logp = torch.empty(rows, k, dtype=torch.float32, device=h.device)
    tokens = torch.empty(rows, k, dtype=torch.long, device=h.device)
    _topk_merge_kernel[(rows,)](
        val,
        idx,
        tile_max,
        tile_sum,
        logp,
        tokens,
        tiles,
        K=k,
        N=triton.next_power_of_2(tiles * k),
        TILES=triton.next_power_of_2(tiles),
    )
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
def _topk_merge_kernel(
    val_ptr,
    idx_ptr,
    max_ptr,
    sum_ptr,
    logp_ptr,
    token_ptr,
    tiles,
    K: tl.constexpr,
    N: tl.constexpr,
    TILES: tl.constexpr,
):
    """One row of _lm_head_topk_kernel's output: the log-softmax normaliser from the tiles' maxima and
    sums, and the k best of the tiles' tiles * k candidates, as log-probabilities and tokens. k rounds of
    max-and-remove over the candidates' keys: for a few rows and a small k faster than a bitonic sort of
    all the candidates."""
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
def _row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    assert 0 < k <= n, "row_topk: 0 < k <= the rows' length"
    x = x.contiguous()
    values = x.new_empty(*x.shape[:-1], k)
    positions = torch.empty(values.shape, dtype=torch.long, device=x.device)
    _row_topk_kernel[(x.numel() // n,)](x, values, positions, n, K=k, N=triton.next_power_of_2(n))
    return values, positions


@_row_topk.register_fake
def _(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.long)


def row_topk(x: torch.Tensor, k: int, tuning: KernelTuning = DEFAULT_TUNING) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) along x's last dimension (at most tuning.row_topk_max values) in one kernel, one program
    a row: (values in x's dtype, int64 positions), best first, equal values by position. For the few hundred
    candidates of an EAGLE step several times faster than torch.topk's radix select."""
    assert x.shape[-1] <= tuning.row_topk_max, f"row_topk: rows of at most {tuning.row_topk_max} values"
    return _row_topk(x, k)


@torch.library.custom_op("specpipe::lm_head_topk", mutates_args=())
def _lm_head_topk(
    h: torch.Tensor, weight: torch.Tensor, k: int, block_v: int, warps: int, max_rows: int, block_h: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return tiled_topk(h, weight, k, block_v, warps, max_rows, block_h)


@_lm_head_topk.register_fake
def _(
    h: torch.Tensor, weight: torch.Tensor, k: int, block_v: int, warps: int, max_rows: int, block_h: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return (h.new_empty(h.shape[0], k, dtype=torch.float32), h.new_empty(h.shape[0], k, dtype=torch.long))


def lm_head_topk(
    h: torch.Tensor, weight: torch.Tensor, k: int, tuning: KernelTuning = DEFAULT_TUNING
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities float32, tokens) of the k most likely tokens of each row of h [rows, H] @ weight.T,
    [rows, k] each, best first: log_softmax(F.linear(h, weight).float()).topk(k) without the logits."""
    return _lm_head_topk(
        h,
        weight,
        k,
        tuning.draft_topk_tile,
        tuning.draft_topk_warps,
        tuning.draft_topk_max_rows,
        tuning.draft_topk_block_h,
    )
