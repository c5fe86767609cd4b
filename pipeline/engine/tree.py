"""Token trees for speculative verification: choices, presets, and the buffers built from them.

A tree is stored as `parents` (parent node index, -1 for the root) in topological order with
non-decreasing depth. Node 0 is the root: the last emitted token, whose KV is not yet cached.
Everything the verifier needs (attention mask, position offsets, retrieval paths) derives from
`parents`, so static trees (from choices) and dynamic trees (EAGLE-2) share one code path.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import UserError

Choices = list[list[int]]

# The default tree of Medusa and TensorRT-LLM (63 nodes, depth 4): each path lists the top-k rank
# taken at each depth. Order is by estimated acceptance probability.
MC_SIM_7B_63: Choices = [
    [0],
    [0, 0],
    [1],
    [0, 1],
    [2],
    [0, 0, 0],
    [1, 0],
    [0, 2],
    [3],
    [0, 3],
    [4],
    [0, 4],
    [2, 0],
    [0, 5],
    [0, 0, 1],
    [5],
    [0, 6],
    [6],
    [0, 7],
    [0, 1, 0],
    [1, 1],
    [7],
    [0, 8],
    [0, 0, 2],
    [3, 0],
    [0, 9],
    [8],
    [9],
    [1, 0, 0],
    [0, 2, 0],
    [1, 2],
    [0, 0, 3],
    [4, 0],
    [2, 1],
    [0, 0, 4],
    [0, 0, 5],
    [0, 0, 0, 0],
    [0, 1, 1],
    [0, 0, 6],
    [0, 3, 0],
    [5, 0],
    [1, 3],
    [0, 0, 7],
    [0, 0, 8],
    [0, 0, 9],
    [6, 0],
    [0, 4, 0],
    [1, 4],
    [7, 0],
    [0, 1, 2],
    [2, 0, 0],
    [3, 1],
    [2, 2],
    [8, 0],
    [0, 5, 0],
    [1, 5],
    [1, 0, 1],
    [0, 2, 1],
    [9, 0],
    [0, 6, 0],
    [0, 0, 0, 1],
    [1, 6],
    [0, 7, 0],
]

WIDE_SHALLOW_WIDTH = 8


def chain(depth: int) -> Choices:
    """A single path of `depth` top-1 tokens (what a draft model or n-gram proposes)."""
    return [[0] * d for d in range(1, depth + 1)]


PRESETS: dict[str, Choices] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    # The most probable prefixes of the default tree; the list is ordered so every prefix is closed.
    "top16": MC_SIM_7B_63[:16],
    "top32": MC_SIM_7B_63[:32],
    "wide8": [[rank] for rank in range(WIDE_SHALLOW_WIDTH)],
    "wide8x2": [[rank] for rank in range(WIDE_SHALLOW_WIDTH)] + [[rank, 0] for rank in range(WIDE_SHALLOW_WIDTH)],
    "chain4": chain(4),
}


def parse_choices(spec: str | Choices) -> Choices:
    """Choices from a preset name, `chain:N`, a JSON/Python literal, Triton's brace form, or a file."""
    if not isinstance(spec, str):
        return [list(map(int, path)) for path in spec]
    text = spec.strip()
    if text in PRESETS:
        return [list(p) for p in PRESETS[text]]
    if text.startswith("chain:"):
        try:
            return chain(int(text.split(":", 1)[1]))
        except ValueError:
            raise UserError(f"tree choices {spec!r}: chain length must be an integer, e.g. chain:4") from None
    if not text.startswith(("[", "{")) and Path(text).is_file():  # a literal may be longer than a file name
        text = Path(text).read_text()
    if text.lstrip().startswith("{"):  # Triton's form: {0}, {0, 0}, {1}
        text = "[" + text.replace("{", "[").replace("}", "]") + "]"
    try:
        value = ast.literal_eval(text)
        return [[int(x) for x in path] for path in value]
    except (ValueError, SyntaxError, TypeError):
        raise UserError(
            f"tree choices {spec!r}: not a preset ({', '.join(PRESETS)}), chain:N, or a list of paths like "
            "[[0], [0, 0], [1]]"
        ) from None


