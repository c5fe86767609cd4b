"""Medusa: extra decoding heads on the target's last hidden state propose top-k tokens per depth.

Head h applied to the hidden state that produced token t+1 guesses token t+2+h. Every node at
depth d of the tree takes the rank-th best guess of head d-1, so one head call per step fills the
whole tree. The tree is static (medusa_choices, as TensorRT-LLM runs it) or dynamic (portable engine
only): EAGLE-2's selection over the heads' log-probabilities, a path's score being the sum of its
tokens' log-probabilities under their heads, so each step spends its nodes where the heads are sure.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine.acceptance import Acceptance
from pipeline.engine.config import DynamicTreeConfig
from pipeline.engine.kernels.routing import drafter_kernels
from pipeline.engine.model import SUPPORTED_ACTIVATIONS, Linear
from pipeline.engine.spec_step import Chunk, Drafting, Tier, Trees, Verified
from pipeline.engine.speculative import StepInput, TargetPass
from pipeline.engine.tree import Candidates, DraftTree, TreeBuffers, select_tree, select_trees


class ResBlock(nn.Module):
    def __init__(self, hidden: int, act: str):
        super().__init__()
        self.linear = Linear(hidden, hidden)
        self.act = SUPPORTED_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_layers: int, act: str):
        super().__init__()
        self.medusa_layers = nn.ModuleList(ResBlock(hidden, act) for _ in range(num_layers))
        self.lm_head: Linear | None = Linear(hidden, vocab, bias=False)  # None: the target's (MedusaProposer)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head's input."""
        for block in self.medusa_layers:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "a head without its LM head feeds MedusaProposer's shared one"
        return self.lm_head(self.features(x))


def medusa_heads(num_heads: int, num_layers: int, hidden: int, vocab: int, act: str) -> nn.ModuleList:
    """Module names match the checkpoint: medusa_heads.{h}.medusa_layers.{l}.linear, medusa_heads.{h}.lm_head."""
    return nn.ModuleList(MedusaHead(hidden, vocab, num_layers, act) for _ in range(num_heads))


