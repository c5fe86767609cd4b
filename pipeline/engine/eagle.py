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
from pipeline.engine.graphs import CapturedStep, Compiled, prefill_bucket
from pipeline.engine.kernels.routing import Drafter
from pipeline.engine.kv_cache import BlockPool, PagedView
from pipeline.engine.model import (
    MLP,
    Attention,
    DecoderLayer,
    ForwardContext,
    KVCache,
    Linear,
    ModelConfig,
    RMSNorm,
    Rotary,
    full_slot_context,
    make_context,
    paged_context,
)
from pipeline.engine.spec_step import Chunk, Drafting, Tier, Trees, Verified
from pipeline.engine.speculative import StepInput, TargetPass
from pipeline.engine.tree import Candidates, DraftTree, TreeBuffers, select_tree, select_trees


class EagleNet(Drafter, nn.Module):
    """EAGLE-1/2 draft: fc(concat(embed(token), feature)) -> Llama decoder layers (layer 0 without input norm)."""

    def __init__(self, cfg: ModelConfig, fc_bias: bool = True):
        super().__init__()
        self.cfg = cfg
        self.num_cache_layers = cfg.num_layers
        self.vocab_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, input_norm=i > 0) for i in range(cfg.num_layers))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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

    def top_logp(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities, tokens) of each row's k likeliest next tokens, best first."""
        if not self.drafter.lm_head_topk_fits(hidden.shape[0], k):
            return F.log_softmax(self.logits(hidden), dim=-1).topk(k, dim=-1)
        return self.drafter.lm_head_topk(hidden, self.lm_head.weight, k)


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