def validate_choices(
    choices: Choices, max_depth: int | None = None, max_draft_len: int | None = None, what: str = "choices"
) -> None:
    """Refuse trees the verifier cannot lay out: empty, duplicate or non-prefix-closed paths, too deep or too big."""
    if not choices:
        raise UserError(f"{what}: the tree is empty; give at least one path such as [[0]]")
    seen = {tuple(p) for p in choices}
    if len(seen) != len(choices):
        raise UserError(f"{what}: duplicate paths; each path may appear once")
    for path in choices:
        if not path or any(r < 0 for r in path):
            raise UserError(f"{what}: path {path} is empty or has a negative rank; ranks are top-k indices >= 0")
        if len(path) > 1 and tuple(path[:-1]) not in seen:
            raise UserError(
                f"{what}: path {path} has no parent {path[:-1]}; every prefix of a path must be in the tree"
            )
    depth = max(len(p) for p in choices)
    if max_depth is not None and depth > max_depth:
        raise UserError(
            f"{what}: depth {depth} exceeds {max_depth} (the number of draft heads/layers); use a shallower tree"
        )
    if max_draft_len is not None and len(choices) > max_draft_len:
        raise UserError(
            f"{what}: {len(choices)} nodes exceed max_draft_len {max_draft_len}; use a smaller tree or raise "
            "--max-draft-len"
        )


def choices_to_triton(choices: Choices) -> str:
    """The brace form the TensorRT-LLM Triton backend parses: `{0}, {0, 0}, {1}`."""
    return ", ".join("{" + ", ".join(map(str, p)) + "}" for p in choices)


@dataclass(frozen=True)
class TreeBuffers:
    """Device buffers of one tree shape; static trees build these once per engine."""

    parents: torch.Tensor  # [T] long, -1 for the root
    depths: torch.Tensor  # [T] long: position offset of each node from the root
    ranks: torch.Tensor  # [T] long: top-k rank of each node under its parent (0 for the root)
    mask: torch.Tensor  # [T, T] bool: mask[i, j] = node j is node i or one of its ancestors
    retrieve_paths: torch.Tensor  # [leaves, max_depth + 1] long node indices root..leaf, -1 padded
    max_depth: int

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]

    def to(self, device: torch.device | str) -> TreeBuffers:
        return TreeBuffers(
            self.parents.to(device),
            self.depths.to(device),
            self.ranks.to(device),
            self.mask.to(device),
            self.retrieve_paths.to(device),
            self.max_depth,
        )


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """mask[i, j] = j is i or an ancestor of i; `max_depth` gather steps, no host sync."""
    n = parents.shape[-1]
    idx = torch.arange(n, device=parents.device)
    mask = idx[:, None] == idx[None, :]
    cur = idx
    for _ in range(max_depth):
        cur = torch.where(cur >= 0, parents[cur.clamp(min=0)], cur)
        mask |= (cur[:, None] == idx[None, :]) & (cur[:, None] >= 0)
    return mask


NON_LEAF_SLACK = 4  # tree_from_ranks with a non-leaf bound ranks this many times num_paths paths


def tree_from_ranks(
    ranks: torch.Tensor, num_paths: int, max_rank: int, max_non_leaves: int | None = None
) -> tuple[Choices, float]:
    """The static tree of `num_paths` paths that accepts the most on data, and its mean acceptance length.

    ranks[n, d] is where, among head d's guesses at sample n, the token the target actually emits
    sits (0 = top-1; anything >= max_rank counts as a miss). Path (r_1..r_k) is accepted at sample n
    exactly when ranks[n, i] == r_i for every i <= k, so its frequency is measured, not a product of
    per-head accuracies. At most one node per depth can be accepted, hence the mean acceptance
    length of a tree is 1 + the sum of its paths' frequencies. A child is never more frequent than its
    parent, so taking the most frequent paths (shallower first on ties) gives a prefix-closed tree.
    max_non_leaves (TensorRT-LLM's max_non_leaves_per_layer): a path whose parent would be one non-leaf
    too many at its depth is passed over, and so are its descendants (the tree is then the greedy best).
    """
    n, depth = ranks.shape
    # Paths rarer than the keep-th most frequent so far cannot enter the tree, nor can their children; a bound
    # on non-leaves passes some over, so it keeps more.
    keep = num_paths if max_non_leaves is None else NON_LEAF_SLACK * num_paths
    scored: dict[tuple[int, ...], float] = {}
    frontier: dict[tuple[int, ...], torch.Tensor] = {(): torch.ones(n, dtype=torch.bool)}
    for d in range(depth):
        nxt: dict[tuple[int, ...], torch.Tensor] = {}
        for path, rows in frontier.items():
            for r in range(max_rank):
                hit = rows & (ranks[:, d] == r)
                count = int(hit.sum())
                if count:
                    nxt[path + (r,)] = hit
                    scored[path + (r,)] = count / n
        if len(scored) > keep:
            bar = sorted(scored.values(), reverse=True)[keep - 1]
            nxt = {p: rows for p, rows in nxt.items() if scored[p] >= bar}
        frontier = nxt
    best: list[tuple[int, ...]] = []
    kept: set[tuple[int, ...]] = {()}
    non_leaves: dict[int, set[tuple[int, ...]]] = {}
    for path in sorted(scored, key=lambda p: (-scored[p], len(p), p)):
        parent = path[:-1]
        if len(best) == num_paths:
            break
        if parent not in kept:
            continue
        at_depth = non_leaves.setdefault(len(parent), set())
        if max_non_leaves is not None and parent not in at_depth and len(at_depth) >= max_non_leaves:
            continue
        at_depth.add(parent)
        kept.add(path)
        best.append(path)
    return [list(p) for p in best], 1.0 + sum(scored[p] for p in best)


