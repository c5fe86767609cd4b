"""The kernels' tuning: block sizes, tiles and the routing flags, in one frozen dataclass.

attach(model, tuning=...) binds an instance to the kernels a model calls; probes and tests pass variants
(`dataclasses.replace(DEFAULT_TUNING, gated_gemv=True)`). The defaults are the fastest measured on an H200;
the measurements are in BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT32_DOT_MODES = ("ieee", "tf32", "tf32x3")


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class KernelTuning:
    # --- GEMV (one token): each program sums block_rows whole rows of W in float32, block_k columns at a
    # time; one configuration for every shape (measured faster on the H200 than 1-16 rows a program).
    block_rows: int = 8
    block_k: int = 1024
    num_warps: int = 8

    # --- The fused layer's single-token step.
    # SiLU(fc) * gate inside the fc_gate GEMV instead of a kernel between the GEMVs: off, the GEMV reading two
    # row blocks a program lost more than the kernel it saves (see BENCHMARKS.md).
    gated_gemv: bool = False
    # Rotary and the cache write inside the QKV GEMV instead of rope_store after it: one kernel a layer fewer.
    rope_in_gemv: bool = True

    # --- Steps of several tokens (trees, batched decode rows), at most rows_gemm_max_tokens of them.
    # The MLP as two rows_gemm kernels (SiLU inside the first, the residual add inside the second) instead of
    # cuBLAS's GEMMs and inductor's SiLU; QKV and output products stay on cuBLAS, which streams them as fast.
    rows_mlp: bool = True
    rows_gemm_max_tokens: int = 64  # one tile of x's rows: every weight tile is read once a step
    # (BLOCK_N outputs, BLOCK_K columns, warps, pipeline stages) of a rows_gemm program, gated or not.
    rows_gemm_gated_tile: tuple[int, int, int, int] = (64, 64, 4, 4)
    rows_gemm_tile: tuple[int, int, int, int] = (32, 256, 4, 4)
    # Small layers (every weight of at most rows_small_weights elements: SmolLM2's, not the 8B shape's) take a
    # tree step whole through the kernels: the four products with the norms, rotary, the cache write, SiLU and
    # the residual adds inside them, 6 kernels a layer instead of 9.
    rows_layer: bool = True
    rows_small_weights: int = 1 << 22
    # ... and a batched step over the block pool (decode rows, every row's tree) the same way, the attention
    # through the paged kernel (routing.paged_layer), instead of the library products and inductor's fusions.
    paged_layer: bool = True
    # ... for steps of at most this many tokens in all: the small tiles cover a step's tokens in a grid of
    # programs, so the 64-token tile above does not bound them (past 64 tokens the library path took a
    # drafting step at 16-64 rows to three plain steps' time); at 4,096 the library is faster (BENCHMARKS.md).
    paged_layer_max_tokens: int = 2048
    # Decode rows (one token a row) take it from the first to the second row count (one row through the
    # single-token GEMVs); at 32 and 64 rows it is faster than the library path, compiled or not (BENCHMARKS.md).
    paged_decode_rows: tuple[int, int] = (1, 64)
    # Their (BLOCK_M tokens, BLOCK_N outputs, BLOCK_K columns, warps, stages), for the QKV product with rotary,
    # the gated gate/up and the others: latency-bound products, so small tiles on many SMs and deep pipelines
    # (measured faster on the H200; see BENCHMARKS.md).
    rows_small_rope_tile: tuple[int, int, int, int, int] = (16, 32, 64, 4, 5)
    rows_small_gated_tile: tuple[int, int, int, int, int] = (16, 64, 64, 4, 5)
    rows_small_tile: tuple[int, int, int, int, int] = (64, 16, 128, 4, 5)

    # --- Slot attention.
    # One token on CUDA cores (one_token_tiles False): each program walks a span of cache slots
    # attention_chunk_slots at a time; spans are one chunk until there are more chunks than attention_max_splits.
    attention_chunk_slots: int = 16
    attention_max_splits: int = 64
    # A single token on the tensor-core tiles of several tokens' attention (its query group padded to
    # tree_min_rows rows) instead of the CUDA-core kernel: faster on the H200. The CUDA-core kernel serves
    # bf16 under Triton's interpreter, whose bf16 tile products are wrong.
    one_token_tiles: bool = True
    # Several tokens: tiles of tree_block_rows query rows (token, group member) against tree_block_slots slots
    # (tl.dot needs 16 rows at least); splits a (tile, kv head) aim at attention_programs programs in all (about
    # two an SM), each split taking tree_min_blocks_per_split to tree_max_blocks_per_split blocks of slots, so
    # that a short text still spreads over the SMs and a long one does not pay for a large merge.
    attention_programs: int = 256
    tree_block_rows: int = 16
    tree_block_slots: int = 64
    tree_min_rows: int = 16
    tree_min_blocks_per_split: int = 2
    tree_max_blocks_per_split: int = 4
    # Float32 models' tile products: exact ("ieee") so that no TF32 rounding reaches the scores; "tf32x3" was
    # barely faster.
    float32_dot: str = "ieee"

    # --- Batch-invariant products and norms (attach(..., invariant=True)): every row's sums in one order for any
    # row count, so a token's outputs do not depend on the batch or the tree around it.
    # (BLOCK_M rows, BLOCK_N outputs, BLOCK_K columns, warps, stages) of every product: fixed, never picked
    # from the row count (another tile would sum in another order).
    invariant_tile: tuple[int, int, int, int, int] = (64, 64, 64, 4, 3)
    # K is split until the output tiles times the splits reach this many programs (a one-row product streams
    # its weights: it needs programs on every SM), at most invariant_max_splits spans of at least
    # invariant_min_blocks_per_split column blocks; from (N, K) only.
    invariant_programs: int = 512
    invariant_max_splits: int = 16
    invariant_min_blocks_per_split: int = 2
    invariant_sum_block: int = 1024  # outputs a program of the split sum adds
    invariant_max_rows: int = 1024  # rows of one launch: bounds the float32 partials of a prefill
    # The norm: a program a row, invariant_norm_block columns a step.
    invariant_norm_block: int = 1024
    invariant_norm_warps: int = 4

    # --- A drafter's top-k's (EAGLE's nets, Medusa's heads).
    # LM head, log-softmax and top-k in one kernel: each program takes draft_topk_tile vocabulary rows for a
    # block of draft_topk_max_rows rows (one tl.dot tile), draft_topk_block_h hidden columns a step. Every block
    # reads the whole head: past draft_topk_fused_rows rows torch's logits and top-k read it once instead.
    draft_topk_tile: int = 256
    draft_topk_warps: int = 4
    draft_topk_max_rows: int = 16
    draft_topk_fused_rows: int = 128
    draft_topk_block_h: int = 64
    # The kernels unroll k rounds and the merge holds tiles * k candidates a row: beyond this k torch's ops win.
    draft_topk_max_k: int = 16
    # A tree's other top-k's through row_topk, one sort in registers of a row of at most this many values.
    row_topk_max: int = 4096

    def __post_init__(self) -> None:
        blocks = (
            self.block_rows,
            self.block_k,
            self.attention_chunk_slots,
            self.tree_block_rows,
            self.tree_block_slots,
            self.tree_min_rows,
            self.draft_topk_tile,
            self.draft_topk_max_rows,
            self.draft_topk_block_h,
            self.row_topk_max,
            *self.invariant_tile[:3],
            self.invariant_sum_block,
            self.invariant_norm_block,
        )
        if not all(map(_power_of_two, blocks)):
            raise ValueError(f"KernelTuning: block sizes must be powers of two: {self}")
        if (
            len(self.rows_gemm_gated_tile) != 4
            or len(self.rows_gemm_tile) != 4
            or any(len(t) != 5 for t in (self.rows_small_rope_tile, self.rows_small_gated_tile, self.rows_small_tile))
        ):
            raise ValueError("KernelTuning: rows_gemm tiles take 4 values, rows_small tiles 5")
        if len(self.invariant_tile) != 5 or min(self.invariant_programs, self.invariant_min_blocks_per_split) < 1:
            raise ValueError(f"KernelTuning: invariant_tile takes 5 values, invariant counts are positive: {self}")
        if self.float32_dot not in FLOAT32_DOT_MODES:
            raise ValueError(f"KernelTuning.float32_dot={self.float32_dot!r}: use one of {FLOAT32_DOT_MODES}")

    def dot_precision(self, dtype: torch.dtype) -> str:
        """tl.dot's input_precision for tiles of this dtype (half dtypes ignore it)."""
        return self.float32_dot if dtype == torch.float32 else "tf32"

    def lm_head_topk_fits(self, rows: int, k: int) -> bool:
        """Whether lm_head_topk takes `rows` rows and this k."""
        return rows <= self.draft_topk_fused_rows and k <= self.draft_topk_max_k


DEFAULT_TUNING = KernelTuning()
