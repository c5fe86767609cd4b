"""The Llama building blocks the EAGLE drafts share, with attention over unrolled draft steps.

Unrolled ("training-time test") attention: at step s the query at position p belongs to the draft
chain rooted at j = p - s. It sees the teacher-forced keys of step 0 at positions <= j (the context
whose true features the runtime has) and, for each earlier step i in 1..s, the single key that step
produced at chain position j + i. Step 0 is therefore plain causal attention.
RoPE follows Hugging Face Llama (rotate_half, non-interleaved halves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float
    rms_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(length: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[..., p - n, :] at position p along dim -2 (zeros where p < n)."""
    if n == 0:
        return x
    return F.pad(x, (0, 0, n, 0))[..., : x.shape[-2], :]


def unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention for step s = len(keys) - 1; q [B,h,T,d], keys/values per step [B,h,T,d] (kv heads expanded)."""
    step = len(keys) - 1
    length = q.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    pos = torch.arange(length, device=q.device)
    context_ok = pos[None, :] <= pos[:, None] - step  # key k visible to query p when k <= p - step
    scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~context_ok, float("-inf"))]
    for i in range(1, step + 1):
        lag = step - i
        diag = (q * shift_right(keys[i], lag)).sum(-1, keepdim=True) * scale
        scores.append(diag.masked_fill((pos < lag)[:, None], float("-inf")))
    # At least float32 (half-precision training), float64 kept: a float32 softmax rounds by row length on some
    # CPUs, which broke the float64 check that the unrolled steps equal a sequential chain (1.9e-8 apart).
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=torch.promote_types(q.dtype, torch.float32))
    probs = probs.to(q.dtype)
    out = probs[..., :length] @ values[0]
    for i in range(1, step + 1):
        out = out + probs[..., length + i - 1 : length + i] * shift_right(values[i], step - i)
    return out


class Attention(nn.Module):
    """Llama GQA attention whose q/k/v read `in_dim` features (EAGLE-3 feeds 2 * hidden)."""

    def __init__(self, shape: LayerShape, in_dim: int) -> None:
        super().__init__()
        self.shape = shape
        hd = shape.head_dim
        self.q_proj = nn.Linear(in_dim, shape.heads * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, shape.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, shape.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(shape.heads * hd, shape.hidden, bias=False)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        hd, groups = self.shape.head_dim, self.shape.heads // self.shape.kv_heads
        k = self.k_proj(x).view(b, t, self.shape.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.shape.kv_heads, hd).transpose(1, 2)
        k = apply_rope(k, cos, sin)
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        """Appends this step's keys/values to `keys`/`values` (earlier steps' are already there)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.shape.heads, self.shape.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        keys.append(k)
        values.append(v)
        out = unrolled_attention(q, keys, values)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
