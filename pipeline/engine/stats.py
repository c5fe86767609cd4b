"""Speculative-decoding counters, per request and aggregated over requests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SpecStats:
    steps: int = 0  # target forward passes in decode (the prefill is not a step)
    draft_tokens: int = 0  # tree nodes proposed, root excluded
    accepted_tokens: int = 0  # draft tokens the target accepted
    drafted_per_depth: list[int] = field(default_factory=list)  # steps whose tree reached depth d+1
    accepted_per_depth: list[int] = field(default_factory=list)  # steps that accepted depth d+1

    def record(self, num_draft: int, max_depth: int, num_accepted: int) -> None:
        self.steps += 1
        if not (num_draft or max_depth or num_accepted):  # a plain step (most calls): nothing else to count
            return
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        _bump(self.drafted_per_depth, max_depth)
        _bump(self.accepted_per_depth, num_accepted)

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per target pass: accepted + 1 per step (1.0 for plain decoding)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_depth_acceptance(self) -> list[float]:
        """P(depth d accepted | the tree reached depth d)."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_depth + [0] * len(self.drafted_per_depth), self.drafted_per_depth)
        ]

    def merge(self, other: SpecStats) -> None:
        self.steps += other.steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        _add(self.drafted_per_depth, other.drafted_per_depth)
        _add(self.accepted_per_depth, other.accepted_per_depth)

    @classmethod
    def total(cls, many: Iterable[SpecStats]) -> SpecStats:
        out = cls()
        for s in many:
            out.merge(s)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            acceptance_length=self.acceptance_length,
            acceptance_rate=self.acceptance_rate,
            per_depth_acceptance=self.per_depth_acceptance,
        )
        return d


def _bump(counts: list[int], depth: int) -> None:
    """Count one step at every depth 1..depth."""
    counts.extend([0] * (depth - len(counts)))
    for d in range(depth):
        counts[d] += 1


def _add(into: list[int], other: list[int]) -> None:
    into.extend([0] * (len(other) - len(into)))
    for i, v in enumerate(other):
        into[i] += v
