"""Llama-family transformer over TensorRT-LLM checkpoint names, with a static KV cache.

One forward serves prefill, plain decode and tree verification: the caller says where each new
token sits (`positions`, for RoPE), which cache slot it writes (`slots`), and which slots it may
read (`mask`). A tree node's position is prefix + depth while its slot is prefix + node index, so
siblings share a position but never a slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine.kv_cache import BlockPool, PagedView
from pipeline.errors import UserError

SUPPORTED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    norm_epsilon: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    hidden_act: str = "silu"
    qkv_bias: bool = False
    dense_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_pretrained_config(cls, cfg: dict[str, Any], tensor_names: set[str] | None = None) -> ModelConfig:
        """Read TensorRT-LLM's LLaMA config fields; biases follow the tensors actually present."""
        names = tensor_names or set()
        heads = cfg["num_attention_heads"]
        try:
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_size=cfg.get("head_size") or cfg["hidden_size"] // heads,
                intermediate_size=cfg["intermediate_size"],
                norm_epsilon=cfg.get("norm_epsilon", 1e-5),
                rope_theta=cfg.get("rotary_base", 10000.0),
                rope_scaling=cfg.get("rotary_scaling"),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                hidden_act=cfg.get("hidden_act", "silu"),
                qkv_bias=any(n.endswith("attention.qkv.bias") for n in names),
                dense_bias=any(n.endswith("attention.dense.bias") for n in names),
                mlp_bias=any(n.endswith("mlp.fc.bias") for n in names),
            )
        except KeyError as exc:
            raise UserError(f"config.json: missing field {exc.args[0]!r}; reconvert the checkpoint") from None


# ---------------------------------------------------------------------------------------------
# Rotary embedding


