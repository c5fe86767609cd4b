"""N-gram (prompt lookup) drafting: continue the latest earlier occurrence of the last n tokens.

No weights: the history (prompt + output) is searched on the host for the longest suffix of
length max_n..min_n that occurred before, and the up-to-k tokens that followed it are proposed
as a chain. With no match the step is a plain decode step.
"""

from __future__ import annotations

import torch

from pipeline.engine.acceptance import Acceptance
from pipeline.engine.config import NgramConfig
from pipeline.engine.spec_step import DRAFT_TOKENS, Chunk, Drafting, Tier, Trees, Verified
from pipeline.engine.speculative import StepInput, TargetPass
from pipeline.engine.tree import DraftTree, chain_buffers


def lookup(history: list[int], cfg: NgramConfig) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest matching suffix."""
    size = len(history)
    for n in range(min(cfg.max_n, size - 1), cfg.min_n - 1, -1):
        suffix = history[size - n :]
        for start in range(size - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + cfg.k]
    return []


class NgramProposer:
    capture_layers: tuple[int, ...] = ()
    runs_ahead = False  # it reads the emitted text
    drafts_from_buffers = False

    def __init__(self, cfg: NgramConfig, device: torch.device | str):
        self.cfg = cfg
        self.device = device
        self.chains = [chain_buffers(n, device) for n in range(cfg.k + 1)]
        self.max_nodes = cfg.k + 1

    def start(self, prompt: torch.Tensor, target: TargetPass, first: torch.Tensor) -> None:
        pass

    def propose(self, step: StepInput) -> DraftTree:
        guess = lookup(step.history, self.cfg)
        tokens = torch.cat([step.root, torch.tensor(guess, dtype=torch.long, device=self.device)])
        return DraftTree.from_buffers(tokens, self.chains[len(guess)])

    def update(
        self,
        tree: DraftTree,
        acc: Acceptance,
        num_accepted: int | torch.Tensor,
        target: TargetPass,
        length: int | torch.Tensor,
    ) -> None:
        pass


class NgramRows:
    """Prompt lookup in batched form (spec_step.BatchProposer): the host looks each row's chain up in its
    text and sends it with the step; chains shorter than the tier leave the rest of its nodes invalid."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, cfg: NgramConfig, tiers: list[Tier]):
        self.cfg, self.tiers = cfg, tiers
        self.host_drafts = cfg.k

    def host_draft(self, history: list[int]) -> list[int]:
        return lookup(history, self.cfg)

    def prefill(self, chunk: Chunk) -> None:
        pass

    def draft(self, rows: Drafting, tier: Tier) -> tuple[torch.Tensor, Trees]:
        drafts = rows.drafts[:, DRAFT_TOKENS : DRAFT_TOKENS + tier.depth]
        return torch.cat([rows.roots[:, None], drafts], dim=1), tier.trees

    def accepted(self, rows: Drafting, tier: Tier, result: Verified) -> None:
        pass