class Eagle3Net(Drafter, nn.Module):
    """EAGLE-3 draft: fuses three target layers with fc, own final norm, optional reduced vocabulary."""

    d2t: torch.Tensor  # a buffer: draft id -> target id - draft id

    def __init__(self, cfg: ModelConfig, capture_layers: tuple[int, ...], draft_vocab: int, fc_bias: bool = False):
        super().__init__()
        self.cfg = cfg
        self.num_cache_layers = 1
        self.capture_layers = capture_layers
        self.vocab_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = Linear(len(capture_layers) * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.lm_head = Linear(cfg.hidden_size, draft_vocab, bias=False)
        # target id = draft id + d2t[draft id]; zeros when the draft keeps the target vocabulary.
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.identity_vocab = draft_vocab == cfg.vocab_size  # host flag: no data-dependent branch in a graph
        self.rotary = Rotary(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def set_d2t(self, d2t: torch.Tensor) -> None:
        self.d2t.copy_(d2t.long())
        self.identity_vocab = self.lm_head.out_features == self.cfg.vocab_size and not bool(d2t.any())

    def target_features(self, target: TargetPass) -> torch.Tensor:
        return torch.cat(target.captured, dim=-1)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if features.shape[-1] != self.cfg.hidden_size:  # the target's fused layers, not a draft output
            features = self.fc(features)
        return self.midlayer(self.vocab_embedding(tokens), features, ctx)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the TARGET vocabulary: draft-vocab scores scattered to their target ids."""
        draft = self.lm_head(self.norm(hidden)).float()
        if self.identity_vocab:
            return draft
        full = torch.full((*draft.shape[:-1], self.cfg.vocab_size), float("-inf"), device=draft.device)
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t
        return full.index_copy(-1, ids, draft)

    def top_logp(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As EagleNet's, over the draft vocabulary, its ids mapped to the target's."""
        if not self.drafter.lm_head_topk_fits(hidden.shape[0], k):
            return F.log_softmax(self.logits(hidden), dim=-1).topk(k, dim=-1)
        logp, ids = self.drafter.lm_head_topk(self.norm(hidden), self.lm_head.weight, k)
        return logp, ids + self.d2t[ids]


def new_draft_cache(net: EagleNet | Eagle3Net, slots: int) -> KVCache:
    cfg, p = net.cfg, net.lm_head.weight
    return KVCache.allocate(net.num_cache_layers, 1, slots, cfg.num_kv_heads, cfg.head_size, p.dtype, p.device)


class EagleProposer:
    """Drafts from static buffers, so that on CUDA one captured (and compiled) graph runs the whole
    step: catch-up on the pairs the last verification accepted, then the tree.

    The catch-up always runs max_depth + 1 pairs; those past the accepted count write slots that no
    later query sees before the tree or the next catch-up overwrites them."""

    runs_ahead = True
    drafts_from_buffers = True

    def __init__(
        self,
        net: EagleNet | Eagle3Net,
        cache_slots: int,
        tree: TreeBuffers | None,
        dynamic: DynamicTreeConfig | None,
        max_draft_len: int,
    ):
        self.net = net
        self.capture_layers = getattr(net, "capture_layers", ())
        self.tree, self.dynamic = tree, dynamic
        self.max_nodes = tree.num_nodes if tree is not None else max_draft_len + 1
        self.max_draft_len = max_draft_len
        device = net.lm_head.weight.device
        if tree is not None:
            self.depth = tree.max_depth
            self.top_k = int(tree.ranks.max()) + 1
            self.levels = [torch.nonzero(tree.depths == d).flatten() for d in range(tree.max_depth + 1)]
            tree_slots = tree.num_nodes - 1  # node i >= 1 drafts at slot length + i - 1
        else:
            assert dynamic is not None, "an EAGLE proposer needs a static tree or a dynamic one"
            self.depth = dynamic.depth
            self.width = min(dynamic.top_k, dynamic.max_non_leaves_per_layer)
            self.width_offsets = torch.arange(self.width, device=device)
            tree_slots = (dynamic.depth - 1) * self.width  # one row of `width` frontier slots per depth
        self.tree_slots = max(tree_slots, 1)
        self.cache = new_draft_cache(net, cache_slots + max(self.depth + 1, self.tree_slots))
        self.slot_ids = torch.arange(self.cache.num_slots, device=device)
        run = self.depth + 1
        self.run_offsets = torch.arange(run, device=device)
        self.causal = torch.ones(run, run, dtype=torch.bool, device=device).tril()
        # Step inputs. length: pairs cached before the pending ones; pending_*: the pairs to catch up on.
        self.root = torch.zeros(1, dtype=torch.long, device=device)
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.num_pending = torch.zeros((), dtype=torch.long, device=device)
        self.pending_tokens = torch.zeros(run, dtype=torch.long, device=device)
        self.pending_features: torch.Tensor | None = None  # [run, F], allocated at the first start()
        self.step = Compiled(self._step) if device.type == "cuda" else self._step
        self.pad_prompt = device.type == "cuda"  # see start()
        self.graph: CapturedStep | None = None

    # ---- catch-up on accepted text -------------------------------------------------------------
    def start(self, prompt: torch.Tensor, target: TargetPass, first: torch.Tensor) -> None:
        """The prompt's pairs but the last run eagerly here; the last one is caught up on in propose()."""
        tokens, features = torch.cat([prompt[1:], first]), self.net.target_features(target)
        n = tokens.shape[0]
        if n > 1:
            # On CUDA the pairs run padded to the target's prefill bucket (causal: the pads change no
            # row, and their slots are rewritten before any query reads them): cuDNN's attention
            # plans a graph per new shape, 37 ms a new prompt length on the H200 against 1 ms a seen one.
            run = (prefill_bucket(n - 1, self.cache.num_slots) if self.pad_prompt else None) or n - 1
            ctx = make_context(self.cache, self.net.rotary, 0, torch.arange(run, device=tokens.device), None)
            pads = run - (n - 1)
            self.net(F.pad(tokens[: n - 1], (0, pads))[None], F.pad(features[: n - 1], (0, 0, 0, pads))[None], ctx)
        if self.pending_features is None:  # the feature width (H, or 3H for EAGLE-3) is known from here on
            self.pending_features = features.new_zeros(self.depth + 1, features.shape[-1])
        self.pending_tokens[:1].copy_(tokens[n - 1 :])
        self.pending_features[:1].copy_(features[n - 1 :])
        self.length.fill_(n - 1)
        self.num_pending.fill_(1)

    def update(
        self,
        tree: DraftTree,
        acc: Acceptance,
        num_accepted: int | torch.Tensor,
        target: TargetPass,
        length: int | torch.Tensor,
    ) -> None:
        # Straight into the step's buffers (acc holds max_depth + 1 entries): no per-step allocation.
        torch.index_select(self.net.target_features(target), 0, acc.path, out=self.pending_features)
        self.pending_tokens.copy_(acc.tokens)
        self.length.fill_(length)
        torch.add(acc.num_accepted, 1, out=self.num_pending)

    # ---- drafting --------------------------------------------------------------------------------
    def propose(self, step: StepInput) -> DraftTree:
        self.prepare(step)
        if self.cache.k.is_cuda:
            self.graph = self.graph or CapturedStep(self.draft)
            return self.graph()
        return self.draft()

    def prepare(self, step: StepInput) -> None:
        """The step's inputs into the static buffers that draft() reads."""
        self.root.copy_(step.root)

    def draft(self) -> DraftTree:
        """The tree from the static buffers alone, so that a CUDA graph can capture it (alone, or
        with the greedy verification after it: GraphedTarget.run_greedy_draft)."""
        out = self.step()
        if self.tree is not None:
            return DraftTree.from_buffers(out[0], self.tree)
        tokens, parents, depths, mask = out
        return DraftTree(tokens, parents, depths, mask, self.depth)

    def _step(self) -> tuple[torch.Tensor, ...]:
        positions = self.length + self.run_offsets
        ctx = full_slot_context(
            self.cache, self.net.rotary, self.length, positions, positions, self.causal, self.slot_ids
        )
        assert self.pending_features is not None  # allocated by start()
        hidden = self.net(self.pending_tokens[None], self.pending_features[None], ctx)[0]
        root_hidden = hidden.index_select(0, self.num_pending.view(1) - 1)  # [1, H] guesses the root's children
        length = self.length + self.num_pending
        if self.tree is not None:
            return (self._static(root_hidden, length),)
        return self._dynamic(root_hidden, length)

    def _draft(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        length: torch.Tensor,
        depth: int,
        offsets: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """Draft pass over nodes at tree slots length + offsets; rows [n, tree_slots] says which tree slots each
        sees."""
        positions = (length + depth - 1).expand(tokens.shape[0])
        ctx = full_slot_context(self.cache, self.net.rotary, length, positions, length + offsets, rows, self.slot_ids)
        return self.net(tokens[None], features[None], ctx)[0]

    def _static(self, root_hidden: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        tree = self.tree
        assert tree is not None
        num = tree.num_nodes
        tokens = torch.empty(num, dtype=torch.long, device=root_hidden.device)
        tokens[:1] = self.root
        hidden = root_hidden.new_empty(num, root_hidden.shape[-1])
        hidden[0] = root_hidden[0]
        top = tokens.new_empty(num, self.top_k)
        top[0] = self.net.logits(root_hidden).topk(self.top_k, dim=-1).indices[0]
        for depth in range(1, tree.max_depth + 1):
            nodes = self.levels[depth]
            parents = tree.parents[nodes]
            tokens[nodes] = top[parents, tree.ranks[nodes]]
            if depth == tree.max_depth:
                break
            # Node i (i >= 1) uses tree slot i - 1: the root's own pair is already cached.
            out = self._draft(tokens[nodes], hidden[parents], length, depth, nodes - 1, tree.mask[nodes, 1:])
            hidden[nodes] = out
            top[nodes] = self.net.logits(out).topk(self.top_k, dim=-1).indices
        return tokens

    def _dynamic(self, root_hidden: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg, device, width = self.dynamic, root_hidden.device, self.width
        assert cfg is not None
        k = cfg.top_k
        score, token = (t[0] for t in self.net.top_logp(root_hidden, k))
        cands = Candidates.of_root(token, score)
        frontier = self._topk(score, width)[1]  # candidate ids
        frontier_hidden = root_hidden.expand(width, -1)
        rows = torch.zeros(width, self.tree_slots, dtype=torch.bool, device=device)  # tree slots each node sees
        own = torch.eye(width, dtype=torch.bool, device=device)
        for depth in range(1, cfg.depth):
            lo = (depth - 1) * width
            rows = torch.cat([rows[:, :lo], own, rows[:, lo + width :]], dim=1)
            out = self._draft(
                torch.cat(cands.tokens)[frontier], frontier_hidden, length, depth, lo + self.width_offsets, rows
            )
            child_logp, child_token = self.net.top_logp(out, k)  # [width, k]
            child_score = (torch.cat(cands.scores)[frontier][:, None] + child_logp).flatten()
            first = cands.add(child_token.flatten(), frontier.repeat_interleave(k), child_score)
            best = self._topk(child_score, width)[1]  # positions among this depth's children
            frontier = first + best
            frontier_hidden = out[best // k]
            rows = rows[best // k]
        return select_tree(self.root, *cands.joined(), self.max_draft_len, cfg.depth, self._topk)

    def _topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net.drafter.topk(x, k)


class EagleRows:
    """EAGLE in batched form (spec_step.BatchProposer). The draft's KV lives in a block pool of its own
    that the requests' block tables index like the target's (sequence index = pair position). A request's
    state row holds the pairs it has not cached yet (tokens and the target's features): the last step's
    accepted path, or the pairs of plain steps. A drafting step first catches up on them (max depth + 1
    pairs a row, the buffer's size). A plain step either does too, or, while every row has room (defer),
    appends its pair and leaves the catch-up to a later step, which then takes a run of pairs in one pass
    instead of one pair a step. Either way the draft never falls behind the text by more than the buffer
    holds, whatever tiers run. Tree node i (i >= 1) drafts at sequence index length + i - 1."""

    host_drafts = 0

    def __init__(self, net: EagleNet | Eagle3Net, tiers: list[Tier], state_rows: int, pool: BlockPool):
        self.net, self.tiers, self.pool = net, tiers, pool
        self.capture_layers: tuple[int, ...] = getattr(net, "capture_layers", ())
        self.top_k = max(int(t.tree.ranks.max()) + 1 for t in tiers if t.dynamic is None)
        run = max(t.depth for t in tiers) + 1  # pairs a step may have to catch up on
        cfg, weight = net.cfg, net.lm_head.weight
        width = cfg.hidden_size * max(1, len(self.capture_layers))
        self.pending_tokens = torch.zeros(state_rows, run, dtype=torch.long, device=weight.device)
        self.pending_features = weight.new_zeros(state_rows, run, width)
        self.num_pending = torch.zeros(state_rows, dtype=torch.long, device=weight.device)
        self.last_feature = weight.new_zeros(state_rows, width)  # the feature before a chunk's first pair
        self.run, self.run_ids = run, torch.arange(run, device=weight.device)

    def host_draft(self, history: list[int]) -> list[int]:
        return []

    def features(self, hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(captured, dim=-1) if self.capture_layers else hidden

    def _forward(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        attn_len: int,
        prefix: torch.Tensor | None = None,
        region: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        view = PagedView(self.pool, positions, slots, table, positions[:, -1] + 1, attn_len, prefix, region, count)
        return self.net(tokens, features, paged_context(view, self.net.rotary))

    def prefill(self, chunk: Chunk) -> None:
        """The chunk's pairs: pair j sits at position p_j - 1 with (token j, the feature before it); the
        first chunk's pair 0 has no position and writes the scratch block."""
        feats = self.features(chunk.hidden, chunk.captured)  # [n, F]
        before = torch.cat([self.last_feature[chunk.state], feats[:-1]])
        positions = chunk.positions - 1
        ids = torch.arange(positions.shape[0], device=positions.device)
        real = (positions >= 0) & (ids <= chunk.last)
        slots = torch.where(real, self.pool.slots(chunk.table, positions.clamp(min=0)[None])[0], 0)
        self._forward(
            chunk.tokens[None], before[None], positions.clamp(min=0)[None], slots[None], chunk.table, chunk.attn_len
        )
        last_feature = feats.index_select(0, chunk.last)  # [1, F]
        self.last_feature.index_copy_(0, chunk.state, last_feature)
        if chunk.first is not None:  # the prompt's last pair waits for the first step's catch-up
            self.pending_tokens[chunk.state, 0] = chunk.first
            self.pending_features[chunk.state, 0] = last_feature
            self.num_pending.index_fill_(0, chunk.state, 1)

    def draft(self, rows: Drafting, tier: Tier) -> tuple[torch.Tensor, Trees]:
        if rows.defer:  # a plain step whose pair joins the pending ones
            return rows.roots[:, None], tier.trees
        b, ids, run = rows.roots.shape[0], self.run_ids, self.run
        pending = self.num_pending[rows.state]
        start = (rows.lengths - pending).clamp(min=0)  # pairs cached before the pending ones (padding rows: 0)
        positions = start[:, None] + ids[None, :]
        attn_len = rows.attn_len
        hidden = self._forward(
            self.pending_tokens[rows.state, :run],
            self.pending_features[rows.state, :run],
            positions,
            self.pool.slots(rows.table, positions),
            rows.table,
            attn_len,
            start[:, None].expand(b, run),
            positions[:, None, :].expand(b, run, run),
            ids[None, :].expand(b, run) + 1,
        )
        if tier.depth == 0:  # a plain step: caught up, nothing to draft
            return rows.roots[:, None], tier.trees
        root_hidden = hidden.gather(1, (pending - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        if tier.dynamic is not None:
            return self._dynamic(rows, tier, tier.dynamic, root_hidden)
        t, k = tier.num_nodes, self.top_k
        tokens = rows.roots.new_zeros(b, t)
        tokens[:, 0] = rows.roots
        node_hidden = root_hidden.new_zeros(b, t, root_hidden.shape[-1])
        node_hidden[:, 0] = root_hidden
        top = tokens.new_zeros(b, t, k)
        top[:, 0] = self.net.top_logp(root_hidden, k)[1]
        lengths = rows.lengths[:, None]
        for depth, level in enumerate(tier.levels, start=1):
            nodes, parents = level.nodes, level.parents
            tokens[:, nodes] = top[:, parents].gather(2, level.ranks[None, :, None].expand(b, -1, 1))[..., 0]
            if depth == tier.depth:
                break
            n = parents.shape[0]
            out = self._forward(
                tokens[:, nodes],
                node_hidden[:, parents],
                (lengths + depth - 1).expand(b, n),
                self.pool.slots(rows.table, lengths + level.ancestors[None, :, -1]),  # node i at length + i - 1
                rows.table,
                attn_len,
                lengths.expand(b, n),
                lengths[:, :, None] + level.ancestors[None],  # [B, n, depth]
                torch.full((b, n), depth, dtype=torch.long, device=tokens.device),
            )
            node_hidden[:, nodes] = out
            top[:, nodes] = self.net.top_logp(out.reshape(b * n, -1), k)[1].view(b, n, k)
        return tokens, tier.trees

    def _dynamic(
        self, rows: Drafting, tier: Tier, cfg: DynamicTreeConfig, root_hidden: torch.Tensor
    ) -> tuple[torch.Tensor, Trees]:
        """EAGLE-2 for every row at once, as EagleProposer._dynamic does for one: each depth expands the top-k
        children of the `width` likeliest nodes of the depth before (by path log-probability), then each row
        keeps its tier.num_nodes - 1 likeliest candidates. Frontier node j of depth d drafts at sequence index
        length + (d - 1) * width + j and reads its own frontier ancestors."""
        b, k, hidden_size = root_hidden.shape[0], cfg.top_k, root_hidden.shape[-1]
        width = min(cfg.top_k, cfg.max_non_leaves_per_layer)
        lengths, own = rows.lengths[:, None], torch.arange(width, device=root_hidden.device)
        score, token = self.net.top_logp(root_hidden, k)  # [B, k]: the depth-1 candidates
        cands = Candidates.of_root(token, score)
        frontier = self.net.drafter.topk(score, width)[1]  # [B, width] candidate ids
        frontier_score, frontier_token = score.gather(1, frontier), token.gather(1, frontier)
        hidden = root_hidden[:, None].expand(b, width, hidden_size)  # each frontier node's parent's output
        ancestors = frontier.new_zeros(b, width, 0)  # sequence offsets past the root of its drafted ancestors
        for depth in range(1, cfg.depth):
            offsets = torch.cat([ancestors, ((depth - 1) * width + own)[None, :, None].expand(b, -1, 1)], dim=2)
            out = self._forward(
                frontier_token,
                hidden,
                (lengths + depth - 1).expand(b, width),
                self.pool.slots(rows.table, lengths + offsets[:, :, -1]),
                rows.table,
                rows.attn_len,
                lengths.expand(b, width),
                lengths[:, :, None] + offsets,
                torch.full((b, width), depth, dtype=torch.long, device=token.device),
            )
            logp, child = (t.view(b, width * k) for t in self.net.top_logp(out.reshape(b * width, -1), k))
            child_score = (frontier_score[:, :, None] + logp.view(b, width, k)).flatten(1)
            first = cands.add(child, frontier.repeat_interleave(k, dim=1), child_score)
            best = self.net.drafter.topk(child_score, width)[1]  # [B, width] among this depth's children
            parent = best // k  # the frontier node each expands
            frontier = first + best
            frontier_score, frontier_token = child_score.gather(1, best), child.gather(1, best)
            hidden = out.gather(1, parent[:, :, None].expand(-1, -1, hidden_size))
            ancestors = offsets.gather(1, parent[:, :, None].expand(-1, -1, depth))
        tokens, parents, depths, paths = select_trees(
            rows.roots,
            *cands.joined(),
            tier.num_nodes,
            tier.depth,
            self.net.drafter.topk,
        )
        return tokens, Trees.of(depths, parents, paths)

    def accepted(self, rows: Drafting, tier: Tier, result: Verified) -> None:
        feats = self.features(result.hidden, result.captured)  # [B, T, F]
        if rows.defer:  # appended after the pending pairs; padding rows share state row 0: kept in bounds
            slot = self.num_pending[rows.state].clamp(max=self.run - 1)
            self.pending_tokens[rows.state, slot] = result.tokens[:, 0]
            self.pending_features[rows.state, slot] = feats[:, 0]
            self.num_pending[rows.state] = slot + 1
            return
        taken = result.path.shape[1]
        path_feats = feats.gather(1, result.path[:, :, None].expand(-1, -1, feats.shape[-1]))
        self.pending_tokens[rows.state, :taken] = result.tokens
        self.pending_features[rows.state, :taken] = path_feats
        self.num_pending[rows.state] = result.num_accepted + 1
