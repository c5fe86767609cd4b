"""Which of a model's work runs through our Triton kernels, on CUDA: attach() routes a model's modules, and
the fused decoder layer (fused_layer) chains the kernels of one step.

Levels (`SPECPIPE_KERNELS`, read by attach):
- gemv: every single-token product of a half-precision Linear goes through the GEMV kernel.
- fused (the default): a decoder layer's single token becomes four GEMVs and an attention of two kernels,
  the RMS norms inside the GEMVs that read them, rotary and the cache write inside the QKV GEMV, the residual
  adds inside the GEMVs that produce them. Its steps of up to 64 tokens (trees, batched decode rows) run the
  MLP as two rows_gemm kernels; small layers (SmolLM2's) take a tree step whole through the kernels, and so
  a batched step over the block pool (decode rows, every row's tree: paged_layer, up to
  paged_layer_max_tokens tokens). Other steps of more tokens (prefills) keep cuBLAS and SDPA. Layers the
  kernels do not cover (biases, other activations, head sizes that are not a power of two) keep the gemv
  level; a layer without an input norm (an EAGLE-1 draft's first) fuses with no norm in its QKV product.
- off: cuBLAS and SDPA everywhere.
attach(..., invariant=True) puts every product of a Linear (any row count) and every RMS norm on the
batch-invariant kernels of invariant.py instead of the GEMV, the fused layers and cuBLAS: a token's outputs are
then the same bits whatever the batch, tree or speculation around it (attention is the attention kernels' part).
At gemv and fused, the attention of graph steps (one token or several: trees, an EAGLE draft's passes) reads
only the slots in use through slot_attention, instead of SDPA over every cache slot with a mask.

A drafter's top-k's (EAGLE's nets, Medusa's heads) go through drafter_kernels: the LM head, log-softmax and
top-k in one kernel, and a tree's small top-k's in row_topk (`SPECPIPE_DRAFT_TOPK=torch`: torch's ops).
CPU models never change. With TRITON_INTERPRET=1 the kernels run on CPU tensors: the tests do that.
The kernel modules import Triton, so they are imported only where a route uses them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning
from pipeline.engine.model import Attention, DecoderLayer, Linear, RMSNorm
from pipeline.errors import UserError

if TYPE_CHECKING:
    from pipeline.engine.model import ForwardContext

KERNELS_ENV = "SPECPIPE_KERNELS"
LEVELS = ("fused", "gemv", "off")
DRAFT_TOPK_ENV = "SPECPIPE_DRAFT_TOPK"
DRAFT_TOPK_CHOICES = ("fused", "torch")
HALF_DTYPES = (torch.float16, torch.bfloat16)
INVARIANT_DTYPES = (*HALF_DTYPES, torch.float32)
CUDA_ONLY = ("cuda",)


def level() -> str:
    """The kernel level SPECPIPE_KERNELS asks for (default fused); off where Triton is not installed."""
    value = os.environ.get(KERNELS_ENV) or "fused"
    if value not in LEVELS:
        raise UserError(f"{KERNELS_ENV}={value}: use one of {', '.join(LEVELS)}")
    return value if importlib.util.find_spec("triton") is not None else "off"


def draft_topk_enabled() -> bool:
    """Whether SPECPIPE_DRAFT_TOPK lets drafters use their top-k kernels (fused, the default) or not (torch)."""
    value = os.environ.get(DRAFT_TOPK_ENV) or "fused"
    if value not in DRAFT_TOPK_CHOICES:
        raise UserError(f"{DRAFT_TOPK_ENV}={value}: use {' or '.join(DRAFT_TOPK_CHOICES)}")
    return value == "fused"


@dataclass(frozen=True)
class DrafterKernels:
    """A drafter's top-k's: through the kernels with `tuning`, or torch's ops where tuning is None."""

    tuning: KernelTuning | None = None

    @property
    def fused(self) -> bool:
        return self.tuning is not None

    def lm_head_topk_fits(self, rows: int, k: int) -> bool:
        """Whether lm_head_topk runs for `rows` rows and this k (else the caller runs torch's ops)."""
        return self.tuning is not None and self.tuning.lm_head_topk_fits(rows, k)

    def lm_head_topk(self, hidden: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities float32, tokens) [rows, k] of log_softmax(hidden @ weight.T).topk(k), in one
        kernel; only where lm_head_topk_fits."""
        from pipeline.engine.kernels.topk import lm_head_topk

        assert self.tuning is not None
        return lm_head_topk(hidden, weight, k, self.tuning)

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """torch.topk's (values, indices) over x's last dimension, through row_topk where it runs and the rows
        fit it (a tree's candidates: a few hundred to a few thousand)."""
        if self.tuning is None or x.shape[-1] > self.tuning.row_topk_max:
            return x.topk(k)
        from pipeline.engine.kernels.topk import row_topk

        return row_topk(x, k, self.tuning)


TORCH_TOPK = DrafterKernels()


class Drafter:
    """A draft network whose LM head feeds a tree's top-k's (EAGLE's nets): attach sets its `drafter`."""

    lm_head: nn.Linear
    drafter: DrafterKernels = TORCH_TOPK


def drafter_kernels(
    lm_head: torch.Tensor,
    kernels: str | None = None,
    device_types: tuple[str, ...] = CUDA_ONLY,
    draft_topk: bool | None = None,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> DrafterKernels:
    """The top-k's of a drafter (EAGLE's net, Medusa's heads) whose LM head is `lm_head`: the kernels at a level
    other than off (default: the environment's), with SPECPIPE_DRAFT_TOPK's fused (or draft_topk), on
    half-precision weights of device_types; else torch's ops."""
    kernels = kernels or level()
    draft_topk = draft_topk_enabled() if draft_topk is None else draft_topk
    if (
        kernels == "off"
        or not draft_topk
        or lm_head.device.type not in device_types
        or lm_head.dtype not in HALF_DTYPES
    ):
        return TORCH_TOPK
    return DrafterKernels(tuning)


@functools.cache
def _tuned(kernel: Callable[..., Any], tuning: KernelTuning) -> Callable[..., Any]:
    """kernel with `tuning` bound: one object for each pair, so that attaching again with the same tuning
    gives the modules the same callables (no recompilation of the graphs' compiled functions)."""
    return functools.partial(kernel, tuning=tuning)


def attach(
    model: nn.Module,
    kernels: str | None = None,
    device_types: tuple[str, ...] = CUDA_ONLY,
    draft_topk: bool | None = None,
    tuning: KernelTuning = DEFAULT_TUNING,
    invariant: bool = False,
) -> dict[str, int]:
    """Route `model`'s single-token work, and the attention of its graph steps, through the kernels at
    `kernels` (default: the environment's level) with `tuning`, and an EAGLE drafter's top-k's through
    drafter_kernels. Returns how many Linear layers use the GEMV, how many decoder layers run fused, how many
    attention layers read through slot_attention and how many drafters use the top-k kernels. Calling it again
    with another level or tuning re-routes (the benchmark compares levels on one model).
    invariant: every Linear and RMS norm on device_types (half precision or float32) runs the batch-invariant
    kernels for every row count, no GEMV and no fused layer; the counts add invariant_linears and
    invariant_norms."""
    kernels = kernels or level()
    invariant_counts = route_invariant(model, device_types, tuning if invariant else None)
    drafters = [m for m in model.modules() if isinstance(m, Drafter)]
    for m in drafters:
        m.drafter = drafter_kernels(m.lm_head.weight, kernels, device_types, draft_topk, tuning)
    attentions = [m for m in model.modules() if isinstance(m, Attention) and m.qkv.weight.device.type in device_types]
    slot_attention = None
    if kernels != "off" and attentions:
        from pipeline.engine.kernels.attention import slot_attention as attention_kernel

        slot_attention = _tuned(attention_kernel, tuning)
    for att in attentions:
        att.slot_attention = slot_attention if power_of_two(att.head_size) else None

    def eligible(lin: Linear) -> bool:
        return lin.weight.device.type in device_types and lin.weight.dtype in HALF_DTYPES

    linears = [m for m in model.modules() if isinstance(m, Linear) and eligible(m)]
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer) and eligible(m.mlp.proj)]
    gemv = None
    if kernels != "off" and linears and not invariant:
        from pipeline.engine.kernels.gemv import gemv as gemv_kernel

        gemv = _tuned(gemv_kernel, tuning)
    for lin in linears:
        lin.gemv = gemv
    fused = [m for m in layers if kernels == "fused" and not invariant and fusable(m)]
    for layer in layers:
        layer.fused = _tuned(fused_layer, tuning) if layer in fused else None
        small = layer.mlp.fc_gate.weight.numel() <= tuning.rows_small_weights
        layer.paged = _tuned(paged_layer, tuning) if layer in fused and tuning.paged_layer and small else None
    return {
        "gemv_layers": len(linears) if gemv else 0,
        "fused_layers": len(fused),
        "attention_layers": sum(m.slot_attention is not None for m in attentions),
        "draft_topk": sum(m.drafter.fused for m in drafters),
        **invariant_counts,
    }


