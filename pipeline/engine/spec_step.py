"""The batched speculative step: every running request drafts, is verified and accepts in one step.

A step runs one *tier*, a tree shape shared by every row (the root alone, a chain, or a tree), or EAGLE-2's
trees of one size whose shape each row's draft chooses (a dynamic tier):
1. the proposer drafts each row's tokens for the tier's nodes (node 0 is the row's root, the last
   emitted token), from its own per-request state on the device, with the rows' trees;
2. one target pass over all rows' trees in the block pool: node i of a row sits at sequence index
   length + i, at RoPE position length + depth(i), and reads the row's accepted text and then its own
   path through the tree (paged_attention), so it computes exactly what the same token would once its
   path is accepted;
3. each row accepts its longest path of drafts that the target itself emits after their parents: the
   argmax (greedy), or the draw a plain step would make at that position from the row's seed (sampling:
   lossless, and the output is plain sampling's token for token, whatever the drafts or the tier); its
   KV is then moved to length .. length + accepted, and the proposer updates its state.
Rows whose drafts are switched off (a request that opted out, a host draft shorter than the tier) keep
only their root valid and get a plain step inside the same pass. The step's result stays on the device
([B, depth + 2]: the accepted tokens, the bonus token, then the count); the scheduler reads it in one copy.
On CUDA each (batch bucket, tier, sampling mode) replays a graph captured on first use.
Every step, drafting or plain, is queued before the host has read the step before: a row whose CARRY column
names its row in that step takes its root and its cached length from that step's result on the device
(the host knows neither until it reads), and the proposer's state was already updated on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from pipeline.engine.config import DynamicTreeConfig
from pipeline.engine.graphs import CapturedStep, Compiled
from pipeline.engine.kv_cache import BlockPool, PagedView
from pipeline.engine.model import Transformer, paged_context
from pipeline.engine.sampling import argmax_rows
from pipeline.engine.step import CARRY, POSITION, SEED, STATE, TABLE, TOKEN, TOP_K, BatchStep, step_mode
from pipeline.engine.tree import Choices, TreeBuffers, build_tree, chain, chain_buffers
from pipeline.errors import UserError

# Columns of a row's draft input: how many of the tier's draft nodes the row may accept (0: a plain step
# for this row; a host draft's length), then its host draft tokens (n-gram).
DRAFT_COUNT, DRAFT_TOKENS = 0, 1
# Columns of a row's step result after its depth + 1 tokens (the accepted drafts, then the token after the
# last of them): the accepted count, that last token again (the next step's root) and the row's cached
# length after the step (the next step's position).
COUNT, NEXT_ROOT, NEXT_LENGTH = -3, -2, -1


@dataclass(frozen=True)
class Level:
    """The nodes of one depth of a tier's tree (contiguous: build_tree orders nodes by depth), with what
    drafting them reads as constant tensors, so that a captured step does not recompute them every replay."""

    nodes: slice  # node indices start .. stop
    parents: torch.Tensor  # [n] each node's parent
    ranks: torch.Tensor  # [n] its rank among its parent's guesses
    ancestors: torch.Tensor  # [n, depth] its path after the root, as offsets from the root's sequence index


@dataclass(frozen=True)
class Trees:
    """The trees of a step's rows as verification and acceptance read them: a static tier's, [1, ...] and
    broadcast over the rows, or each row's own (a dynamic tier), [B, ...]."""

    depths: torch.Tensor  # [R, T]
    parent_or_root: torch.Tensor  # [R, T] each node's parent, the root its own
    paths: torch.Tensor  # [R, T, depth + 1] node indices root .. node, padded with the node
    mask: torch.Tensor  # [R, T, T] mask[r, t, s]: s is t or an ancestor of t

    @classmethod
    def of(cls, depths: torch.Tensor, parents: torch.Tensor, paths: torch.Tensor) -> Trees:
        mask = torch.zeros(*depths.shape, depths.shape[-1], dtype=torch.bool, device=depths.device)
        return cls(depths, parents.clamp(min=0), paths, mask.scatter_(2, paths, True))


