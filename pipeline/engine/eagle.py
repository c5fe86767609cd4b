"""EAGLE drafting: a one-layer draft network that runs on the target's features.

Pairing (EAGLE-1/2 and EAGLE-3 alike): draft position j takes (token j+1, feature j) and its
output approximates feature j+1, whose logits guess token j+2. Feature j is the target's final
hidden state (EAGLE-1/2) or three of its layers concatenated (EAGLE-3) while j is accepted text,
and the draft's own output inside the tree being drafted.

After each verification the draft "catches up" on the accepted path with the target's true
features, overwriting the slots its tree guesses used, so its KV cache always holds exactly the
accepted text. Trees are static (eagle_choices) or dynamic (EAGLE-2: expand the top-k of the
best `frontier` nodes per depth, then keep the max_draft_len nodes of highest path probability).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine.acceptance import Acceptance
from pipeline.engine.config import DynamicTreeConfig
from pipeline.engine.model import (Attention, DecoderLayer, ForwardContext, KVCache, MLP, ModelConfig, RMSNorm,
                                   Rotary, make_context)
from pipeline.engine.speculative import StepInput, TargetPass
from pipeline.engine.tree import DraftTree, TreeBuffers, ancestor_mask

# Subtracted per depth from path scores so that a child never outranks its parent on a tie:
# the kept set of an EAGLE-2 tree is then always closed under prefixes.
DEPTH_TIE_BREAK = 1e-4


class EagleNet(nn.Module):
    """EAGLE-1/2 draft: fc(concat(embed(token), feature)) -> Llama decoder layers (layer 0 without input norm)."""

    def __init__(self, cfg: ModelConfig, fc_bias: bool = True):
        super().__init__()
        self.cfg = cfg
        self.num_cache_layers = cfg.num_layers
        self.vocab_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, input_norm=i > 0) for i in range(cfg.num_layers))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def target_features(self, target: TargetPass) -> torch.Tensor:
        return target.hidden

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.fc(torch.cat([self.vocab_embedding(tokens), features], dim=-1))
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, i)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class Eagle3Layer(nn.Module):
    """EAGLE-3 midlayer: attention over concat(norm(embedding), norm(feature)), residual on the feature."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.attention = Attention(cfg, in_features=2 * cfg.hidden_size)
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        h = feature + self.attention(x, ctx, 0)
        return h + self.mlp(self.post_layernorm(h))


