"""Draft-model speculation: a smaller model of the same family proposes a chain of k tokens.

The draft keeps its own KV cache. It has cached every accepted token up to `valid`; each step it
first feeds what it has not seen (the tokens since `valid`, root included), then drafts k tokens
one at a time. After verification only the accepted prefix of its chain stays valid.
"""

from __future__ import annotations

import torch

from pipeline.engine.acceptance import Acceptance
from pipeline.engine.model import Transformer, make_context
from pipeline.engine.sampling import target_probs
from pipeline.engine.speculative import StepInput, TargetPass
from pipeline.engine.tree import DraftTree, chain_buffers


class DraftModelProposer:
    capture_layers: tuple[int, ...] = ()
    runs_ahead = False  # it feeds the emitted text to its own model
    drafts_from_buffers = False

    def __init__(self, draft: Transformer, k: int, cache_slots: int):
        self.draft, self.k = draft, k
        self.device = draft.lm_head.weight.device
        self.cache = draft.new_cache(cache_slots + k + 1)
        self.chain = chain_buffers(k, self.device)
        self.max_nodes = k + 1
        self.valid = 0  # draft cache holds the accepted tokens at positions [0, valid)

    def start(self, prompt: torch.Tensor, target: TargetPass, first: torch.Tensor) -> None:
        self.valid = 0

    def _feed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        n = tokens.shape[0]
        ctx = make_context(
            self.cache, self.draft.rotary, start, torch.arange(start, start + n, device=self.device), None
        )
        hidden, _ = self.draft(tokens[None], ctx)
        return self.draft.logits(hidden[0, -1:])

    def propose(self, step: StepInput) -> DraftTree:
        length = int(step.length)  # a host int: this proposer does not run ahead
        unseen = torch.tensor(step.history[self.valid : length + 1], device=self.device)
        logits = self._feed(unseen, self.valid)
        tokens, probs = [step.root], []
        for i in range(self.k):
            if step.params.greedy:
                token = logits.argmax(-1)
            else:
                q = target_probs(logits, step.params)
                token = torch.multinomial(q.cpu().double(), 1, generator=step.generator)[0].to(self.device)
                probs.append(q)
            tokens.append(token)
            if i + 1 < self.k:
                logits = self._feed(token, length + 1 + i)
        self.valid = length + self.k  # root and the first k-1 guesses are cached
        draft_probs = None
        if probs:
            draft_probs = torch.cat([torch.zeros_like(probs[0])] + probs)  # the root was not drafted
        return DraftTree.from_buffers(torch.cat(tokens), self.chain, draft_probs)

    def update(
        self,
        tree: DraftTree,
        acc: Acceptance,
        num_accepted: int | torch.Tensor,
        target: TargetPass,
        length: int | torch.Tensor,
    ) -> None:
        # host ints: this proposer does not run ahead
        self.valid = min(self.valid, int(length) + int(num_accepted) + 1)
