"""CUDA graphs (and torch.compile) for the fixed-shape steps: the target's decode and verification
passes, and an EAGLE drafter's whole step.

A graph replays fixed kernels on fixed addresses, so a captured forward cannot slice the KV cache
to the current length. The context it gets carries the length as a device tensor instead
(`model.full_slot_context`): our attention kernel (`kernels.attention.slot_attention`) reads the slots
below it and the step's own region, and without the kernels SDPA reads every slot through a mask
built from it. Inputs are copied into static buffers
before each replay; outputs are the graph's static tensors, valid until the next replay of any graph
in the same pool, which is why callers copy what they keep.

Inside a graph, the ~20 small kernels of a decoder layer (float32 norms, rotary, cache writes, the
attention mask) still cost a few microseconds each: at batch 1 they, not the weight reads, set the
step time. torch.compile fuses them, so on CUDA the captured function is the compiled one.
SPECPIPE_COMPILE=0 turns compilation off; a compiler failure falls back to the eager function.

The target keeps one graph per token count, captured on first use: decode steps are 1 token, a
static tree always has the same size, EAGLE-2's dynamic tree always keeps max_draft_len nodes, and an
n-gram or draft-model chain has at most k + 1. A prompt is padded to a power of two and replays as
that many tokens under a causal mask. Trees over MAX_GRAPH_TOKENS and prompts over
MAX_PREFILL_TOKENS run eagerly.
Greedy verification has graphs of its own that also accept and compact the accepted path's KV: for a
small target those ~40 small ops, launched one by one, cost more host time than the pass itself. An
EAGLE drafter's step goes into the same graph, so a speculative step is one replay.

Off CUDA the same objects run their functions directly (no capture), so the CPU tests cover this
module's buffers and flow.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.engine.acceptance import Acceptance, accept_greedy
from pipeline.engine.model import KVCache, Transformer, full_slot_context
from pipeline.engine.sampling import argmax_rows
from pipeline.engine.tree import DraftTree
from pipeline.errors import UserError

MAX_GRAPH_TOKENS = 256  # trees up to 255 draft tokens (EAGLE-2 deep trees) still replay as graphs
# Prompts up to MAX_PREFILL_TOKENS are padded to a power of two of at least this many tokens and replay
# as one graph each. Run eagerly, a prefill of SmolLM2 cost the H200's host 36 ms (30 layers of
# launches and Triton's Python launcher; 2.4 ms on the device), plus about 36 ms more for each new
# prompt length (cuDNN attention plans a graph per shape): a quarter of a 256-token request.
MIN_PREFILL_BUCKET = 16
# Past the widest tree: 4 of MT-bench's 80 first turns have 286-402 tokens with SmolLM2's chat template.
MAX_PREFILL_TOKENS = 512


def prefill_bucket(num_tokens: int, limit: int) -> int | None:
    """The padded length a prompt of num_tokens runs at (a power of two), None past `limit`."""
    bucket = max(MIN_PREFILL_BUCKET, 1 << max(num_tokens - 1, 0).bit_length())
    return bucket if bucket <= limit else None


def prefill_buckets(limit: int) -> list[int]:
    """Every padded prompt length up to `limit`."""
    buckets, bucket = [], MIN_PREFILL_BUCKET
    while bucket <= limit:
        buckets.append(bucket)
        bucket *= 2
    return buckets


# Eager runs before capture, on a side stream: they create cuBLAS handles and workspaces, which
# capture may not do, compile the function, and settle the allocator so the graph's pool holds
# only steady-state blocks.
CAPTURE_WARMUP_RUNS = 2
COMPILE_ENV = "SPECPIPE_COMPILE"
# torch.compile's mode: max-autotune-no-cudagraphs benchmarks kernel configurations (minutes more
# compilation); unset = inductor's default. The modes that add inductor's own CUDA graphs
# (reduce-overhead, max-autotune) cannot run inside the engine's captures.
COMPILE_MODE_ENV = "SPECPIPE_COMPILE_MODE"
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def compile_mode() -> str:
    mode = os.environ.get(COMPILE_MODE_ENV) or "default"
    if mode not in COMPILE_MODES:
        raise UserError(
            f"{COMPILE_MODE_ENV}={mode}: use one of {', '.join(COMPILE_MODES)} (the engine captures "
            "its own CUDA graphs, so modes that add inductor's cannot run inside them)"
        )
    return mode


# Every engine in a process compiles the same code objects again (new self, new shapes); the default
# limit of 8 would silently leave later engines eager.
DYNAMO_CACHE_LIMIT = 256


def compile_enabled() -> bool:
    return os.environ.get(COMPILE_ENV, "1") != "0"


class Compiled:
    """fn through torch.compile (fullgraph), or fn itself when disabled or when compiling fails."""

    def __init__(self, fn: Callable[..., Any], enabled: bool | None = None):
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None
        if compile_enabled() if enabled is None else enabled:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, DYNAMO_CACHE_LIMIT)
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, DYNAMO_CACHE_LIMIT
            )
            self.compiled = torch.compile(fn, fullgraph=True, mode=compile_mode())

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001 - a compiler bug must cost speed, never the request
                print(
                    f"specpipe: torch.compile failed ({type(exc).__name__}: {str(exc)[:200]}); running eagerly",
                    file=sys.stderr,
                )
                self.compiled = None
        return self.fn(*args)


class CapturedStep:
    """fn() over static buffers, captured as one CUDA graph on its first call and replayed after."""

    def __init__(self, fn: Callable[[], Any], pool: Any = None, capture: bool = True):
        self.fn = fn
        self.capture = capture
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None

    def __call__(self) -> Any:
        if not self.capture:
            return self.fn()
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(CAPTURE_WARMUP_RUNS):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.outputs = self.fn()
        self.graph.replay()
        return self.outputs


@dataclass
class _Inputs:
    tokens: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    tree_mask: torch.Tensor  # [T, T] bool


class GraphedTarget:
    """Replays of `target`'s forward over `cache`, one CUDA graph per new-token count."""

    def __init__(
        self,
        target: Transformer,
        cache: KVCache,
        capture_layers: tuple[int, ...],
        max_tokens: int = MAX_GRAPH_TOKENS,
        compile: bool | None = None,
    ):
        self.target, self.cache, self.capture_layers = target, cache, capture_layers
        self.max_tokens = max_tokens
        device = cache.k.device
        self.length = torch.zeros((), dtype=torch.long, device=device)  # the prefix the new tokens follow
        self.slot_ids = torch.arange(cache.num_slots, device=device)
        self.offsets = torch.arange(max(max_tokens, MAX_PREFILL_TOKENS), device=device)
        self.capture = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # One compiled function for every token count: after the second count it recompiles once
        # with the count symbolic instead of once per tree size.
        self.forward = Compiled(self._forward, compile)
        self.greedy_verify = Compiled(self._greedy_verify, compile)
        self.inputs: dict[int, _Inputs] = {}
        self.graphs: dict[int, CapturedStep] = {}
        self.trees: dict[tuple[int, int], tuple[DraftTree, CapturedStep]] = {}  # static inputs, replay
        self.drafted: tuple[Callable[[], DraftTree], CapturedStep] | None = None  # the draft it captured
        self.prefills: dict[int, tuple[_Inputs, CapturedStep]] = {}  # prompt bucket -> static inputs, replay
        self.prefill_graphs = True

    def supports(self, num_tokens: int, prefix_len: int | torch.Tensor) -> bool:
        """Decode and verification steps (after a prefill: a device length always is) up to
        max_tokens new tokens."""
        return (isinstance(prefix_len, torch.Tensor) or prefix_len > 0) and num_tokens <= self.max_tokens

    def run(
        self,
        tokens: torch.Tensor,
        prefix_len: int | torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The same (final hidden [T, H], captured [T, H] each) as the eager forward, from a replay."""
        t = tokens.shape[0]
        x = self.inputs.get(t)
        if x is None:
            device = tokens.device
            x = self.inputs[t] = _Inputs(
                torch.zeros(t, dtype=torch.long, device=device),
                torch.zeros(t, dtype=torch.long, device=device),
                torch.ones(t, t, dtype=torch.bool, device=device),
            )
            self.graphs[t] = CapturedStep(
                lambda: self.forward(x.tokens, x.positions, x.tree_mask), self.pool, self.capture
            )
        # Inputs first: the capture's warm-up runs write this step's KV slots, so they must be real.
        self.length.fill_(prefix_len)
        x.tokens.copy_(tokens)
        x.positions.copy_(positions)
        if t > 1:  # one token's mask is [[True]] whatever the caller passes, and was made so
            assert tree_mask is not None, "a step of several tokens needs its tree mask"
            x.tree_mask.copy_(tree_mask)
        return self.graphs[t]()

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """A prompt's pass from an empty cache as one replay: padded to its bucket (causal, so the pads
        after the prompt change none of its rows; their KV lands in slots the decode overwrites before
        any query reads them). Copies of (hidden [n, H], captured [n, H] each); None when the prompt
        has no bucket or a capture failed (the caller runs it eagerly)."""
        n = tokens.shape[0]
        bucket = prefill_bucket(n, min(MAX_PREFILL_TOKENS, self.cache.num_slots))
        if bucket is None or not self.prefill_graphs:
            return None
        if bucket not in self.prefills:
            x = _Inputs(
                torch.zeros(bucket, dtype=torch.long, device=tokens.device),
                self.offsets[:bucket].clone(),
                torch.ones(bucket, bucket, dtype=torch.bool, device=tokens.device).tril(),
            )
            # The eager forward, not the compiled one: a third token count recompiles that with the
            # count symbolic, which took the H200 about 35 s an engine over the buckets, for a pass
            # that runs once a request (captured, its launches cost no host time anyway).
            self.prefills[bucket] = (
                x,
                CapturedStep(lambda: self._forward(x.tokens, x.positions, x.tree_mask), self.pool, self.capture),
            )
        x, step = self.prefills[bucket]
        self.length.fill_(0)
        x.tokens.zero_()
        x.tokens[:n].copy_(tokens)
        try:
            hidden, captured = step()
        except RuntimeError as exc:  # a capture the device refuses must cost speed, never the request
            print(
                f"specpipe: the {bucket}-token prefill graph failed ({str(exc)[:200]}); prompts run eagerly",
                file=sys.stderr,
            )
            self.prefill_graphs = False
            return None
        return hidden[:n].clone(), [c[:n].clone() for c in captured]

    def run_greedy_tree(
        self, tree: DraftTree, prefix_len: int | torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], Acceptance]:
        """Verify `tree` after prefix_len, accept greedily and move the accepted path's KV to the
        slots after the prefix, in one replay: (final hidden [T, H], captured [T, H] each,
        Acceptance), static tensors like run's."""
        key = (tree.num_nodes, tree.max_depth)
        if key not in self.trees:
            x = DraftTree(
                torch.zeros_like(tree.tokens),
                torch.zeros_like(tree.parents),
                torch.zeros_like(tree.depths),
                torch.ones_like(tree.mask),
                tree.max_depth,
            )
            self.trees[key] = x, CapturedStep(lambda: self._verify_and_compact(x), self.pool, self.capture)
        x, step = self.trees[key]
        self.length.fill_(prefix_len)
        for buffer, value in (
            (x.tokens, tree.tokens),
            (x.parents, tree.parents),
            (x.depths, tree.depths),
            (x.mask, tree.mask),
        ):
            buffer.copy_(value)
        hidden, captured, path, num_accepted, tokens = step()
        return hidden, captured, Acceptance(path, num_accepted, tokens)

    def run_greedy_draft(
        self, draft: Callable[[], DraftTree], prefix_len: int | torch.Tensor
    ) -> tuple[DraftTree, torch.Tensor, list[torch.Tensor], Acceptance]:
        """run_greedy_tree with the drafting in the same replay: `draft` lays out the tree from the
        proposer's own static buffers (the same each call; the graph captures its first). It must be
        idempotent, as verification is: the capture runs the whole step twice first."""
        if self.drafted is None or self.drafted[0] != draft:  # a new proposer drafts from buffers of its own
            self.drafted = draft, CapturedStep(lambda: self._draft_verify_and_compact(draft), self.pool, self.capture)
        self.length.fill_(prefix_len)
        tree, (hidden, captured, path, num_accepted, tokens) = self.drafted[1]()
        return tree, hidden, captured, Acceptance(path, num_accepted, tokens)

    def _draft_verify_and_compact(self, draft: Callable[[], DraftTree]) -> tuple[DraftTree, tuple[Any, ...]]:
        tree = draft()
        return tree, self._verify_and_compact(tree)

    def _verify_and_compact(self, tree: DraftTree) -> tuple[Any, ...]:
        out = self.greedy_verify(tree.tokens, tree.parents, tree.depths, tree.mask, tree.max_depth)
        # Outside the compiled function: inductor turns an index assignment into a view of the cache
        # into a copy of the whole cache out and back.
        self.cache.move(self.length + out[2], self.length + self.offsets[: tree.max_depth + 1])
        return out

    def _greedy_verify(
        self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor, max_depth: int
    ) -> tuple[Any, ...]:
        hidden, captured = self._forward(tokens, self.length + depths, tree_mask)
        acc = accept_greedy(
            DraftTree(tokens, parents, depths, tree_mask, max_depth), argmax_rows(self.target.logits(hidden))
        )
        return hidden, captured, acc.path, acc.num_accepted, acc.tokens

    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        t = tokens.shape[0]
        ctx = full_slot_context(
            self.cache,
            self.target.rotary,
            self.length,
            positions,
            self.length + self.offsets[:t],
            tree_mask,
            self.slot_ids,
        )
        hidden, captured = self.target(tokens[None], ctx, self.capture_layers)
        return hidden[0], [c[0] for c in captured]
