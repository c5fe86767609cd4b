"""Held-out sanity numbers for the drafts: top-1 accuracy per depth and the mean chain acceptance.

`correct[n, p, k]` says the draft's top-1 at depth k+1 of the chain rooted at position p equals the
target's greedy token, given a chain whose earlier tokens were the target's. The chain accepts
tokens up to the first miss, plus the target's own token, so its mean acceptance length is
1 + E[number of leading hits]. A tree accepts more than this chain; the runtime measures that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChainStats:
    top1_per_depth: list[float]  # P(hit at depth k)
    conditional_per_depth: list[float]  # P(hit at depth k | hits at all shallower depths)
    mean_accept_length: float
    roots: int


def chain_stats(correct: torch.Tensor, valid: torch.Tensor) -> ChainStats:
    """correct: [..., K] bool; valid: [...] bool marking roots whose K depths all exist."""
    hits = correct[valid].float()  # [R, K]
    leading = hits.cumprod(dim=-1)
    depth = hits.shape[-1]
    cond = []
    for k in range(depth):
        reached = leading[:, k - 1].sum() if k else torch.tensor(float(len(hits)))
        cond.append(float(leading[:, k].sum() / reached.clamp(min=1)))
    return ChainStats(
        top1_per_depth=[round(float(v), 4) for v in hits.mean(0)],
        conditional_per_depth=[round(v, 4) for v in cond],
        mean_accept_length=round(1.0 + float(leading.sum(-1).mean()), 4),
        roots=len(hits),
    )


def depth_valid(lengths: torch.Tensor, prompt_lens: torch.Tensor, width: int, depth: int) -> torch.Tensor:
    """Roots p in the continuation (p >= prompt_len - 1) whose deepest teacher position p + depth exists."""
    pos = torch.arange(width, device=lengths.device)[None, :]
    return (pos >= prompt_lens[:, None] - 1) & (pos + depth < lengths[:, None])


def format_table(rows: dict[str, ChainStats]) -> str:
    depth = max(len(s.top1_per_depth) for s in rows.values())
    head = f"{'draft':<14}{'mean acc len':>13}{'roots':>8}  " + " ".join(f"{'d' + str(k + 1):>6}" for k in range(depth))
    lines = [head, "-" * len(head)]
    for name, s in rows.items():
        lines.append(
            f"{name:<14}{s.mean_accept_length:>13.3f}{s.roots:>8}  "
            + " ".join(f"{v:>6.3f}" for v in s.conditional_per_depth)
        )
    lines.append("d<k>: top-1 acceptance at chain depth k given all shallower depths accepted (held-out)")
    return "\n".join(lines)