def expected_acceptance(ranks: torch.Tensor, choices: Choices) -> float:
    """Mean acceptance length of a static tree on the same data as tree_from_ranks measures."""
    total = 0.0
    for path in choices:
        if len(path) <= ranks.shape[1]:
            hit = torch.ones(ranks.shape[0], dtype=torch.bool)
            for d, r in enumerate(path):
                hit &= ranks[:, d] == r
            total += float(hit.float().mean())
    return 1.0 + total


def build_tree(choices: Choices) -> TreeBuffers:
    """Lay choices out as a tree: root first, then paths sorted by (depth, ranks) as Medusa does."""
    ordered = sorted((tuple(p) for p in choices), key=lambda p: (len(p), p))
    index: dict[tuple[int, ...], int] = {(): 0}
    parents, depths, ranks = [-1], [0], [0]
    for path in ordered:
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        depths.append(len(path))
        ranks.append(path[-1])
    has_child = {index[p[:-1]] for p in ordered}
    leaves = [i for i in range(len(parents)) if i not in has_child]
    max_depth = max(depths)
    paths = []
    for leaf in leaves:
        up: list[int] = []
        node = leaf
        while node >= 0:
            up.append(node)
            node = parents[node]
        paths.append(up[::-1] + [-1] * (max_depth + 1 - len(up)))
    parents_t = torch.tensor(parents, dtype=torch.long)
    return TreeBuffers(
        parents=parents_t,
        depths=torch.tensor(depths, dtype=torch.long),
        ranks=torch.tensor(ranks, dtype=torch.long),
        mask=ancestor_mask(parents_t, max_depth),
        retrieve_paths=torch.tensor(paths, dtype=torch.long),
        max_depth=max_depth,
    )


@dataclass(frozen=True)
class DraftTree:
    """One step's candidates: a tree shape plus the token at each node (node 0 = the root token)."""

    tokens: torch.Tensor  # [T] long
    parents: torch.Tensor  # [T] long, -1 for the root
    depths: torch.Tensor  # [T] long
    mask: torch.Tensor  # [T, T] bool ancestor-or-self
    max_depth: int  # host-side bound on depths, sizes the fixed-length acceptance buffers
    # [T, V] distribution node i's token was drawn from; None means chosen deterministically
    # (top-k ranks, prompt lookup), which speculative sampling treats as a one-hot proposal.
    draft_probs: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def from_buffers(
        cls, tokens: torch.Tensor, buffers: TreeBuffers, draft_probs: torch.Tensor | None = None
    ) -> DraftTree:
        return cls(tokens, buffers.parents, buffers.depths, buffers.mask, buffers.max_depth, draft_probs)


def chain_buffers(length: int, device: torch.device | str = "cpu") -> TreeBuffers:
    """A root followed by `length` nodes in a line (length 0: the root alone, i.e. plain decoding)."""
    return (
        build_tree(chain(length)).to(device)
        if length
        else TreeBuffers(
            parents=torch.tensor([-1], device=device),
            depths=torch.zeros(1, dtype=torch.long, device=device),
            ranks=torch.zeros(1, dtype=torch.long, device=device),
            mask=torch.ones(1, 1, dtype=torch.bool, device=device),
            retrieve_paths=torch.zeros(1, 1, dtype=torch.long, device=device),
            max_depth=0,
        )
    )