def route_invariant(
    model: nn.Module, device_types: tuple[str, ...] = CUDA_ONLY, tuning: KernelTuning | None = None
) -> dict[str, int]:
    """Set (with a tuning) or clear (None) the batch-invariant hooks of `model`'s Linear layers and RMS norms on
    device_types in half precision or float32. Returns the counts routed, none when clearing."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if tuning is None:
        for lin in linears:
            lin.invariant = None
        for norm in norms:
            norm.invariant = None
        return {}
    if importlib.util.find_spec("triton") is None:
        raise UserError("batch-invariant kernels need Triton: install it or leave invariant off")
    from pipeline.engine.kernels.invariant import invariant_linear, invariant_rms_norm

    def eligible(weight: torch.Tensor) -> bool:
        return weight.device.type in device_types and weight.dtype in INVARIANT_DTYPES

    routed_linears = [m for m in linears if eligible(m.weight)]
    routed_norms = [m for m in norms if eligible(m.weight)]
    for lin in routed_linears:
        lin.invariant = _tuned(invariant_linear, tuning)
    for norm in routed_norms:
        norm.invariant = _tuned(invariant_rms_norm, tuning)
    return {"invariant_linears": len(routed_linears), "invariant_norms": len(routed_norms)}


def fusable(layer: DecoderLayer) -> bool:
    """Plain Llama layers, and those without an input norm (an EAGLE-1 draft's first)."""
    a, mlp = layer.attention, layer.mlp
    return (
        isinstance(layer.input_layernorm, (RMSNorm, nn.Identity))
        and mlp.act is torch.nn.functional.silu
        and all(lin.bias is None for lin in (a.qkv, a.dense, mlp.fc_gate, mlp.proj))
        and power_of_two(a.head_size)
    )


def power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def input_norm(layer: DecoderLayer) -> tuple[torch.Tensor | None, float]:
    """(weight, eps) of the layer's input RMS norm for the kernels' prologue; (None, 0) without one."""
    norm = layer.input_layernorm
    return (norm.weight, norm.eps) if isinstance(norm, RMSNorm) else (None, 0.0)


def fused_layer(
    layer: DecoderLayer, x: torch.Tensor, ctx: ForwardContext, index: int, tuning: KernelTuning = DEFAULT_TUNING
) -> torch.Tensor:
    """DecoderLayer.forward through the kernels: a single token's, and a tree step's of a small layer, all
    through (sequence_layer); other steps of several tokens from the MLP's norm on (several_token_mlp)."""
    tokens = x.shape[:-1].numel()
    if tokens == 1 or (
        tuning.rows_layer
        and ctx.region is not None
        and tokens <= tuning.rows_gemm_max_tokens
        and layer.attention.head_size >= tuning.tree_min_rows
        and layer.mlp.fc_gate.weight.numel() <= tuning.rows_small_weights
    ):
        return sequence_layer(layer, x, ctx, index, tuning)
    x = x + layer.attention(layer.input_layernorm(x), ctx, index)
    return several_token_mlp(layer, x, tuning)


def sequence_layer(
    layer: DecoderLayer, x: torch.Tensor, ctx: ForwardContext, index: int, tuning: KernelTuning = DEFAULT_TUNING
) -> torch.Tensor:
    """DecoderLayer.forward for a graph step of one sequence (x [1, T, H]: one token, or a tree with ctx's
    region) over its own cache through kernel_layer, the attention through slot_attention."""
    from pipeline.engine.kernels.attention import slot_attention

    k, v = ctx.cache.k, ctx.cache.v

    def attend(q: torch.Tensor) -> torch.Tensor:
        return slot_attention(q, k[index, 0], v[index, 0], *ctx.visible_slots(), tuning=tuning)

    return kernel_layer(layer, x, ctx, index, tuning, (k, v), attend)


def kernel_layer(
    layer: DecoderLayer,
    x: torch.Tensor,
    ctx: ForwardContext,
    index: int,
    tuning: KernelTuning,
    caches: tuple[torch.Tensor, torch.Tensor],
    attend: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """A layer's step all through the kernels, writing K and V into `caches` and attending through `attend`:
    one token through the GEMVs (gemv_layer), several through rows_gemm (rows_layer)."""
    route = gemv_layer if x.shape[:-1].numel() == 1 else rows_layer
    return route(layer, x, ctx, index, tuning, caches, attend)


def gemv_layer(
    layer: DecoderLayer,
    x: torch.Tensor,
    ctx: ForwardContext,
    index: int,
    tuning: KernelTuning,
    caches: tuple[torch.Tensor, torch.Tensor],
    attend: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """A layer's step for one token (x [1, 1, H]) through four GEMVs, the first with rotary and the write
    into `caches` (K and V as [layers, rows, slots, Hkv, D]) in it (tuning.rope_in_gemv; else a kernel of
    their own); the attention, attend(q [1, H, D]) -> [1, H, D]; SiLU-and-multiply inductor's, or in the
    third GEMV with tuning.gated_gemv."""
    from pipeline.engine.kernels.gemv import gemv, gemv_rope_store
    from pipeline.engine.kernels.rotary import rope_store

    a, mlp, post = layer.attention, layer.mlp, layer.post_layernorm
    norm, eps = input_norm(layer)
    h = x.view(-1)
    rope = (ctx.rotary.cos, ctx.rotary.sin, ctx.positions.view(-1), ctx.slots.view(-1), *caches, index, a.num_heads)
    if tuning.rope_in_gemv:
        q = gemv_rope_store(h, a.qkv.weight, norm, eps, *rope, tuning=tuning)
    else:
        q = rope_store(gemv(h, a.qkv.weight, norm, eps, tuning=tuning), *rope)
    out = attend(q.view(1, a.num_heads, a.head_size))
    h = gemv(out.view(-1), a.dense.weight, residual=h, tuning=tuning)
    if tuning.gated_gemv:
        gated = gemv(h, mlp.fc_gate.weight, post.weight, post.eps, gated=True, tuning=tuning)
    else:
        fc, gate = gemv(h, mlp.fc_gate.weight, post.weight, post.eps, tuning=tuning).chunk(2)
        gated = mlp.act(fc) * gate
    return gemv(gated, mlp.proj.weight, residual=h, tuning=tuning).view_as(x)


def several_token_mlp(layer: DecoderLayer, x: torch.Tensor, tuning: KernelTuning = DEFAULT_TUNING) -> torch.Tensor:
    """x + MLP(post_layernorm(x)) for a step of several tokens (x [B, T, H]): with tuning.rows_mlp and at most
    rows_gemm_max_tokens tokens in all, the two products through rows_gemm with SiLU and the residual add
    inside; more tokens (prefills) keep cuBLAS."""
    tokens = x.shape[:-1].numel()
    if not tuning.rows_mlp or tokens > tuning.rows_gemm_max_tokens:
        return x + layer.mlp(layer.post_layernorm(x))
    from pipeline.engine.kernels.rows import rows_gemm

    rows = x.view(tokens, -1)
    gated = rows_gemm(layer.post_layernorm(rows), layer.mlp.fc_gate.weight, gated=True, tuning=tuning)
    return rows_gemm(gated, layer.mlp.proj.weight, residual=rows, tuning=tuning).view_as(x)


def rows_layer(
    layer: DecoderLayer,
    x: torch.Tensor,
    ctx: ForwardContext,
    index: int,
    tuning: KernelTuning,
    caches: tuple[torch.Tensor, torch.Tensor],
    attend: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """A small layer's step for the tokens of x in six kernels: the QKV product with the input norm, rotary
    and the write into `caches` (K and V as [layers, rows, slots, Hkv, D]) through rows_rope_store; the
    attention, attend(q [tokens, H, D]) -> [tokens, H, D]; the output and MLP products through rows_gemm
    with the post-attention norm, SiLU and the residual adds inside."""
    from pipeline.engine.kernels.rows import rows_gemm, rows_rope_store

    a, mlp, post = layer.attention, layer.mlp, layer.post_layernorm
    norm, eps = input_norm(layer)
    rows = x.reshape(-1, x.shape[-1])
    q = rows_rope_store(
        rows,
        a.qkv.weight,
        norm,
        eps,
        ctx.rotary.cos,
        ctx.rotary.sin,
        ctx.positions.reshape(-1),
        ctx.slots.reshape(-1),
        *caches,
        index,
        a.num_heads,
        tuning=tuning,
    )
    out = attend(q.view(rows.shape[0], a.num_heads, a.head_size))
    h = rows_gemm(out.reshape(rows.shape[0], -1), a.dense.weight, residual=rows, tuning=tuning)
    gated = rows_gemm(h, mlp.fc_gate.weight, gated=True, norm=post.weight, eps=post.eps, tuning=tuning)
    return rows_gemm(gated, mlp.proj.weight, residual=h, tuning=tuning).view_as(x)


def paged_layer(
    layer: DecoderLayer, x: torch.Tensor, ctx: ForwardContext, index: int, tuning: KernelTuning = DEFAULT_TUNING
) -> torch.Tensor:
    """DecoderLayer.forward for a batched step over the block pool (x [B, T, H]: one token a row, or every
    row's tree) of a small layer through kernel_layer, writing the pool's slots, the attention through the
    paged kernel. Prefill chunks (no region), steps of more than paged_layer_max_tokens tokens and decode
    steps of rows outside paged_decode_rows take the library path."""
    from pipeline.engine.paged_attention import paged_attention

    paged, tokens = ctx.paged, x.shape[:-1].numel()
    assert paged is not None
    fewest, most = tuning.paged_decode_rows
    decode_off = x.shape[1] == 1 and not fewest <= x.shape[0] <= most
    if paged.region is None or tokens > tuning.paged_layer_max_tokens or decode_off:
        return layer.unfused(x, ctx, index)
    assert paged.prefix is not None and paged.count is not None
    pool, region, prefix, count = paged.pool, paged.region, paged.prefix, paged.count

    def attend(q: torch.Tensor) -> torch.Tensor:
        q = q.view(*x.shape[:-1], *q.shape[1:])
        return paged_attention(q, pool.k[index], pool.v[index], paged.table, prefix, region, count, pool.block_size)

    # The rotary kernels' cache layout, one row.
    return kernel_layer(layer, x, ctx, index, tuning, (pool.k[:, None], pool.v[:, None]), attend)
