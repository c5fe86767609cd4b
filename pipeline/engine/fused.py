"""Decode and tree steps on CUDA: our own Triton kernels instead of cuBLAS and a dozen small kernels.

At batch 1 a decode step is one row times every weight matrix, so its speed is how fast those
matrices stream from memory, plus whatever each layer spends between them. Two levels:

- gemv: every single-token product of a half-precision Linear goes through one GEMV kernel, each
  program summing BLOCK_ROWS whole rows in float32. On an H200, with a new matrix each call as in a
  real step (build/probe_gemv.py), it reads the Llama-3-8B projections at 3.1-4.5 TB/s; the 129
  products of one token took 3.87 ms against cuBLAS's 3.93 ms (session j).
- fused (the default): a decoder layer becomes four GEMVs and an attention of two kernels, each
  kernel boundary costing a microsecond or more. The RMS norms run inside the GEMVs that read them
  (QKV, gate/up), rotary and the cache write inside the QKV GEMV, the residual adds inside the GEMVs
  that produce them (output and down projections); attention reads only the slots in use, on the
  tensor-core tiles of several tokens' attention (ONE_TOKEN_TILES; or a CUDA-core flash-decoding
  kernel), then a small merge kernel (merging in the same launch, the last split of a kv head reading
  the others' partials, took 12.5 us a layer on the H200 against 4.9 + 2.1: more registers a program
  and a serial merge at the end). SiLU-and-multiply stays a kernel of inductor's
  unless GATED_GEMV (see there). Layers the kernels do not cover (biases, other activations, no
  input norm, head sizes that are not a power of two) keep the gemv level.

A fused layer's steps of up to 64 tokens (trees, batched decode rows) run their MLP as two
tensor-core GEMMs of ours (rows_gemm), each reading a weight tile once for all the tokens, with
SiLU and the residual add inside (ROWS_MLP); the attention's products stay on cuBLAS, and more
tokens (prefills) keep cuBLAS throughout. Small layers (SmolLM2's) take a tree step whole through
the kernels, as a single token does (ROWS_LAYER). The attention of steps of several tokens (an EAGLE draft's
passes too), like a single token's, goes through the slot-attention kernel whenever the CUDA graphs
call it: it reads the accepted text and the step's own region of slots through the tree mask,
instead of SDPA over every cache slot with a mask (42 us a layer for SmolLM2's 64-node trees, most
of an EAGLE step). It serves every CUDA dtype. Prefills stay on SDPA; CPU models never change.
`SPECPIPE_KERNELS` picks the level (fused, gemv, off; off also keeps SDPA for trees).
An EAGLE drafter's LM head and top-k run as one kernel, and the small top-k's of EAGLE's and Medusa's dynamic trees
as another (draft_kernels; see DRAFT_TOPK_ENV; SPECPIPE_DRAFT_TOPK=torch: not). With
TRITON_INTERPRET=1 the kernels run on CPU tensors: the tests do that.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from pipeline.engine.model import Attention, DecoderLayer, Linear, RMSNorm
from pipeline.errors import UserError

if TYPE_CHECKING:
    from pipeline.engine.model import ForwardContext

KERNELS_ENV = "SPECPIPE_KERNELS"
LEVELS = ("fused", "gemv", "off")
# One GEMV configuration for every shape, a warp a row. H200, session j: the 8B decode loop ran 238.4
# and 241.9 tok/s against 229.8 and 229.6 for 4 rows a program with the norm and 1 without (4 warps),
# 235.4 for 16 rows (8 warps), 215.3 for 2 rows (4 warps; sessions d-i); build/probe_gemv.py put all
# of them within 5% for the 129 products of a token, each call reading a matrix not in L2.
BLOCK_ROWS = 8
BLOCK_K = 1024
NUM_WARPS = 8
# Attention of one token: each program walks a span of cache slots ATTENTION_CHUNK_SLOTS at a time;
# spans are one chunk until the cache has more chunks than ATTENTION_MAX_SPLITS, so a short text
# already runs on many SMs, and the merge of the spans' partial softmaxes stays one small tile a head.
# (Dealing chunks round-robin to 64 splits measured 5.7 against 5.0 us a layer, 8B decode, H200.)
ATTENTION_CHUNK_SLOTS = 16  # 32 measured slower on the H200 (8.6 against 5.0 us a layer, 8B decode)
ATTENTION_MAX_SPLITS = 64
# Whether a single token's attention instead runs on the tensor-core tiles of several tokens' (below; its
# query group padded to TREE_MIN_ROWS rows, blocks of TREE_BLOCK_SLOTS slots dealt to the splits). H200,
# session s: SmolLM2's decode step 0.769 -> 0.608 ms (its attention 6.8 + 2.7 -> 2.8 + 1.4 us a layer; plain
# 1278 -> 1595 tokens/s on MT-bench), the 8B shape 238.1 -> 242.5 tokens/s (build/probe_ab.py). The CUDA-core
# kernel stays for ONE_TOKEN_TILES = False and for bf16 under Triton's interpreter (the tests).
ONE_TOKEN_TILES = True
# Several tokens (trees, draft passes): tensor-core tiles of TREE_BLOCK_ROWS query rows (token, group
# member) against TREE_BLOCK_SLOTS slots (tl.dot needs 16 rows at least). Splits per (tile, kv head)
# aim at ATTENTION_PROGRAMS programs in all, about two per SM, each taking every splits-th block of slots
# below the step's bound, so that however short the text every split gets a share. (1024 measured
# 14.2 against 10.3 us a layer for the 8B shape's 64-node tree on a short text, H200: 3 splits and a
# merge as costly as the attention itself, against 2.)
ATTENTION_PROGRAMS = 256
# 16-row tiles: more programs for a tree's rows, and float32 tiles that fit in registers (H200, probe:
# 8B tree 64 13.9 against 17.5 us a layer with 64-row tiles, 1,500-token text 41.8 against 60.1;
# SmolLM2 float32 tree 64 15.5 against 205.5).
TREE_BLOCK_ROWS = 16
TREE_BLOCK_SLOTS = 64
TREE_MIN_ROWS = 16
# A split takes 2 to 4 of the cache's blocks of slots: at most 4 where programs are plenty, so that a
# long text still spreads over many SMs (one split writes its output directly, no merge). H200 probe
# (build/probe_tree_attention.py), split counts this rule gives: 8B tree 64, short text 2 (10.3 us a layer,
# the best measured), 1,500-token text 8 (41.9, the best at this block size); 8B tree 16: 3 (7.3, best);
# SmolLM2 tree 64: 7, not measured (11 splits took 7.2 us, 6 took 7.4; float32 15.4 and 18.9).
TREE_MIN_BLOCKS_PER_SPLIT = 2
TREE_MAX_BLOCKS_PER_SPLIT = 4
# Float32 models' tile products: exact ("ieee", FMA) so that no TF32 rounding reaches the scores. With
# 16-row tiles they cost SmolLM2's 64-node trees 15.4 us a layer on the H200; "tf32x3" (three TF32
# products, near-float32) measured 14.3, too little to give up exactness for.
FLOAT32_DOT = "ieee"
# Whether the fused layer's fc_gate GEMV applies SiLU(fc) * gate itself, one kernel a layer fewer than
# inductor's SiLU-and-multiply between the GEMVs. Off: on the H200 (build/probe_step.py --gated) the
# GEMVs took 94 us a token longer, reading two row blocks a program, and the SiLU kernels saved 47.
GATED_GEMV = False
# Whether the fused layer's QKV GEMV rotates q and k and writes k and v to the cache itself, instead of
# rope_store in a kernel of its own after it. On the H200 (build/probe_step.py --no-rope-gemv, two pairs
# of runs) 28 us a token less device time and about 90 us less span; the loop's tokens/s drifted more
# between runs than that.
ROPE_IN_GEMV = True
# Steps of several tokens, up to ROWS_GEMM_MAX_TOKENS (trees, batched decode rows): whether the MLP runs
# as two rows_gemm kernels, SiLU-and-multiply inside the first and the residual add inside the second,
# instead of cuBLAS's two GEMMs (the second split along K, plus its reduction) and inductor's SiLU.
# H200, session k, 8B shape (build/probe_ab.py --tree 64, two machines): a 64-token pass 4.97 against
# 5.25 ms, 5.07 against 5.28. The QKV and output products stay on cuBLAS, which streams them as fast as
# rows_gemm's best tiles (build/probe_tree_gemm.py); all four products through rows_gemm, with the norms
# inside (each row's sum of squares from the x tiles the products stream, g * x before the products),
# took 8.23 ms (see _rows_gemm_kernel).
ROWS_MLP = True
ROWS_GEMM_MAX_TOKENS = 64  # one tile of x's rows: every weight tile is read once a step
# (BLOCK_N outputs, BLOCK_K columns, warps, pipeline stages) a program of rows_gemm, gated or not. H200,
# 64 rows (build/probe_tree_gemm.py --mlp): gate/up 60.4 us, down with the residual 34.0, against 100.5 for
# the compiled cuBLAS MLP; the next tiles 0.1-7 us slower (32 outputs and 128 columns for down: 41.2).
ROWS_GEMM_GATED_TILE = (64, 64, 4, 4)
ROWS_GEMM_TILE = (32, 256, 4, 4)
# Small layers (every weight of at most ROWS_SMALL_WEIGHTS elements: SmolLM2's largest, gate/up, has 1.8 M; the
# 8B shape's smallest 16.8 M) take a tree step of up to ROWS_GEMM_MAX_TOKENS tokens whole through our kernels when
# ROWS_LAYER: four products with the norms, rotary, the cache write, SiLU and the residual adds inside them, and
# the two attention kernels, 6 kernels a layer instead of 9. Their products are latency-bound (a matrix of 3.5 MB
# at most streams in under a microsecond), so their tiles (BLOCK_M tokens, BLOCK_N outputs, BLOCK_K columns,
# warps, stages) for the QKV product with rotary, the gated gate/up and the others trade re-reads of a weight
# tile from L2 for programs on more SMs, and keep several loads in flight against the latency of weights read
# from memory. H200, session u (build/probe_tree_gemm.py --layer 64 --shape smollm2, weights cycled past L2, the
# best of 108 tiles each): 5.6 + 3.5 + 6.5 + 5.4 us for a 64-token step's four products with 4 stages, where
# cuBLAS's bare products take 3.5 + 3.7 + 4.3 + 5.2 before their norms' and rotary's kernels; a random-weight
# SmolLM2 EAGLE step (build/probe_eagle_step.py) 1.305 ms with session t's 3 stages (tiles chosen on weights L2
# held), 1.212 with 4, 1.193 with 5 or 6 (6 took no less); session t's step with cuBLAS and 9 kernels a layer
# was 1.341.
ROWS_LAYER = True
ROWS_SMALL_WEIGHTS = 1 << 22
ROWS_SMALL_ROPE_TILE = (16, 32, 64, 4, 5)
ROWS_SMALL_GATED_TILE = (16, 64, 64, 4, 5)
ROWS_SMALL_TILE = (64, 16, 128, 4, 5)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# An EAGLE drafter's LM head, log-softmax and top-k at every draft depth in one kernel (draft_topk): each
# program takes DRAFT_TOPK_TILE vocabulary rows, computes their logits for all the depth's rows (at most
# DRAFT_TOPK_MAX_ROWS, one tl.dot tile) and keeps the tile's k best, maximum and sum of exponentials, so
# the [rows, vocab] logits are never written; a second kernel takes each row's k best of the tiles x k
# candidates and its log-softmax normaliser (torch's four ops until session s). H200,
# build/probe_draft_topk.py, both sides through torch.compile: 45.5 against 83.0 us a depth at SmolLM2's
# shape (8 rows, k 8); 256 rows and 4 warps a program was the best of three. Inside the engine (SmolLM2 +
# EAGLE dynamic, bf16, 80 MT-bench turns, session r): 1975 -> 2104 tokens/s, 1.55x -> 1.65x plain, same trees.
# On by default; SPECPIPE_DRAFT_TOPK=torch keeps the LM head, log-softmax and torch.topk (and torch.topk for the
# tree's other top-k's, below).
DRAFT_TOPK_ENV = "SPECPIPE_DRAFT_TOPK"
DRAFT_TOPK_TILE = 256
DRAFT_TOPK_WARPS = 4
DRAFT_TOPK_MAX_ROWS = 16
# Both kernels unroll k rounds, and the merge holds a row's tiles * k candidates in one program: EAGLE's k of 8
# and 10 beat torch's ops (sessions r, v), Medusa's dynamic tree's 32 did not (H200, session w: a step 1.32
# against 1.28 ms device time; with its vocabulary top-k on torch and its other top-k's in row_topk, 1.23).
DRAFT_TOPK_MAX_K = 16
DRAFT_TOPK_BLOCK_H = 64
# With the fused top-k, a dynamic tree's other top-k's (the frontier at each depth, the tree's selection and
# its ordering by depth) go through row_topk: one bitonic sort in registers a row of at most ROW_TOPK_MAX
# values, 1.5 us a call on the H200 against torch.topk's 6.7-13.9. Both kernels together (and lm_head_topk's
# merge in one kernel of ours): a random-weight SmolLM2 EAGLE step 1.52 -> 1.35 ms (session s,
# build/probe_eagle_step.py); the trained draft 1971 -> 2347 tokens/s against SPECPIPE_DRAFT_TOPK=torch.
ROW_TOPK_MAX = 4096


def level() -> str:
    value = os.environ.get(KERNELS_ENV) or "fused"
    if value not in LEVELS:
        raise UserError(f"{KERNELS_ENV}={value}: use one of {', '.join(LEVELS)}")
    return value if importlib.util.find_spec("triton") is not None else "off"


def draft_topk_enabled() -> bool:
    value = os.environ.get(DRAFT_TOPK_ENV) or "fused"
    if value not in ("fused", "torch"):
        raise UserError(f"{DRAFT_TOPK_ENV}={value}: use fused or torch")
    return value == "fused"


def attach(model: nn.Module, kernels: str | None = None, device_types: tuple[str, ...] = ("cuda",),
           draft_topk: bool | None = None) -> dict[str, int]:
    """Route `model`'s single-token work, and the attention of its graph steps, through the kernels
    at `kernels` (default: the environment's level), and an EAGLE drafter's top-k through draft_topk
    (default: SPECPIPE_DRAFT_TOPK). Returns how many Linear layers use the GEMV, how many decoder layers
    run fused, how many attention layers read through slot_attention and how many drafters use the
    fused top-k. Calling it again with another level re-routes (the benchmark compares levels on one model)."""
    kernels = kernels or level()
    drafters = [m for m in model.modules() if hasattr(m, "draft_topk")]
    for m in drafters:
        m.draft_topk, m.row_topk = draft_kernels(m.lm_head.weight, kernels, device_types, draft_topk)
    attentions = [m for m in model.modules() if isinstance(m, Attention) and m.qkv.weight.device.type in device_types]
    slot_attention = None
    if kernels != "off" and attentions:
        from pipeline.engine.fused_kernels import slot_attention
    for m in attentions:
        m.slot_attention = slot_attention if power_of_two(m.head_size) else None

    def eligible(lin: Linear) -> bool:
        return lin.weight.device.type in device_types and lin.weight.dtype in HALF_DTYPES

    linears = [m for m in model.modules() if isinstance(m, Linear) and eligible(m)]
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer) and eligible(m.mlp.proj)]
    gemv = None
    if kernels != "off" and linears:
        from pipeline.engine.fused_kernels import gemv
    for m in linears:
        m.gemv = gemv
    fused = [m for m in layers if kernels == "fused" and fusable(m)]
    for m in layers:
        m.fused = fused_layer if m in fused else None
    return {"gemv_layers": len(linears) if gemv else 0, "fused_layers": len(fused),
            "attention_layers": sum(m.slot_attention is not None for m in attentions),
            "draft_topk": sum(m.draft_topk is not None for m in drafters)}


def draft_kernels(lm_head: torch.Tensor, kernels: str | None = None, device_types: tuple[str, ...] = ("cuda",),
                  draft_topk: bool | None = None) -> tuple[Callable | None, Callable | None]:
    """(lm_head_topk, row_topk) for a drafter (EAGLE's net, Medusa's heads) whose LM head is `lm_head`, where
    they run: at a kernel level other than off (default: the environment's), with SPECPIPE_DRAFT_TOPK's
    fused (or draft_topk), on half-precision weights of device_types; else (None, None), torch's ops."""
    kernels = kernels or level()
    draft_topk = draft_topk_enabled() if draft_topk is None else draft_topk
    if (kernels == "off" or not draft_topk or lm_head.device.type not in device_types
            or lm_head.dtype not in HALF_DTYPES):
        return None, None
    from pipeline.engine.fused_kernels import lm_head_topk, row_topk
    return lm_head_topk, row_topk


def draft_topk_fits(rows: int, k: int) -> bool:
    """Whether lm_head_topk takes `rows` rows (one tl.dot tile) and this k (see DRAFT_TOPK_MAX_K)."""
    return rows <= DRAFT_TOPK_MAX_ROWS and k <= DRAFT_TOPK_MAX_K


def small_topk(x: torch.Tensor, k: int, row_topk: Callable | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk's (values, indices) over x's last dimension, through the row_topk kernel where a drafter has
    it and the rows fit it (a tree's candidates: a few hundred to a few thousand)."""
    if row_topk is None or x.shape[-1] > ROW_TOPK_MAX:
        return x.topk(k)
    return row_topk(x, k)


def fusable(layer: DecoderLayer) -> bool:
    a, mlp = layer.attention, layer.mlp
    head = a.head_size
    return (isinstance(layer.input_layernorm, RMSNorm) and mlp.act is torch.nn.functional.silu
            and all(lin.bias is None for lin in (a.qkv, a.dense, mlp.fc_gate, mlp.proj))
            and power_of_two(head))


def power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def fused_layer(layer: DecoderLayer, x: torch.Tensor, ctx: "ForwardContext", index: int) -> torch.Tensor:
    """DecoderLayer.forward through the kernels: a single token's all through (single_token_layer); a tree
    step's of a small layer all through (several_token_layer); other steps of several tokens from the MLP's
    norm on (several_token_mlp)."""
    tokens = x.shape[:-1].numel()
    if tokens == 1:
        return single_token_layer(layer, x, ctx, index)
    if (ROWS_LAYER and ctx.region is not None and tokens <= ROWS_GEMM_MAX_TOKENS
            and layer.attention.head_size >= TREE_MIN_ROWS and layer.mlp.fc_gate.weight.numel() <= ROWS_SMALL_WEIGHTS):
        return several_token_layer(layer, x, ctx, index)
    x = x + layer.attention(layer.input_layernorm(x), ctx, index)
    return several_token_mlp(layer, x)


def single_token_layer(layer: DecoderLayer, x: torch.Tensor, ctx: "ForwardContext", index: int) -> torch.Tensor:
    """DecoderLayer.forward for one token of one sequence (x [1, 1, H]): four GEMVs, the first with
    rotary and the cache write in it (ROPE_IN_GEMV; else a kernel of their own), the two attention
    kernels, and SiLU-and-multiply (inductor's, or in the third GEMV)."""
    from pipeline.engine.fused_kernels import gemv, gemv_rope_store, rope_store, slot_attention

    a, mlp, norm = layer.attention, layer.mlp, layer.input_layernorm
    h = x.view(-1)
    rope = (ctx.rotary.cos, ctx.rotary.sin, ctx.positions.view(-1), ctx.slots.view(-1), ctx.cache.k, ctx.cache.v,
            index, a.num_heads)
    if ROPE_IN_GEMV:
        q = gemv_rope_store(h, a.qkv.weight, norm.weight, norm.eps, *rope)
    else:
        q = rope_store(gemv(h, a.qkv.weight, norm.weight, norm.eps), *rope)
    out = slot_attention(q.view(1, a.num_heads, a.head_size), ctx.cache.k[index, 0], ctx.cache.v[index, 0],
                         *ctx.visible_slots())
    h = gemv(out.view(-1), a.dense.weight, residual=h)
    if GATED_GEMV:
        gated = gemv(h, mlp.fc_gate.weight, layer.post_layernorm.weight, layer.post_layernorm.eps, gated=True)
    else:
        fc, gate = gemv(h, mlp.fc_gate.weight, layer.post_layernorm.weight, layer.post_layernorm.eps).chunk(2)
        gated = mlp.act(fc) * gate
    return gemv(gated, mlp.proj.weight, residual=h).view_as(x)


def several_token_mlp(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    """x + MLP(post_layernorm(x)) for a step of several tokens (x [B, T, H]): with ROWS_MLP and at most
    ROWS_GEMM_MAX_TOKENS tokens in all, the two products through rows_gemm with SiLU and the residual add
    inside; more tokens (prefills) keep cuBLAS."""
    tokens = x.shape[:-1].numel()
    if not ROWS_MLP or tokens > ROWS_GEMM_MAX_TOKENS:
        return x + layer.mlp(layer.post_layernorm(x))
    from pipeline.engine.fused_kernels import rows_gemm

    rows = x.view(tokens, -1)
    gated = rows_gemm(layer.post_layernorm(rows), layer.mlp.fc_gate.weight, gated=True)
    return rows_gemm(gated, layer.mlp.proj.weight, residual=rows).view_as(x)


def several_token_layer(layer: DecoderLayer, x: torch.Tensor, ctx: "ForwardContext", index: int) -> torch.Tensor:
    """DecoderLayer.forward for a graph step of several tokens of one sequence (x [1, T, H], ctx with a
    region): single_token_layer's six kernels for T rows, through rows_rope_store, slot_attention and
    rows_gemm, the norms inside the QKV and gate/up products."""
    from pipeline.engine.fused_kernels import rows_gemm, rows_rope_store, slot_attention

    a, mlp, norm, post = layer.attention, layer.mlp, layer.input_layernorm, layer.post_layernorm
    rows = x.view(-1, x.shape[-1])
    q = rows_rope_store(rows, a.qkv.weight, norm.weight, norm.eps, ctx.rotary.cos, ctx.rotary.sin,
                        ctx.positions.view(-1), ctx.slots.view(-1), ctx.cache.k, ctx.cache.v, index, a.num_heads)
    out = slot_attention(q.view(-1, a.num_heads, a.head_size), ctx.cache.k[index, 0], ctx.cache.v[index, 0],
                         *ctx.visible_slots())
    h = rows_gemm(out.view(rows.shape[0], -1), a.dense.weight, residual=rows)
    gated = rows_gemm(h, mlp.fc_gate.weight, gated=True, norm=post.weight, eps=post.eps)
    return rows_gemm(gated, mlp.proj.weight, residual=h).view_as(x)