class MedusaProposer:
    capture_layers: tuple[int, ...] = ()
    runs_ahead = True
    # The heads read only static buffers, so on CUDA a greedy step (heads, verification, compaction)
    # is one graph replay: launched one by one, the heads' ~20 small kernels cost the H200's host
    # more than the device spends on them (SmolLM2 on the H200: 2.14 ms a step against 1.29 ms busy; in
    # one replay 1.32 ms).
    drafts_from_buffers = True

    def __init__(
        self,
        heads: nn.ModuleList,
        tree: TreeBuffers | None,
        lm_head: Linear | None = None,
        dynamic: DynamicTreeConfig | None = None,
        max_draft_len: int = 0,
    ):
        """tree: the static tree, or None with `dynamic` (and max_draft_len nodes kept a step).
        lm_head: one LM head for every head (the target's, when the heads' copies equal it), so that a
        step reads it once for all depths instead of once a head: on the CPU four float32 copies of
        SmolLM2's are 453 MB of reads a step beside the target's 540 (Medusa 10.6 -> 11.5 tok/s)."""
        self.tree, self.dynamic = tree, dynamic
        self.max_draft_len = tree.num_nodes - 1 if tree is not None else max_draft_len
        if tree is not None:
            depth = tree.max_depth
        else:
            assert dynamic is not None, "a Medusa proposer needs a static tree or a dynamic one"
            depth = min(dynamic.depth, len(heads))
        self.heads = heads[:depth]  # deeper heads have no node to fill
        self.lm_head = lm_head
        if tree is not None:
            self.top_k = int(tree.ranks.max()) + 1
            self.node_head = (tree.depths - 1).clamp(min=0)
            self.max_nodes = tree.num_nodes
        else:
            assert dynamic is not None
            self.top_k = dynamic.top_k
            self.width = min(dynamic.top_k, dynamic.max_non_leaves_per_layer)
            self.max_nodes = max_draft_len + 1
        first = self.heads[0]
        assert isinstance(first, MedusaHead)
        shared = lm_head or first.lm_head
        assert shared is not None, "the heads' own LM heads were dropped for a shared one"
        weight = shared.weight
        self.vocab_size = weight.shape[0]
        self.hidden = weight.new_zeros(1, weight.shape[1])  # [1, H] hidden state of the last accepted token
        # A dynamic tree's top-k's through EAGLE's kernels where they run (CUDA, half precision): the heads'
        # shared LM head, log-softmax and top-k in one, the frontier's and the selection's in row_topk.
        self.drafter = drafter_kernels(weight)
        self.root = torch.zeros(1, dtype=torch.long, device=weight.device)

    def start(self, prompt: torch.Tensor, target: TargetPass, first: torch.Tensor) -> None:
        self.hidden.copy_(target.hidden[-1:])

    def logits(self) -> torch.Tensor:
        """[depth, vocab]: head d's logits for the token d+1 places after the root."""
        if self.lm_head is not None:
            return self.lm_head(self.features())
        return torch.cat([head(self.hidden) for head in self.heads])

    def features(self) -> torch.Tensor:
        """[depth, H]: the shared LM head's input for each head."""
        # self.heads holds MedusaHeads (medusa_heads), which an nn.ModuleList's type cannot say
        return torch.cat([cast(MedusaHead, head).features(self.hidden) for head in self.heads])

    def top_logp(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[depth, top_k] (log-probabilities, tokens) of each head's likeliest tokens, best first."""
        if self.lm_head is None or not self.drafter.lm_head_topk_fits(len(self.heads), self.top_k):
            return F.log_softmax(self.logits().float(), dim=-1).topk(self.top_k, dim=-1)
        return self.drafter.lm_head_topk(self.features(), self.lm_head.weight, self.top_k)

    def _topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.topk(x, k)

    def guesses(self) -> torch.Tensor:
        """[depth, top_k] token ids: head d's best guesses for the token d+1 places after the root."""
        return self.logits().topk(self.top_k, dim=-1).indices

    def propose(self, step: StepInput) -> DraftTree:
        self.prepare(step)
        return self.draft()

    def prepare(self, step: StepInput) -> None:
        self.root.copy_(step.root)

    def draft(self) -> DraftTree:
        """The tree from the static buffers alone (see drafts_from_buffers)."""
        if self.tree is None:
            return DraftTree(*self._dynamic(), len(self.heads))
        tokens = self.guesses()[self.node_head, self.tree.ranks]
        return DraftTree.from_buffers(torch.cat([self.root, tokens[1:]]), self.tree)

    def _dynamic(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidates depth by depth, each frontier node taking head d's top-k as its children (the heads
        see only the root's hidden state, so every parent gets the same ones); the `width` best of a depth
        are the next frontier, as in EAGLE-2, and select_tree keeps the max_draft_len best of all."""
        logp, token = self.top_logp()  # [depth, k]
        k, width = self.top_k, self.width
        cands = Candidates.of_root(token[0], logp[0])
        frontier = self._topk(logp[0], width)[1]
        for depth in range(1, len(self.heads)):
            child_score = (torch.cat(cands.scores)[frontier][:, None] + logp[depth]).flatten()  # [width * k]
            first = cands.add(token[depth].repeat(width), frontier.repeat_interleave(k), child_score)
            frontier = first + self._topk(child_score, width)[1]
        return select_tree(self.root, *cands.joined(), self.max_draft_len, len(self.heads), self._topk)

    def update(
        self,
        tree: DraftTree,
        acc: Acceptance,
        num_accepted: int | torch.Tensor,
        target: TargetPass,
        length: int | torch.Tensor,
    ) -> None:
        torch.index_select(target.hidden, 0, acc.last_node, out=self.hidden)


class MedusaRows:
    """Medusa in batched form (spec_step.BatchProposer): each request's state is the target's hidden state
    at its last accepted token, one row of `hidden`; a step's heads run over every row at once."""

    capture_layers: tuple[int, ...] = ()
    host_drafts = 0

    def __init__(self, heads: nn.ModuleList, lm_head: Linear | None, tiers: list[Tier], state_rows: int):
        self.tiers = tiers
        depth = max(t.depth for t in tiers)
        self.heads = heads[:depth]
        self.lm_head = lm_head
        self.top_k = max(int(t.tree.ranks.max()) + 1 for t in tiers if t.dynamic is None)
        first = cast(MedusaHead, heads[0])
        weight = (lm_head or first.lm_head or lm_head_missing()).weight
        self.hidden = weight.new_zeros(state_rows, weight.shape[1])

    def host_draft(self, history: list[int]) -> list[int]:
        return []

    def prefill(self, chunk: Chunk) -> None:
        if chunk.first is not None:
            self.hidden.index_copy_(0, chunk.state, chunk.hidden.index_select(0, chunk.last))

    def draft(self, rows: Drafting, tier: Tier) -> tuple[torch.Tensor, Trees]:
        if tier.depth == 0:
            return rows.roots[:, None], tier.trees
        hidden = self.hidden[rows.state]  # [B, H]
        heads = [cast(MedusaHead, h) for h in self.heads[: tier.depth]]
        if self.lm_head is not None:
            logits = self.lm_head(torch.stack([h.features(hidden) for h in heads], dim=1))
        else:
            logits = torch.stack([h(hidden) for h in heads], dim=1)  # [B, depth, V]
        if tier.dynamic is not None:
            return self._dynamic(rows, tier, tier.dynamic, logits)
        guesses = logits.topk(self.top_k, dim=-1).indices  # [B, depth, k]
        node_head = (tier.tree.depths - 1).clamp(min=0)
        tokens = guesses[:, node_head, tier.tree.ranks]  # [B, T]
        return torch.cat([rows.roots[:, None], tokens[:, 1:]], dim=1), tier.trees

    @staticmethod
    def _dynamic(
        rows: Drafting, tier: Tier, cfg: DynamicTreeConfig, logits: torch.Tensor
    ) -> tuple[torch.Tensor, Trees]:
        """MedusaProposer._dynamic for every row at once: head d's top-k are the children of the `width` best
        nodes of depth d, and each row keeps its tier.num_nodes - 1 likeliest candidates."""
        logp, token = F.log_softmax(logits.float(), dim=-1).topk(cfg.top_k, dim=-1)  # [B, depth, k]
        k = cfg.top_k
        width = min(cfg.top_k, cfg.max_non_leaves_per_layer)
        cands = Candidates.of_root(token[:, 0], logp[:, 0])
        frontier = logp[:, 0].topk(width)[1]  # [B, width] candidate ids
        for depth in range(1, tier.depth):
            scores = torch.cat(cands.scores, 1)  # every candidate's path log-probability, by candidate id
            child_score = (scores.gather(1, frontier)[:, :, None] + logp[:, depth, None, :]).flatten(1)
            first = cands.add(token[:, depth].repeat(1, width), frontier.repeat_interleave(k, dim=1), child_score)
            frontier = first + child_score.topk(width)[1]
        tokens, parents, depths, paths = select_trees(rows.roots, *cands.joined(), tier.num_nodes, tier.depth)
        return tokens, Trees.of(depths, parents, paths)

    def accepted(self, rows: Drafting, tier: Tier, result: Verified) -> None:
        last = result.path.gather(1, result.num_accepted[:, None])  # [B, 1] the deepest accepted node
        hidden = result.hidden.gather(1, last[:, :, None].expand(-1, -1, result.hidden.shape[-1]))[:, 0]
        self.hidden.index_copy_(0, rows.state, hidden)


def lm_head_missing() -> Linear:
    raise AssertionError("Medusa heads without their LM heads need the shared one")
