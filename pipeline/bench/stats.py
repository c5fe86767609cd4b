"""Pure statistics over client-side timings: percentiles, inter-token latency, agreement, acceptance.

Every function takes recorded numbers and returns numbers, so the report can be re-derived and
tested without servers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestTiming:
    """One streamed request as seen by the client (seconds on one monotonic clock)."""

    start: float
    chunk_times: tuple[float, ...]  # arrival time of each chunk that carried tokens
    chunk_tokens: tuple[int, ...]  # tokens each of those chunks carried (>= 1)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def end(self) -> float:
        return self.chunk_times[-1] if self.chunk_times else self.start


def reconcile_counts(counts: Sequence[int], total: int) -> tuple[int, ...]:
    """Make per-chunk token counts sum to the server's final total, correcting from the last chunk
    back (running counts can be estimates); every chunk keeps at least one token."""
    out = list(counts)
    diff = total - sum(out)
    for i in range(len(out) - 1, -1, -1):
        if diff == 0:
            break
        step = diff if diff > 0 else max(diff, 1 - out[i])
        out[i] += step
        diff -= step
    return tuple(out)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation); NaN when there are no values."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def time_to_first_token(t: RequestTiming) -> float:
    return t.chunk_times[0] - t.start if t.chunk_times else math.nan


def inter_token_latencies(t: RequestTiming) -> list[float]:
    """Per-token latency after the first chunk: each gap between chunks is shared evenly by the
    tokens the later chunk carried.

    Speculative decoding delivers several tokens in one chunk; spreading the gap keeps one sample
    per token, so the systems are compared per token whatever their chunking.
    """
    out: list[float] = []
    for prev, cur, n in zip(t.chunk_times, t.chunk_times[1:], t.chunk_tokens[1:]):
        out.extend([(cur - prev) / n] * n)
    return out


def first_divergence(output: Sequence[int], reference: Sequence[int]) -> int:
    """Index of the first position where the two token sequences differ (the shorter length if one
    is a prefix of the other; the common length if equal)."""
    for i, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return i
    return min(len(output), len(reference))


@dataclass(frozen=True)
class Agreement:
    exact_match_rate: float
    mean_first_divergence: float  # tokens; equals the output length for exact matches
    count: int


def agreement(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> Agreement:
    """Exact-match rate and mean first-divergence position of outputs against greedy references."""
    if len(outputs) != len(references):
        raise ValueError(f"{len(outputs)} outputs but {len(references)} references")
    if not outputs:
        return Agreement(math.nan, math.nan, 0)
    exact = [list(o) == list(r) for o, r in zip(outputs, references)]
    div = [first_divergence(o, r) for o, r in zip(outputs, references)]
    return Agreement(sum(exact) / len(exact), float(np.mean(div)), len(exact))


def acceptance_length_from_counts(output_tokens: int, accepted_draft_tokens: int) -> float:
    """Tokens per target forward pass: every pass yields one token of its own plus the drafts it
    accepted, so passes = output_tokens - accepted_draft_tokens."""
    passes = output_tokens - accepted_draft_tokens
    if passes <= 0:
        return math.nan
    return output_tokens / passes


def acceptance_length_from_drafts(num_drafts: float, accepted_draft_tokens: float) -> float:
    """vLLM's definition (spec-decode counters): 1 + accepted tokens per drafting step."""
    if num_drafts <= 0:
        return math.nan
    return 1.0 + accepted_draft_tokens / num_drafts


@dataclass(frozen=True)
class RunSummary:
    requests: int
    output_tokens: int
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    output_tokens_per_s: float
    requests_per_s: float


def summarize(timings: Sequence[RequestTiming]) -> RunSummary:
    """Throughput over the wall time from the first send to the last chunk, latencies per request/token."""
    if not timings:
        raise ValueError("no requests to summarize")
    wall = max(t.end for t in timings) - min(t.start for t in timings)
    ttfts = [time_to_first_token(t) for t in timings if t.chunk_times]
    itls = [x for t in timings for x in inter_token_latencies(t)]
    tokens = sum(t.output_tokens for t in timings)
    return RunSummary(
        requests=len(timings),
        output_tokens=tokens,
        wall_s=wall,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        output_tokens_per_s=tokens / wall if wall > 0 else math.nan,
        requests_per_s=len(timings) / wall if wall > 0 else math.nan,
    )
