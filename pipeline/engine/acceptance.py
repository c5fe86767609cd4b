"""Which draft tokens the target accepts, given its logits at every tree node.

All rules return an `Acceptance` of fixed shape (max_depth + 1), so the caller can compact the KV
cache and feed the draft without knowing the accepted length on the host.

- greedy: a node is accepted when its token is the target's argmax at its parent, and so are its
  ancestors; the deepest such node wins. Output equals plain greedy decoding token for token.
- speculative sampling (lossless): walk down from the root; at each node try the children in
  order, accepting child x with probability min(1, p(x) / q(x)), else replacing p by the
  normalised residual max(p - q, 0) (Leviathan et al. 2023, Chen et al. 2023; the multi-child
  form is SpecInfer's). A deterministic proposal is q = one-hot(x). If no child is accepted, the
  bonus token is drawn from the last residual, so each emitted token has the target's distribution.
- typical (Medusa, not lossless): accept x when p(x) > min(threshold, alpha * exp(-H(p))).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engine.config import TypicalAcceptance
from pipeline.engine.sampling import SamplingParams, choose, target_probs
from pipeline.engine.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    path: torch.Tensor  # [D+1] node indices root..last accepted; entries past num_accepted are filler
    num_accepted: torch.Tensor  # [] long: draft tokens accepted
    tokens: torch.Tensor  # [D+1]: the accepted draft tokens, then the bonus token at index num_accepted

    @property
    def last_node(self) -> torch.Tensor:
        """[1] index of the deepest accepted node (where the bonus token was chosen)."""
        return self.path.gather(0, self.num_accepted.view(1))


def at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[index] for a 0-d index tensor, as a 0-d tensor. Plain indexing would make it a Python
    int, which torch.compile can only get by reading the device (the greedy step runs compiled)."""
    return values.gather(0, index.view(1)).view(())


def path_to(node: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """[D+1] node indices from the root down to `node` (a 0-d tensor), padded with `node`."""
    steps = tree.max_depth + 1
    steps_up = [node.view(1)]
    up = tree.parents.clamp(min=0)  # the root maps to itself
    for _ in range(tree.max_depth):
        steps_up.append(up[steps_up[-1]])
    walk = torch.cat(steps_up)  # node, parent, grandparent, ..., root, root
    depth = at(tree.depths, node)
    offsets = torch.arange(steps, device=node.device)
    return walk[(depth - offsets).clamp(min=0)]


def _finish(tree: DraftTree, best: torch.Tensor, bonus: torch.Tensor) -> Acceptance:
    path = path_to(best, tree)
    num = at(tree.depths, best)
    offsets = torch.arange(tree.max_depth + 1, device=best.device)
    drafted = tree.tokens[path[(offsets + 1).clamp(max=tree.max_depth)]]
    return Acceptance(path, num, torch.where(offsets < num, drafted, bonus.view(())))


def deepest_accepted(tree: DraftTree, node_ok: torch.Tensor) -> torch.Tensor:
    """The deepest node whose whole root path is ok (first in tree order on ties)."""
    node_ok = node_ok | (tree.parents < 0)
    path_ok = ~(tree.mask & ~node_ok[None, :]).any(-1)
    return torch.where(path_ok, tree.depths, -1).argmax()


def accept_greedy(tree: DraftTree, target_next: torch.Tensor) -> Acceptance:
    """target_next [N]: the target's argmax after each node."""
    node_ok = tree.tokens == target_next[tree.parents.clamp(min=0)]
    best = deepest_accepted(tree, node_ok)
    return _finish(tree, best, at(target_next, best))


def accept_typical(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, rule: TypicalAcceptance, generator: torch.Generator
) -> Acceptance:
    probs = target_probs(logits, params)
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
    threshold = torch.minimum(
        torch.full_like(entropy, rule.posterior_threshold), rule.posterior_alpha * torch.exp(-entropy)
    )
    parent = tree.parents.clamp(min=0)
    node_ok = probs[parent].gather(-1, tree.tokens[:, None]).squeeze(-1) > threshold[parent]
    best = deepest_accepted(tree, node_ok)
    return _finish(tree, best, choose(logits[best].view(1, -1), params, generator)[0])


def accept_sampling(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Acceptance:
    """Lossless speculative sampling over the tree. Walks on the host: the tree is small."""
    probs = target_probs(logits, params).double().cpu()
    draft = tree.draft_probs.double().cpu() if tree.draft_probs is not None else None
    tokens = tree.tokens.tolist()
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents.tolist()):
        if p >= 0:
            children.setdefault(p, []).append(i)
    node, residual = 0, probs[0].clone()
    while (child := _try_children(children.get(node, []), tokens, draft, residual, probs[node], generator)) is not None:
        node, residual = child, probs[child].clone()
    bonus = torch.multinomial(residual, 1, generator=generator)[0]
    device = tree.tokens.device
    return _finish(tree, torch.tensor(node, device=device), bonus.to(device))


def _try_children(
    children: list[int],
    tokens: list[int],
    draft: torch.Tensor | None,
    residual: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator,
) -> int | None:
    """Try each child in turn: the accepted one, or None with `residual` (in place) left for the bonus draw."""
    for child in children:
        x = tokens[child]
        q = draft[child] if draft is not None else _one_hot(x, residual)
        ratio = residual[x] / q[x] if q[x] > 0 else 0.0
        if torch.rand((), generator=generator, dtype=torch.float64) < ratio:
            return child
        residual.copy_(rejection_residual(residual, q, p))
    return None


def rejection_residual(p: torch.Tensor, q: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """After rejecting a draw from q: the normalised max(p - q, 0), what the next try must sample from."""
    residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    # An exhausted residual can only follow a certain rejection (p == q); keep p itself then.
    return residual / total if total > 0 else fallback


def _one_hot(x: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q