@dataclass(frozen=True)
class Tier:
    """One tree shape a step can run, with what verification needs precomputed: a static tree, or (dynamic
    set) EAGLE-2's tree of the tree's node count and depth, chosen by each row's draft scores; its `tree` then
    stands for that size alone."""

    name: str
    tree: TreeBuffers
    levels: tuple[Level, ...]  # the nodes at each depth 1 .. depth
    node_ids: torch.Tensor  # [T] 0 .. T - 1
    trees: Trees  # the static tree's, for every row
    path_next: torch.Tensor  # [depth + 1] the path index after each: 1 .. depth, then depth again
    dynamic: DynamicTreeConfig | None = None

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def depth(self) -> int:
        return self.tree.max_depth

    @classmethod
    def build(cls, name: str, choices: Choices, device: torch.device) -> Tier:
        tree = build_tree(choices) if choices else chain_buffers(0)
        parents = tree.parents.tolist()
        depth = tree.max_depth
        rows: list[list[int]] = []
        for node in range(len(parents)):
            up = [node]
            while parents[up[-1]] >= 0:
                up.append(parents[up[-1]])
            path = up[::-1]
            rows.append(path + [node] * (depth + 1 - len(path)))
        paths = torch.tensor(rows)
        levels = []
        for d in range(1, depth + 1):
            ids = torch.nonzero(tree.depths == d).flatten().tolist()
            nodes = slice(ids[0], ids[-1] + 1)
            assert ids == list(range(nodes.start, nodes.stop)), "build_tree orders nodes by depth"
            level = (tree.parents[nodes], tree.ranks[nodes], paths[nodes, 1 : d + 1] - 1)
            levels.append(Level(nodes, *(t.to(device) for t in level)))
        steps = torch.arange(depth + 1)
        tree, paths = tree.to(device), paths.to(device)
        return cls(
            name,
            tree,
            tuple(levels),
            torch.arange(len(parents), device=device),
            Trees(tree.depths[None], tree.parents.clamp(min=0)[None], paths[None], tree.mask[None]),
            (steps + 1).clamp(max=depth).to(device),
        )

    @classmethod
    def build_dynamic(cls, max_nodes: int, dynamic: DynamicTreeConfig, device: torch.device) -> Tier:
        """EAGLE-2's tier of dynamic.depth levels and as many of max_nodes nodes as its candidates fill (its
        tree: a chain that deep, then depth-1 nodes, for the size)."""
        width = min(dynamic.top_k, dynamic.max_non_leaves_per_layer)
        candidates = dynamic.top_k * (1 + (dynamic.depth - 1) * width)
        num_nodes = min(max_nodes, candidates + 1)
        dynamic = replace(dynamic, depth=min(dynamic.depth, num_nodes - 1))  # no deeper than its nodes reach
        size = chain(dynamic.depth) + [[r] for r in range(1, num_nodes - dynamic.depth)]
        return replace(cls.build(f"dynamic{num_nodes}", size, device), dynamic=dynamic)


# Sampling modes (step.step_mode) the engine's warm-up captures: greedy, and sampled without top-k or top-p.
WARMED_MODES = ("greedy", "sampled")
# Node counts of the tree tiers (root included), when the proposer's choices and max_nodes allow them.
TREE_TIER_NODES = (8, 16, 32, 64)


def tier_ladder(choices: Choices, max_nodes: int, max_depth: int, device: torch.device) -> list[Tier]:
    """The tiers a proposer offers, cheapest first: plain (the root alone), chains of 1 .. max_depth top-1
    tokens, then trees of the given choices' most probable prefixes (choices are ordered that way)."""
    tiers = [Tier.build("plain", [], device)]
    for d in range(1, min(max_depth, max_nodes - 1) + 1):
        tiers.append(Tier.build(f"chain{d}", [[0] * k for k in range(1, d + 1)], device))
    closed: Choices = []
    for path in choices:  # in order, without paths too deep or whose parent was dropped
        if len(path) <= max_depth and (len(path) == 1 or path[:-1] in closed):
            closed.append(list(path))
    sizes: set[int] = set()
    for nodes in TREE_TIER_NODES:
        paths = closed[: min(nodes, max_nodes) - 1]
        if len(paths) > max_depth and len(paths) not in sizes:  # a tree, not a chain
            sizes.add(len(paths))
            tiers.append(Tier.build(f"tree{len(paths) + 1}", paths, device))
    return tiers


@dataclass
class Drafting:
    """What a proposer reads to draft one step (device tensors of the step's rows)."""

    roots: torch.Tensor  # [B] the last emitted token of each row
    lengths: torch.Tensor  # [B] each row's cached length: its root's position
    table: torch.Tensor  # [B, blocks]
    state: torch.Tensor  # [B] each row's proposer-state row
    drafts: torch.Tensor  # [B, 1 + k]: DRAFT_COUNT (draft nodes the row may accept), then host draft tokens
    attn_len: int  # sequence indices a row's reads may cover: the whole table when captured
    defer: bool = False  # a plain step whose proposer keeps the new pair pending instead of catching up