def rope_inv_freq(head_size: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies for RoPE, with Hugging Face's `linear` and `llama3` scalings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default" or scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= original / low) & (wavelen >= original / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise UserError(f"rotary_scaling type {kind!r} is not supported; supported: default, linear, llama3")


class Rotary(nn.Module):
    """cos/sin tables for every position, gathered per token (positions may repeat in a tree)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_size: int, theta: float, scaling: dict[str, Any] | None, max_positions: int):
        super().__init__()
        self.head_size = head_size
        inv_freq = rope_inv_freq(head_size, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, T, heads, D]; positions: [B, T]. GPT-NeoX (rotate-half) layout, as HF Llama."""
        cos = self.cos[positions].unsqueeze(2).to(x.dtype)
        sin = self.sin[positions].unsqueeze(2).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Preallocated per-layer K/V indexed by slot: [layers, batch, slots, kv_heads, head_size].

    Rolling back rejected draft tokens costs nothing: their slots are masked and overwritten.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch: int,
        slots: int,
        kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (num_layers, batch, slots, kv_heads, head_size)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_slots(self) -> int:
        return self.k.shape[2]

    def rows(self, start: int, stop: int) -> KVCache:
        """A view of batch rows [start, stop): writes through it land in this cache."""
        return KVCache(self.k[:, start:stop], self.v[:, start:stop])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # One index_put_ on the whole tensor: assigning through self.k[layer] (a view) makes
        # torch.compile copy every layer's cache out and back each step, a cost that grows with slots.
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
        layers = torch.full_like(slots, layer)
        self.k.index_put_((layers, rows, slots), k)
        self.v.index_put_((layers, rows, slots), v)

    def read(self, layer: int, attn_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :, :attn_len], self.v[layer, :, :attn_len]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src -> dst (batch 0) in every layer: compacts an accepted tree path."""
        self.k[:, 0, dst] = self.k[:, 0, src]
        self.v[:, 0, dst] = self.v[:, 0, src]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` slots of batch row src into row dst (a request changing rows)."""
        self.k[:, dst, :length] = self.k[:, src, :length]
        self.v[:, dst, :length] = self.v[:, src, :length]


# ---------------------------------------------------------------------------------------------
# Layers (parameter names follow the TensorRT-LLM checkpoint)


class RMSNorm(nn.Module):
    # kernels.invariant's norm (x, weight, eps) when kernels.routing.attach asked for batch-invariant outputs
    invariant: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            return self.invariant(x, self.weight, self.eps)
        # Normalise in float32 like Hugging Face, then cast back: bf16 variance loses digits.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear whose single-token products may go through our GEMV kernel, or all its products through the
    batch-invariant kernel (set by kernels.routing.attach on CUDA), and whose CPU products go through oneDNN
    (set by onednn.pack); otherwise F.linear."""

    gemv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    packed: torch.Tensor | None = None  # CPU: the weight as oneDNN reordered it (onednn.pack)
    # kernels.invariant's product (x [M, K], weight, bias) for every row count, when kernels.routing.attach
    # asked for batch-invariant outputs
    invariant: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed, self.bias, "none", [], "")
            return y.view(*x.shape[:-1], -1)
        if self.invariant is not None:
            return self.invariant(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], -1)
        if self.gemv is None or x.shape[:-1].numel() != 1:
            return F.linear(x, self.weight, self.bias)
        y = self.gemv(x.reshape(-1), self.weight).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Attention(nn.Module):
    # kernels.attention.slot_attention when kernels.routing.attach routed this layer's graph-step attention to it
    slot_attention: Callable[..., torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, in_features: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_size
        self.qkv = Linear(in_features or cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.dense = Linear(cfg.num_heads * cfg.head_size, cfg.hidden_size, bias=cfg.dense_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.rotate_and_store(self.qkv(x), ctx, layer)
        if ctx.paged is not None:
            return self.dense(self.paged_attention(q, ctx.paged, ctx.mask, layer).reshape(b, t, -1))
        if self.slot_attention is not None and ctx.region is not None:  # reads only the slots in use
            out = self.slot_attention(q[0], ctx.cache.k[layer, 0], ctx.cache.v[layer, 0], *ctx.visible_slots())
            return self.dense(out.view(b, t, -1))
        assert isinstance(ctx.cache, KVCache), "a block pool is read through ctx.paged"
        keys, values = ctx.cache.read(layer, ctx.attn_len)
        q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if q.is_cuda and self.num_kv_heads != self.num_heads and not ctx.is_causal:
            out = grouped_query_attention(q, keys, values, ctx.mask)
        else:
            out = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=ctx.mask,
                is_causal=ctx.is_causal,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
        return self.dense(out.transpose(1, 2).reshape(b, t, -1))

    def paged_attention(self, q: torch.Tensor, paged: PagedView, mask: torch.Tensor | None, layer: int) -> torch.Tensor:
        """q [B, T, H, D] over each row's cached sequence in the block pool -> [B, T, H, D]. Decode and tree
        steps on CUDA go through the paged kernel; otherwise each row's sequence is gathered for SDPA."""
        pool = paged.pool
        if paged_kernel(paged, self.head_size):
            from pipeline.engine.paged_attention import paged_attention

            assert paged.prefix is not None and paged.count is not None
            return paged_attention(
                q, pool.k[layer], pool.v[layer], paged.table, paged.prefix, paged.region, paged.count, pool.block_size
            )
        keys, values = pool.gather(layer, paged.table, paged.attn_len)
        if mask is None:  # the context left it to the kernel: a head size the kernel does not take
            mask = paged_mask(paged)[:, None]
        q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if self.num_kv_heads != self.num_heads:
            return grouped_query_attention(q, keys, values, mask).transpose(1, 2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).transpose(1, 2)

    def rotate_and_store(self, qkv: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        """qkv [B, T, (H + 2 Hkv) D]: rotates q and k, writes k and v to the cache; returns q [B, T, H, D]."""
        b, t, _ = qkv.shape
        rotated = self.num_heads + self.num_kv_heads  # q and k heads sit side by side: one rotary call
        qk, v = qkv.split([rotated * self.head_size, self.num_kv_heads * self.head_size], -1)
        q, k = ctx.rotary(qk.view(b, t, rotated, self.head_size), ctx.positions).split(
            [self.num_heads, self.num_kv_heads], 2
        )
        ctx.cache.write(layer, ctx.slots, k, v.view(b, t, self.num_kv_heads, self.head_size))
        return q


def grouped_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [B, H, T, D] over k, v [B, Hkv, S, D]: each kv head's query group folded into its rows.

    SDPA with enable_gqa and a mask falls back to a path that copies K and V once per query head (CUDA;
    on the CPU too it is slower); folding the group (query head h reads kv head h // group) reads them once.
    """
    b, h, t, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    if mask is not None:
        mask = mask.expand(b, 1, t, mask.shape[-1])[:, :, None].expand(b, 1, group, t, mask.shape[-1])
        mask = mask.reshape(b, 1, group * t, -1)
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, group * t, d), k, v, attn_mask=mask)
    return out.reshape(b, h, t, d)


class MLP(nn.Module):
    """proj(act(fc(x)) * gate(x)); fc (HF gate_proj) and gate (HF up_proj) run as one fused GEMM."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc_gate = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = SUPPORTED_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc, gate = self.fc_gate(x).chunk(2, dim=-1)
        return self.proj(self.act(fc) * gate)


class DecoderLayer(nn.Module):
    # kernels.routing.fused_layer / paged_layer when kernels.routing.attach routed this layer's steps (one
    # sequence's, a batch's over the block pool) to the kernels
    fused: Callable[[DecoderLayer, torch.Tensor, ForwardContext, int], torch.Tensor] | None = None
    paged: Callable[[DecoderLayer, torch.Tensor, ForwardContext, int], torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, input_norm: bool = True):
        super().__init__()
        # EAGLE-1 draft layers skip the input norm: their input is already a fused feature.
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon) if input_norm else nn.Identity()
        self.attention = Attention(cfg)
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        routed = self.fused if ctx.paged is None else self.paged
        if routed is not None:
            return routed(self, x, ctx, layer)
        return self.unfused(x, ctx, layer)

    def unfused(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), ctx, layer)
        return x + self.mlp(self.post_layernorm(x))


@dataclass
class ForwardContext:
    """Where the new tokens sit and what they may read; shared by every layer of one forward."""

    positions: torch.Tensor  # [B, T] RoPE positions
    slots: torch.Tensor  # [B, T] cache slots written
    cache: KVCache | BlockPool  # written at `slots` by each layer
    attn_len: int  # slots [0, attn_len) are read
    mask: torch.Tensor | None  # [B, 1, T, attn_len] bool, True = may attend; None with is_causal or all-visible
    is_causal: bool
    rotary: Rotary
    # full_slot_context's terms, for the kernel that reads only the slots in use (batch 1): the
    # device length and the rows [T, R] of the region past it.
    length: torch.Tensor | None = None
    region: torch.Tensor | None = None
    paged: PagedView | None = None  # rows of a batch reading the block pool through their block tables

    def visible_slots(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(length, rows) for kernels.attention.slot_attention. One token whose region is its own slot
        (every decode step), or a context without a region, reads every slot up to its own: (its
        slot, None), no mask to load. Every builder here lets a single token see exactly those."""
        if self.region is None or self.region.shape == (1, 1):
            return self.slots.view(-1)[:1], None
        assert self.length is not None, "a context with a region carries its length"
        return self.length, self.region


def attention_mask(prefix_len: int, tree_mask: torch.Tensor, attn_len: int) -> torch.Tensor:
    """[1, 1, T, attn_len]: every new token sees the whole prefix, and the new tokens `tree_mask` allows."""
    t = tree_mask.shape[0]
    mask = torch.zeros(t, attn_len, dtype=torch.bool, device=tree_mask.device)
    mask[:, :prefix_len] = True
    mask[:, prefix_len : prefix_len + t] = tree_mask
    return mask[None, None]


def make_context(
    cache: KVCache, rotary: Rotary, prefix_len: int, positions: torch.Tensor, tree_mask: torch.Tensor | None
) -> ForwardContext:
    """Context for T new tokens written to slots prefix_len..prefix_len+T-1 (batch 1).

    tree_mask None means causal among the new tokens; a single token needs no mask at all.
    """
    t = positions.shape[-1]
    slots = torch.arange(prefix_len, prefix_len + t, device=positions.device)[None]
    attn_len = prefix_len + t
    if tree_mask is None and (t == 1 or prefix_len == 0):
        return ForwardContext(positions.view(1, t), slots, cache, attn_len, None, t > 1, rotary)
    if tree_mask is None:
        tree_mask = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    return ForwardContext(
        positions.view(1, t), slots, cache, attn_len, attention_mask(prefix_len, tree_mask, attn_len), False, rotary
    )


def full_slot_context(
    cache: KVCache,
    rotary: Rotary,
    length: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    slot_ids: torch.Tensor,
) -> ForwardContext:
    """Like make_context, but reading every cache slot and taking the prefix length as a device
    tensor, so that the same kernels serve every step of a replayed CUDA graph.

    New token i (at `slots[i]`, RoPE position `positions[i]`) sees slot s when s < length (the
    accepted text) or when s = length + j and rows[i, j] (a region of S = rows.shape[1] slots past
    the text: a tree's own nodes, or the earlier tokens of a causal run)."""
    region = rows.shape[1]
    rel = slot_ids - length
    in_region = (rel >= 0) & (rel < region)
    mask = (rel < 0) | (rows[:, rel.clamp(0, region - 1)] & in_region)  # [T, slots]
    return ForwardContext(
        positions[None], slots[None], cache, cache.num_slots, mask[None, None], False, rotary, length, rows
    )


def decode_context(cache: KVCache, rotary: Rotary, lengths: torch.Tensor, attn_len: int) -> ForwardContext:
    """One new token per batch row, at slot and position lengths[b]; row b reads slots [0, lengths[b]]."""
    positions = lengths[:, None]
    visible = torch.arange(attn_len, device=lengths.device)[None, :] <= positions
    return ForwardContext(positions, positions, cache, attn_len, visible[:, None, None, :], False, rotary)


def paged_kernel(view: PagedView, head_size: int) -> bool:
    """Whether attention over `view` runs the paged kernel (decode and tree steps on CUDA), which reads
    the prefix and region itself; otherwise each row's sequence is gathered for SDPA under a mask."""
    return view.positions.is_cuda and view.region is not None and head_size & (head_size - 1) == 0


def paged_mask(view: PagedView) -> torch.Tensor:
    """[B, T, attn_len] bool: token t of row b may read sequence index i (see paged_context)."""
    ids = torch.arange(view.attn_len, device=view.positions.device)
    if view.region is None:
        return ids <= view.positions[:, :, None]
    assert view.prefix is not None and view.count is not None
    used = torch.arange(view.region.shape[-1], device=ids.device) < view.count[..., None]
    in_region = ((ids == view.region[..., None]) & used[..., None]).any(-2)
    return (ids < view.prefix[..., None]) | in_region


def paged_context(view: PagedView, rotary: Rotary) -> ForwardContext:
    """Context for a batched step over the block pool. Token t of row b (at view.positions[b, t]) reads its
    row's sequence below view.prefix[b, t] and then its region (decode, tree and prefill steps; a prefill
    token's region is its own slot), or, without a region, every index up to and including its own position.
    The mask is built only where no paged kernel reads the region itself (the CPU): a captured step that is
    not compiled would otherwise build it, unread, in every replay."""
    if view.region is not None:
        assert view.prefix is not None and view.count is not None
        # Contiguous once here, in the step's graph, rather than a copy in every layer's attention call.
        prefix, region, count = view.prefix.contiguous(), view.region.contiguous(), view.count.contiguous()
        view = replace(view, prefix=prefix, region=region, count=count)
    mask = None if paged_kernel(view, rotary.head_size) else paged_mask(view)[:, None]
    return ForwardContext(view.positions, view.slots, view.pool, view.attn_len, mask, False, rotary, paged=view)


class Transformer(nn.Module):
    """The target (and draft-model) network. Returns final-norm hidden states; logits on demand."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.vocab_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def new_cache(self, slots: int, batch: int = 1) -> KVCache:
        p = self.lm_head.weight
        return KVCache.allocate(
            self.cfg.num_layers, batch, slots, self.cfg.num_kv_heads, self.cfg.head_size, p.dtype, p.device
        )

    def forward(
        self, tokens: torch.Tensor, ctx: ForwardContext, capture: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [B, T] -> (final hidden [B, T, H], residual stream after each layer in `capture`)."""
        x = self.vocab_embedding(tokens)
        outputs: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, i)
            if i in capture:
                outputs[i] = x
        # In the order asked, repeats kept: small models can map two capture points to one layer.
        return self.ln_f(x), [outputs[i] for i in capture]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
