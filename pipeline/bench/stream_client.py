"""The one OpenAI streaming client both systems are measured with: `/v1/completions`, SSE, timed per chunk.

Each request asks for usage on every chunk (`stream_options.continuous_usage_stats`), so the
client learns how many tokens each chunk carried without tokenizing; a server that omits it
counts as one token per chunk. The last usage the server sends is the request's token count.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests
from tqdm import tqdm

from pipeline.bench.stats import RequestTiming, reconcile_counts

REQUEST_TIMEOUT_S = 900.0
SSE_PREFIX = "data: "
SSE_DONE = "[DONE]"


class StreamError(Exception):
    """The server answered with an error status or an error chunk."""


@dataclass(frozen=True)
class StreamResult:
    timing: RequestTiming
    text: str
    completion_tokens: int
    finish_reason: str | None
    spec: dict[str, Any] | None  # our front's extra field; None from vLLM


def completion_request(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Greedy, fixed length as far as the model allows, the same body for every system."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def stream_completion(base_url: str, body: dict[str, Any], session: requests.Session | None = None) -> StreamResult:
    http = session or requests
    start = time.perf_counter()
    times: list[float] = []
    counts: list[int] = []
    pieces: list[str] = []
    seen_tokens, finish, spec, final_total = 0, None, None, None
    with http.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT_S) as resp:
        if resp.status_code != 200:
            raise StreamError(f"{base_url}: HTTP {resp.status_code}: {resp.text[:300]}")
        # chunk_size=None (lines as they arrive) is documented by requests but missing from its annotations.
        for line in resp.iter_lines(chunk_size=None, decode_unicode=True):  # type: ignore[call-overload]
            now = time.perf_counter()
            if not line or not line.startswith(SSE_PREFIX):
                continue
            data = line[len(SSE_PREFIX) :]
            if data == SSE_DONE:
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamError(f"{base_url}: {chunk['error'].get('message')}")
            spec = chunk.get("spec") or spec
            usage = chunk.get("usage") or {}
            total = usage.get("completion_tokens")
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
                text = choice.get("text") or ""
                new = (total - seen_tokens) if total is not None else (1 if text else 0)
                if new > 0:
                    times.append(now)
                    counts.append(new)
                    seen_tokens += new
                pieces.append(text)
            if total is not None:
                final_total = total
    if final_total is not None:
        counts = list(reconcile_counts(counts, final_total))
    timing = RequestTiming(start, tuple(times), tuple(counts))
    return StreamResult(timing, "".join(pieces), final_total if final_total is not None else seen_tokens, finish, spec)


def run_concurrent(base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int, desc: str) -> list[StreamResult]:
    """Send all bodies with at most `concurrency` in flight; results keep the input order."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool, requests.Session() as session:
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=concurrency)
        session.mount("http://", adapter)
        futures = [pool.submit(stream_completion, base_url, b, session) for b in bodies]
        return [f.result() for f in tqdm(futures, desc=desc, unit="req")]