@dataclass
class Chunk:
    """One request's prefill chunk, as a proposer sees it after the target's pass."""

    state: torch.Tensor  # [1] the request's proposer-state row
    tokens: torch.Tensor  # [n] the chunk's tokens, padded (padding: token 0 at position 0)
    positions: torch.Tensor  # [n]
    table: torch.Tensor  # [1, blocks]
    hidden: torch.Tensor  # [n, H] the target's final hidden states
    captured: list[torch.Tensor]  # [n, H] residual streams after the capture layers
    last: torch.Tensor  # [1] index of the chunk's last real token
    first: torch.Tensor | None  # [1] the request's first token when the chunk ends the prompt
    attn_len: int  # sequence indices the chunk's reads cover


@dataclass
class Verified:
    """One step's acceptance, per row."""

    path: torch.Tensor  # [B, depth + 1] node indices root .. last accepted, padded
    num_accepted: torch.Tensor  # [B]
    tokens: torch.Tensor  # [B, depth + 1] accepted draft tokens, then the bonus token at num_accepted
    hidden: torch.Tensor  # [B, T, H] the target's final hidden states at every node
    captured: list[torch.Tensor]  # [B, T, H] residual stream after each capture layer


class BatchProposer(Protocol):
    """A drafting method in batched form: per-request state lives in rows of its own device buffers."""

    capture_layers: tuple[int, ...]
    tiers: list[Tier]
    host_drafts: int  # host draft tokens a row carries (n-gram), 0 when it drafts on the device

    def prefill(self, chunk: Chunk) -> None:
        """After the target's pass over a prefill chunk of one request."""

    def host_draft(self, history: list[int]) -> list[int]:
        """Draft tokens computed on the host from a row's text (host_drafts > 0 only)."""
        ...

    def draft(self, rows: Drafting, tier: Tier) -> tuple[torch.Tensor, Trees]:
        """[B, T] the tier's tokens for each row (the roots at node 0), and their trees (a static tier's:
        tier.trees)."""

    def accepted(self, rows: Drafting, tier: Tier, result: Verified) -> None:
        """After verification: take the accepted path into the per-request state."""


