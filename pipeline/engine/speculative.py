"""The proposer interface every drafting method implements, and plain decoding as its trivial case.

Each decode step: the proposer lays out a tree whose root is the last emitted token; the target
verifies the whole tree in one pass; the proposer then sees which path was accepted and the
target's hidden states, and updates its own state (heads' input, draft KV cache, history).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline.engine.acceptance import Acceptance
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.tree import DraftTree, TreeBuffers, chain_buffers


@dataclass(frozen=True)
class TargetPass:
    """What one target forward produced for its new tokens (batch 1)."""

    hidden: torch.Tensor  # [T, H] after the final norm: the LM head's input
    captured: list[torch.Tensor]  # [T, H] residual stream after each layer in Proposer.capture_layers


@dataclass
class StepInput:
    """What a proposer may read to draft the next tree."""

    root: torch.Tensor  # [1] the last emitted token, not yet in the target's cache
    # target cache length; the root sits at this position. A device scalar while the loop runs
    # ahead of the host (only proposers with runs_ahead see that).
    length: int | torch.Tensor
    prompt: list[int]
    emitted: list[int]  # root included (the request's own list: read, never modify)
    params: SamplingParams
    generator: torch.Generator

    @property
    def history(self) -> list[int]:
        """Prompt + emitted tokens; built only by the proposers that read it (n-gram, draft model)."""
        return self.prompt + self.emitted


class Proposer(Protocol):
    capture_layers: tuple[int, ...]
    max_nodes: int  # the largest tree it proposes, root included (sizes the KV cache headroom)
    # propose and update read only device tensors, so greedy steps may queue up without host reads
    runs_ahead: bool
    # prepare(step) puts a step's inputs into static buffers and draft() lays out the tree from them
    # alone, so that the engine can capture the drafting with the verification in one CUDA graph
    drafts_from_buffers: bool

    def start(self, prompt: torch.Tensor, target: TargetPass, first: torch.Tensor) -> None:
        """After the prefill: prompt [n], the target's pass over it, and the first token [1]."""

    def propose(self, step: StepInput) -> DraftTree: ...

    def update(
        self,
        tree: DraftTree,
        acc: Acceptance,
        num_accepted: int | torch.Tensor,
        target: TargetPass,
        length: int | torch.Tensor,
    ) -> None:
        """After verification of `tree` at cache offset `length`; num_accepted and length are host
        ints, or device scalars for a proposer that runs ahead."""


class BufferDrafter(Proposer, Protocol):
    """A proposer whose drafts_from_buffers is True (EAGLE): the engine captures its draft() in the step's graph."""

    def prepare(self, step: StepInput) -> None: ...

    def draft(self) -> DraftTree: ...


class PlainProposer:
    """No drafting: the tree is the root alone, so each step is one plain decode step."""

    capture_layers: tuple[int, ...] = ()
    max_nodes = 1
    runs_ahead = True  # nothing to draft: greedy steps queue up on the device
    drafts_from_buffers = False

    def __init__(self, device: torch.device | str):
        self.buffers: TreeBuffers = chain_buffers(0, device)

    def start(self, prompt: torch.Tensor, target: TargetPass, first: torch.Tensor) -> None:
        pass

    def propose(self, step: StepInput) -> DraftTree:
        return DraftTree.from_buffers(step.root, self.buffers)

    def update(
        self,
        tree: DraftTree,
        acc: Acceptance,
        num_accepted: int | torch.Tensor,
        target: TargetPass,
        length: int | torch.Tensor,
    ) -> None:
        pass