class Eagle3Net(nn.Module):
    """EAGLE-3 draft: fuses three target layers with fc, own final norm, optional reduced vocabulary."""

    def __init__(self, cfg: ModelConfig, capture_layers: tuple[int, ...], draft_vocab: int, fc_bias: bool = False):
        super().__init__()
        self.cfg = cfg
        self.num_cache_layers = 1
        self.capture_layers = capture_layers
        self.vocab_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(len(capture_layers) * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab, bias=False)
        # target id = draft id + d2t[draft id]; zeros when the draft keeps the target vocabulary.
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.rotary = Rotary(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def target_features(self, target: TargetPass) -> torch.Tensor:
        return torch.cat(target.captured, dim=-1)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if features.shape[-1] != self.cfg.hidden_size:  # the target's fused layers, not a draft output
            features = self.fc(features)
        return self.midlayer(self.vocab_embedding(tokens), features, ctx)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the TARGET vocabulary: draft-vocab scores scattered to their target ids."""
        draft = self.lm_head(self.norm(hidden)).float()
        if draft.shape[-1] == self.cfg.vocab_size and not self.d2t.any():
            return draft
        full = torch.full((*draft.shape[:-1], self.cfg.vocab_size), float("-inf"), device=draft.device)
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t
        return full.index_copy(-1, ids, draft)


def new_draft_cache(net: nn.Module, slots: int) -> KVCache:
    cfg, p = net.cfg, net.lm_head.weight
    return KVCache.allocate(net.num_cache_layers, 1, slots, cfg.num_kv_heads, cfg.head_size, p.dtype, p.device)


def tree_context(cache: KVCache, rotary: Rotary, prefix_len: int, positions: torch.Tensor, slots: torch.Tensor,
                 tree_rows: torch.Tensor) -> ForwardContext:
    """Draft tokens at arbitrary slots past the prefix; tree_rows [n, S] says which of the S tree slots each sees."""
    n, tree_slots = tree_rows.shape
    visible = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=tree_rows.device), tree_rows], dim=1)
    return ForwardContext(positions.view(1, n), slots.view(1, n), cache, prefix_len + tree_slots,
                          visible[None, None], False, rotary)


class EagleProposer:
    def __init__(self, net: EagleNet | Eagle3Net, cache_slots: int, tree: TreeBuffers | None,
                 dynamic: DynamicTreeConfig | None, max_draft_len: int):
        self.net = net
        self.capture_layers = getattr(net, "capture_layers", ())
        self.tree, self.dynamic = tree, dynamic
        self.max_nodes = tree.num_nodes if tree is not None else max_draft_len + 1
        self.max_draft_len = max_draft_len
        self.cache = new_draft_cache(net, cache_slots + self.max_nodes * (dynamic.depth if dynamic else 1))
        if tree is not None:
            self.top_k = int(tree.ranks.max()) + 1
            self.levels = [torch.nonzero(tree.depths == d).flatten() for d in range(tree.max_depth + 1)]
        self.root_hidden: torch.Tensor | None = None  # [1, H] draft output that guesses the root's children

    # ---- catch-up on accepted text -------------------------------------------------------------
    def _catch_up(self, tokens: torch.Tensor, features: torch.Tensor, start: int) -> None:
        """Pairs (tokens[k], features[k]) at positions start+k; keeps the last output for drafting."""
        n = tokens.shape[0]
        ctx = make_context(self.cache, self.net.rotary, start, torch.arange(start, start + n, device=tokens.device), None)
        hidden = self.net(tokens[None], features[None], ctx)[0]
        self.root_hidden = hidden[-1:]

    def start(self, prompt: torch.Tensor, target: TargetPass, first: torch.Tensor) -> None:
        self._catch_up(torch.cat([prompt[1:], first]), self.net.target_features(target), 0)

    def update(self, tree: DraftTree, acc: Acceptance, num_accepted: int, target: TargetPass, length: int) -> None:
        keep = num_accepted + 1
        features = self.net.target_features(target).index_select(0, acc.path[:keep])
        self._catch_up(acc.tokens[:keep], features, length)

    # ---- drafting --------------------------------------------------------------------------------
    def propose(self, step: StepInput) -> DraftTree:
        if self.tree is not None:
            return self._static(step)
        return self._dynamic(step)

    def _draft(self, tokens: torch.Tensor, features: torch.Tensor, length: int, depth: int, slots: torch.Tensor,
               tree_rows: torch.Tensor) -> torch.Tensor:
        positions = torch.full_like(slots, length + depth - 1)
        ctx = tree_context(self.cache, self.net.rotary, length, positions, slots, tree_rows)
        return self.net(tokens[None], features[None], ctx)[0]

    def _static(self, step: StepInput) -> DraftTree:
        tree, length = self.tree, step.length
        num = tree.num_nodes
        tokens = torch.empty(num, dtype=torch.long, device=step.root.device)
        tokens[:1] = step.root
        hidden = self.root_hidden.new_empty(num, self.root_hidden.shape[-1])
        hidden[0] = self.root_hidden[0]
        top = tokens.new_empty(num, self.top_k)
        top[0] = self.net.logits(self.root_hidden).topk(self.top_k, dim=-1).indices[0]
        for depth in range(1, tree.max_depth + 1):
            nodes = self.levels[depth]
            parents = tree.parents[nodes]
            tokens[nodes] = top[parents, tree.ranks[nodes]]
            if depth == tree.max_depth:
                break
            # Node i (i >= 1) uses draft slot length + i - 1: the root's own pair is already cached.
            out = self._draft(tokens[nodes], hidden[parents], length, depth, length + nodes - 1, tree.mask[nodes, 1:])
            hidden[nodes] = out
            top[nodes] = self.net.logits(out).topk(self.top_k, dim=-1).indices
        return DraftTree.from_buffers(tokens, tree)

    def _dynamic(self, step: StepInput) -> DraftTree:
        cfg, length, device = self.dynamic, step.length, step.root.device
        k, width = cfg.top_k, min(cfg.top_k, cfg.max_non_leaves_per_layer)
        logp = F.log_softmax(self.net.logits(self.root_hidden), dim=-1)[0]
        score, token = logp.topk(k)
        cand_tokens, cand_scores = [token], [score]
        cand_parents = [torch.full((k,), -1, device=device)]
        cand_depths = [torch.ones(k, dtype=torch.long, device=device)]
        frontier = score.topk(width).indices  # candidate ids
        frontier_hidden = self.root_hidden.expand(width, -1)
        rows = torch.zeros(width, 0, dtype=torch.bool, device=device)  # tree slots each frontier node sees
        total = k
        for depth in range(1, cfg.depth):
            slots = length + (depth - 1) * width + torch.arange(width, device=device)
            rows = torch.cat([rows, torch.eye(width, dtype=torch.bool, device=device)], dim=1)
            out = self._draft(torch.cat(cand_tokens)[frontier], frontier_hidden, length, depth, slots, rows)
            logp = F.log_softmax(self.net.logits(out), dim=-1)
            child_logp, child_token = logp.topk(k, dim=-1)  # [width, k]
            child_score = (torch.cat(cand_scores)[frontier][:, None] + child_logp).flatten()
            cand_tokens.append(child_token.flatten())
            cand_scores.append(child_score)
            cand_parents.append(frontier.repeat_interleave(k))
            cand_depths.append(torch.full((width * k,), depth + 1, device=device))
            best = child_score.topk(width).indices  # positions among this depth's children
            frontier = total + best
            frontier_hidden = out[best // k]
            rows = rows[best // k]
            total += width * k
        return self._select(torch.cat(cand_tokens), torch.cat(cand_parents), torch.cat(cand_depths),
                            torch.cat(cand_scores), step.root, cfg.depth)

    def _select(self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                root: torch.Tensor, max_depth: int) -> DraftTree:
        """Keep the max_draft_len best candidates, ordered by depth, as a tree under the root."""
        count = tokens.shape[0]
        keep = (scores - DEPTH_TIE_BREAK * depths).topk(min(self.max_draft_len, count)).indices
        keep = keep[torch.argsort(depths[keep] * count + keep)]
        new_index = torch.zeros(count, dtype=torch.long, device=tokens.device)
        new_index[keep] = torch.arange(1, keep.shape[0] + 1, device=tokens.device)
        kept_parents = torch.where(parents[keep] >= 0, new_index[parents[keep].clamp(min=0)], 0)
        tree_parents = torch.cat([kept_parents.new_full((1,), -1), kept_parents])
        tree_depths = torch.cat([depths.new_zeros(1), depths[keep]])
        return DraftTree(torch.cat([root, tokens[keep]]), tree_parents, tree_depths,
                         ancestor_mask(tree_parents, max_depth), max_depth)