# Subtracted per depth from path scores so that a child never outranks its parent on a tie:
# the kept set of a dynamic tree is then always closed under prefixes.
DEPTH_TIE_BREAK = 1e-4


@dataclass
class Candidates:
    """A dynamic tree's candidates depth by depth, along the last dimension (one row: [C]; B rows: [B, C]):
    tokens, parents (candidate ids; -1: the root), depths and path log-probabilities, for select_tree(s)."""

    tokens: list[torch.Tensor]
    parents: list[torch.Tensor]
    depths: list[torch.Tensor]
    scores: list[torch.Tensor]

    @classmethod
    def of_root(cls, tokens: torch.Tensor, scores: torch.Tensor) -> Candidates:
        """Depth 1: the root's children."""
        return cls([tokens], [torch.full_like(tokens, -1)], [torch.ones_like(tokens)], [scores])

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> int:
        """The next depth's candidates; returns the first one's id (the candidates before them)."""
        first = sum(t.shape[-1] for t in self.tokens)
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.depths.append(torch.full_like(tokens, len(self.depths) + 1))
        self.scores.append(scores)
        return first

    def joined(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, parents, depths, scores) of every depth, as select_tree(s) takes them."""
        return (
            torch.cat(self.tokens, -1),
            torch.cat(self.parents, -1),
            torch.cat(self.depths, -1),
            torch.cat(self.scores, -1),
        )


def select_tree(
    root: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    scores: torch.Tensor,
    max_draft_len: int,
    max_depth: int,
    topk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = torch.topk,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dynamic tree (EAGLE-2's selection) from candidates whose parents are candidate ids (-1: the root)
    and whose scores are path log-probabilities: the max_draft_len best, ordered by depth, under `root`.
    Returns (tokens, parents, depths, ancestor mask), the root at node 0. `topk` does both sorts (a
    kernel of the caller's may stand in for torch.topk)."""
    num_nodes = 1 + min(max_draft_len, tokens.shape[0])
    rows = select_trees(root, tokens[None], parents[None], depths[None], scores[None], num_nodes, max_depth, topk)
    tree_tokens, tree_parents, tree_depths, paths = (t[0] for t in rows)
    mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool, device=tokens.device).scatter_(1, paths, True)
    return tree_tokens, tree_parents, tree_depths, mask


def select_trees(
    roots: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    scores: torch.Tensor,
    num_nodes: int,
    max_depth: int,
    topk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = torch.topk,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """select_tree for each of B rows at once: candidates [B, C] (parents are candidate ids, -1 the root)
    -> the num_nodes - 1 best under each row's root, ordered by depth: (tokens [B, T], parents [B, T] (-1 at
    the root), depths [B, T], paths [B, T, max_depth + 1]: node indices root .. node, padded with the node)."""
    rows, count = tokens.shape
    n = num_nodes - 1
    keep = topk(scores - DEPTH_TIE_BREAK * depths, n)[1]  # [B, n]
    keep = keep.gather(1, topk(-(depths.gather(1, keep) * count + keep).float(), n)[1])  # by depth, then id
    order = torch.arange(1, num_nodes, device=tokens.device).expand(rows, n)
    new_index = torch.zeros_like(tokens).scatter_(1, keep, order)
    kept = parents.gather(1, keep)
    tree_parents = torch.cat(
        [kept.new_full((rows, 1), -1), torch.where(kept >= 0, new_index.gather(1, kept.clamp(min=0)), 0)], 1
    )
    tree_depths = torch.cat([depths.new_zeros(rows, 1), depths.gather(1, keep)], 1)
    # up[..., i]: each node's i-th ancestor (the root its own); node t's path entry j is up[depth(t) - j].
    up = [torch.arange(num_nodes, device=tokens.device).expand(rows, num_nodes)]
    for _ in range(max_depth):
        up.append(tree_parents.clamp(min=0).gather(1, up[-1]))
    steps = torch.arange(max_depth + 1, device=tokens.device)
    paths = torch.stack(up, -1).gather(2, (tree_depths[:, :, None] - steps).clamp(min=0))
    return torch.cat([roots[:, None], tokens.gather(1, keep)], 1), tree_parents, tree_depths, paths