class SpecStep(BatchStep):
    """BatchStep's pool, buckets, prefill and sampling, with speculative decode steps in tiers."""

    def __init__(
        self,
        target: Transformer,
        pool: BlockPool,
        proposer: BatchProposer,
        max_batch_size: int,
        max_seq_len: int,
        compile_tiers: tuple[str, ...] | None = (),
        compile_rows: int = 0,
    ):
        """compile_tiers (None: the dynamic ones): drafting tiers whose steps in buckets of at most compile_rows
        rows run compiled (CUDA), as the plain tier's always do."""
        self.proposer = proposer
        names = compile_tiers
        if names is None:
            names = tuple(t.name for t in proposer.tiers if t.dynamic is not None)
        unknown = set(names) - {t.name for t in proposer.tiers}
        if unknown:
            raise UserError(
                f"--compile-tiers {','.join(sorted(unknown))}: not this engine's tiers; it has "
                f"{', '.join(t.name for t in proposer.tiers)}"
            )
        self.compiled_tiers = {i for i, t in enumerate(proposer.tiers) if t.name in names}
        self.compiled_rows = compile_rows
        self.max_nodes = max(t.num_nodes for t in proposer.tiers)
        self.max_depth = max(t.depth for t in proposer.tiers)
        self.draft_width = 1 + proposer.host_drafts
        # A row's table covers the tree past its text, and the drafts a step not read yet may have accepted.
        super().__init__(target, pool, max_batch_size, max_seq_len + self.headroom)
        self.capture_layers = proposer.capture_layers
        self.last_length = torch.zeros_like(self.last)  # each row's cached length after the last step
        self.spec_graphs: dict[tuple[int, int, str, bool], CapturedStep] = {}
        # The plain tier runs at every load: compiled (CUDA), it costs what a plain engine's step does, so
        # that falling back to plain steps never costs more than plain decoding. The drafting tiers' graphs
        # are captured eagerly (one compilation per bucket and tier would take minutes at load), but those
        # asked for (`compile_tiers`).
        self.compiled = Compiled(self._speculate, None if self.capture else False)

    @property
    def tiers(self) -> list[Tier]:
        return self.proposer.tiers

    @property
    def headroom(self) -> int:
        """Sequence indices past a request's text its table may need: a tree, after the largest count of
        accepted drafts a step in flight may add."""
        return self.max_nodes + self.max_depth + 1

    def bucket(self, rows: int) -> int:
        """The batch bucket a step of `rows` rows runs in (its graphs' and its cost's key)."""
        return next(b for b in self.buckets if b >= rows)

    def new_drafts(self) -> np.ndarray:
        return np.zeros(self.draft_width, dtype=np.int64)

    def decode(self, ints: np.ndarray, floats: np.ndarray, defer: bool = False) -> torch.Tensor:
        """A plain-tier step (no drafts): [B] next tokens on the device, as BatchStep.decode returns them (a
        next step queued before the host reads these takes them, and the lengths, through its rows' CARRY).
        defer: every row has room for one more pending pair, so a proposer keeps the step's pair pending and
        catches up on a run of them later, in one pass."""
        return self.speculate(ints, floats, None, 0, defer)[:, 0]

    def speculate(
        self, ints: np.ndarray, floats: np.ndarray, drafts: np.ndarray | None, tier: int, defer: bool = False
    ) -> torch.Tensor:
        """One speculative step of tier `tier` for B rows (ints: TOKEN = root and POSITION = cached length
        unless CARRY names a row of the step before, the table covering length + headroom; drafts None:
        none) -> [B, depth + 4] on the device: depth + 1 tokens, then COUNT, NEXT_ROOT, NEXT_LENGTH."""
        rows = ints.shape[0]
        mode = step_mode(floats, ints)
        if not self.capture:
            host = np.zeros((rows, self.draft_width), dtype=np.int64) if drafts is None else drafts
            out = self._speculate(
                torch.from_numpy(ints), torch.from_numpy(floats), torch.from_numpy(host), tier, mode, defer
            )
        else:
            bucket = next(b for b in self.buckets if b >= rows)
            x = self.buffers[bucket]
            x.fill(ints, floats, drafts)
            key = (bucket, tier, mode, defer)
            if key not in self.spec_graphs:
                # Drafting tiers compile in the modes the engine's warm-up runs, so that a first top-k or top-p
                # request does not wait for a compilation.
                fused = tier == 0 or (
                    tier in self.compiled_tiers and bucket <= self.compiled_rows and mode in WARMED_MODES
                )
                run = self.compiled if fused else self._speculate
                self.spec_graphs[key] = CapturedStep(
                    lambda: run(x.ints, x.floats, x.drafts, tier, mode, defer), self.pool_handle
                )
            out = self.spec_graphs[key]()
        # Outside the graph: its warm-up runs before capture must all read the same carried values.
        self.last[: out.shape[0]].copy_(out[:, NEXT_ROOT])
        self.last_length[: out.shape[0]].copy_(out[:, NEXT_LENGTH])
        return out[:rows]

    def _speculate(
        self,
        ints: torch.Tensor,
        floats: torch.Tensor,
        drafts: torch.Tensor,
        tier_index: int,
        mode: str,
        defer: bool = False,
    ) -> torch.Tensor:
        tier = self.tiers[tier_index]
        ints, floats, drafts = ints.to(self.device), floats.to(self.device), drafts.to(self.device)
        table, carry = ints[:, TABLE:], ints[:, CARRY]
        carried, source = carry >= 0, carry.clamp(min=0)
        roots = torch.where(carried, self.last[source], ints[:, TOKEN])
        lengths = torch.where(carried, self.last_length[source], ints[:, POSITION])
        # Eager steps (CPU) read only as far as the longest row's tree; captured ones read the whole table.
        longest = None if self.capture else int(lengths.max())
        table_len = table.shape[1] * self.pool.block_size
        draft_len = table_len if longest is None else min(table_len, longest + self.max_nodes)
        rows = Drafting(roots, lengths, table, ints[:, STATE], drafts, draft_len, defer)
        tokens, trees = self.proposer.draft(rows, tier)  # [B, T]
        t = tier.num_nodes
        positions = lengths[:, None] + trees.depths
        seq = lengths[:, None] + tier.node_ids[None, :]
        region = lengths[:, None, None] + trees.paths  # [B, T, depth + 1]
        attn_len = self.max_seq_len if longest is None else longest + t
        count = (trees.depths + 1).expand(tokens.shape[0], -1)
        hidden, captured = self._verify(tokens, positions, self.pool.slots(table, seq), table, region, count, attn_len)
        valid = tier.node_ids[None, :] <= drafts[:, DRAFT_COUNT, None]
        nxt = self._next_tokens(hidden, ints, floats, positions, mode)  # [B, T]: the token after each node
        if tier.depth:
            path, num, out = accept_rows(tier, tokens, nxt, valid, trees)
        else:  # a plain step: the root's next token, nothing to accept
            num = torch.zeros_like(lengths)
            path, out = num[:, None], nxt
        done = Verified(path, num, out, hidden, captured)
        self._compact(tier, table, lengths, path)
        self.proposer.accepted(rows, tier, done)
        following = out.gather(1, num[:, None])
        return torch.cat([out, num[:, None], following, (lengths + num + 1)[:, None]], dim=1)

    def _verify(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        region: torch.Tensor,
        count: torch.Tensor,
        attn_len: int,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The target over every row's tree: node t of row b reads its row's text (the sequence indices below
        region[b, t, 0], its root's), then its path from the root, region[b, t, :count[b, t]]."""
        prefix = region[:, :, 0]
        view = PagedView(self.pool, positions, slots, table, prefix[:, 0] + 1, attn_len, prefix, region, count)
        return self.target(tokens, paged_context(view, self.target.rotary), self.capture_layers)

    def _compact(self, tier: Tier, table: torch.Tensor, lengths: torch.Tensor, path: torch.Tensor) -> None:
        """Each row's accepted path to sequence indices length .. length + depth, in every layer."""
        if tier.depth == 0:
            return  # the root is already in place
        src = self.pool.slots(table, lengths[:, None] + path)
        dst = self.pool.slots(table, lengths[:, None] + tier.node_ids[None, : tier.depth + 1])
        self.pool.move(src, dst)

    def _next_tokens(
        self, hidden: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, positions: torch.Tensor, mode: str
    ) -> torch.Tensor:
        """The token the target emits after each node: the argmax, or the draw a plain step would make at
        that position (Gumbel-max over the row's seed and the position drawn), so that sampled output does
        not depend on the drafts or the tier either."""
        b, t = positions.shape
        logits = self.target.logits(hidden.reshape(b * t, -1))
        if mode == "greedy":
            return argmax_rows(logits).view(b, t)
        per_node = ints.repeat_interleave(t, dim=0), floats.repeat_interleave(t, dim=0)
        return self._choose(
            logits, per_node[1], per_node[0][:, TOP_K], per_node[0][:, SEED], positions.reshape(-1) + 1, mode
        ).view(b, t)

    def _after_prefill(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        row: torch.Tensor,
        hidden: torch.Tensor,
        captured: list[torch.Tensor],
        last: torch.Tensor,
        first: torch.Tensor | None,
        attn_len: int,
    ) -> None:
        chunk = Chunk(row[STATE].view(1), tokens, positions, row[None, TABLE:], hidden, captured, last, first, attn_len)
        self.proposer.prefill(chunk)


def accept_rows(
    tier: Tier, tokens: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor, trees: Trees
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's longest path of drafts that the target itself emits: node i is accepted when its token
    is nxt at its parent (and so are its ancestors). With nxt the argmax this is exact greedy decoding;
    with nxt the target's own seeded draws it is lossless sampling whose output is plain sampling's.
    tokens, nxt, valid [B, T], trees: the rows' (a static tier's: tier.trees) -> (path [B, depth + 1], accepted
    count [B], tokens [B, depth + 1]: the accepted drafts, then the target's token after the last of them)."""
    rows, t = tokens.shape
    ok = (tokens == nxt.gather(1, trees.parent_or_root.expand(rows, t))) & valid
    ok[:, 0] = True
    path_ok = ~(trees.mask & ~ok[:, None, :]).any(-1)  # [B, T]: the whole root path matches
    depths = trees.depths.expand(rows, t)
    best = torch.where(path_ok, depths, -1).argmax(-1)  # the deepest, first on ties
    path = trees.paths.expand(rows, -1, -1).gather(1, best[:, None, None].expand(-1, 1, tier.depth + 1))[:, 0]
    num = depths.gather(1, best[:, None])[:, 0]
    drafted = tokens.gather(1, path[:, tier.path_next])
    out = torch.where(tier.node_ids[None, : tier.depth + 1] < num[:, None], drafted, nxt.gather(1, best[:, None]))
    return path, num, out
