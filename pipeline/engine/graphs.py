"""CUDA graphs of the target forward for a fixed number of new tokens (plain decode and tree verification).

A graph replays fixed kernels on fixed addresses, so a captured forward cannot slice the KV cache
to the current length. It attends over every cache slot instead, through a mask built on the
device from a device length: new token i sees slot s when s < length (the accepted text) or when
s = length + j and tree_mask[i, j] (its own tree ancestors). Inputs are copied into static
buffers before each replay; outputs are the graph's static tensors, valid until the next replay
of any graph (they share one memory pool), which is why callers copy what they keep.

One graph per token count, captured on first use: decode steps are 1 token, a static tree always
has the same size, EAGLE-2's dynamic tree always keeps max_draft_len nodes, and an n-gram or
draft-model chain has at most k + 1. Prefills and trees over MAX_GRAPH_TOKENS run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.engine.model import ForwardContext, KVCache, Rotary, Transformer

MAX_GRAPH_TOKENS = 128
# Eager runs before capture, on a side stream: they create cuBLAS handles and workspaces, which
# capture may not do, and settle the allocator so the graph's pool holds only steady-state blocks.
CAPTURE_WARMUP_RUNS = 2


@dataclass
class _Graph:
    tokens: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    tree_mask: torch.Tensor  # [T, T] bool
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None  # [T, H] output
    captured: list[torch.Tensor] = field(default_factory=list)  # [T, H] per capture layer


class GraphedTarget:
    """Replays of `target`'s forward over `cache`, one CUDA graph per new-token count."""

    def __init__(self, target: Transformer, cache: KVCache, capture_layers: tuple[int, ...],
                 max_tokens: int = MAX_GRAPH_TOKENS):
        self.target, self.cache, self.capture_layers = target, cache, capture_layers
        self.max_tokens = max_tokens
        device = cache.k.device
        self.length = torch.zeros((), dtype=torch.long, device=device)  # the prefix the new tokens follow
        self.slot_ids = torch.arange(cache.num_slots, device=device)
        self.offsets = torch.arange(max_tokens, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Graph] = {}

    def supports(self, num_tokens: int, prefix_len: int) -> bool:
        """Decode and verification steps (after a prefill) up to max_tokens new tokens."""
        return prefix_len > 0 and num_tokens <= self.max_tokens

    def run(self, tokens: torch.Tensor, prefix_len: int, positions: torch.Tensor,
            tree_mask: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The same (final hidden [T, H], captured [T, H] each) as the eager forward, from a replay."""
        t = tokens.shape[0]
        g = self.graphs.get(t)
        new = g is None
        if new:
            g = self.graphs[t] = _Graph(torch.zeros(t, dtype=torch.long, device=tokens.device),
                                        torch.zeros(t, dtype=torch.long, device=tokens.device),
                                        torch.ones(t, t, dtype=torch.bool, device=tokens.device))
        # Inputs first: the capture's warm-up runs write this step's KV slots, so they must be real.
        self.length.fill_(prefix_len)
        g.tokens.copy_(tokens)
        g.positions.copy_(positions)
        if tree_mask is None:  # only a single token reaches here without a tree
            g.tree_mask.fill_(True)
        else:
            g.tree_mask.copy_(tree_mask)
        if new:
            self._capture(g)
        g.graph.replay()
        return g.hidden, g.captured

    def _capture(self, g: _Graph) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP_RUNS):
                self._forward(g)
        torch.cuda.current_stream().wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.hidden, g.captured = self._forward(g)

    def _forward(self, g: _Graph) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ctx = full_slot_context(self.cache, self.target.rotary, self.length, g.positions, g.tree_mask,
                                self.slot_ids, self.offsets)
        hidden, captured = self.target(g.tokens[None], ctx, self.capture_layers)
        return hidden[0], [c[0] for c in captured]


def full_slot_context(cache: KVCache, rotary: Rotary, length: torch.Tensor, positions: torch.Tensor,
                      tree_mask: torch.Tensor, slot_ids: torch.Tensor, offsets: torch.Tensor) -> ForwardContext:
    """Like model.make_context, but reading every cache slot and taking the prefix length as a
    device tensor, so that the same kernels serve every step of a replayed graph."""
    t = positions.shape[0]
    rel = slot_ids - length  # slot index relative to the first new token
    in_tree = (rel >= 0) & (rel < t)
    mask = (rel < 0) | (tree_mask[:, rel.clamp(0, t - 1)] & in_tree)  # [T, slots]
    slots = (length + offsets[:t])[None]
    return ForwardContext(positions[None], slots, cache, cache.num_slots, mask[None, None], False, rotary)
