"""Measure one running OpenAI-compatible server: warm-up, then every concurrency level, same client code."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from pipeline.bench import stats
from pipeline.bench.stream_client import completion_request, run_concurrent, stream_completion

WARMUP_MAX_TOKENS = 16

CounterReader = Callable[[], dict[str, float]]


def warm_up(base_url: str, model: str, prompts: Sequence[str], requests_count: int) -> None:
    """Short requests first, so one-time costs (compilation, caches, lazy loads) stay out of the numbers."""
    for prompt in list(prompts)[:requests_count]:
        stream_completion(base_url, completion_request(model, prompt, WARMUP_MAX_TOKENS))


def measure_level(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    references: Sequence[str],
    max_tokens: int,
    concurrency: int,
    tokenize: Callable[[str], list[int]],
    label: str,
    read_counters: CounterReader | None = None,
) -> dict[str, Any]:
    """All prompts at one concurrency level: latency/throughput summary, acceptance, agreement."""
    before = read_counters() if read_counters else {}
    load_before = os.getloadavg()[0]
    bodies = [completion_request(model, p, max_tokens) for p in prompts]
    results = run_concurrent(base_url, bodies, concurrency, desc=f"{label} c={concurrency}")
    after = read_counters() if read_counters else {}
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    summary = stats.summarize([r.timing for r in results])
    agree = stats.agreement([tokenize(r.text) for r in results], [tokenize(t) for t in references])
    per_request = [r.spec["acceptance_length"] for r in results if r.spec and r.spec.get("acceptance_length")]
    return {
        "concurrency": concurrency,
        **asdict(summary),
        "acceptance_length": _acceptance(results, before, after, per_request),
        "acceptance_lengths": per_request,
        "spec_counters_delta": delta,
        "vllm_acceptance_per_draft": stats.acceptance_length_from_drafts(
            delta.get("drafts", 0.0), delta.get("accepted_tokens", 0.0)
        ),
        "exact_match_rate": agree.exact_match_rate,
        "mean_first_divergence": agree.mean_first_divergence,
        "finish_reasons": sorted({str(r.finish_reason) for r in results}),
        "load_avg_1min_before": load_before,
        "outputs": [r.text for r in results],
    }


def _acceptance(
    results: Sequence[Any], before: dict[str, float], after: dict[str, float], per_request: list[float]
) -> float | None:
    """Tokens per target forward pass for both systems, tokens / (tokens - accepted drafts): ours
    with accepted counts from each response's `spec` field, vLLM's from its counters' increase.

    vLLM's own figure (1 + accepted / drafts) skips steps where ngram found no match, so it reads
    higher; it is kept beside this one as `vllm_acceptance_per_draft`.
    """
    if per_request:
        counted = [r for r in results if r.spec and r.spec.get("acceptance_length")]
        tokens = sum(r.completion_tokens for r in counted)
        return stats.acceptance_length_from_counts(tokens, sum(r.spec["accepted_draft_tokens"] for r in counted))
    if "drafts" not in after:
        return None  # not a speculative server
    accepted = after.get("accepted_tokens", 0.0) - before.get("accepted_tokens", 0.0)
    return stats.acceptance_length_from_counts(sum(r.completion_tokens for r in results), int(accepted))
