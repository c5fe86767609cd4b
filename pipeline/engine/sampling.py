"""Sampling parameters and the token choice of one distribution (greedy or temperature/top-k/top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A vocabulary-long argmax in two parallel stages: the maximum of each of this many slices, then the
# argmax of those. One argmax over 128k logits is one block's reduction (28 us on an H200).
ARGMAX_SLICES = 256


class RequestError(ValueError):
    """A request the engine refuses (bad parameters, too long); the message names the field and limit."""


class EngineBusy(RuntimeError):
    """The engine's request queue is full: the request was not started; the client may retry later
    (Triton UNAVAILABLE, HTTP 503 on the OpenAI front)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None  # None: the tokenizer's eos; -1: never stop on an end id
    stop_words: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> None:
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] float logits -> the distribution sampling draws from (temperature, then top-k, then top-p)."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Drop a token once the mass before it already reaches top_p; the first token always stays.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row, drawn on the CPU generator so that a seed fixes the output on any device."""
    return torch.multinomial(probs.cpu().double(), 1, generator=generator).squeeze(-1).to(probs.device)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """[N, V] -> [N] tokens: argmax when greedy, else a draw from `target_probs`."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(target_probs(logits, params), generator)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N]: logits.argmax(-1), the first index of each row's maximum, in two stages."""
    n, v = logits.shape
    width = -(-v // ARGMAX_SLICES)
    padded = F.pad(logits, (0, width * ARGMAX_SLICES - v), value=float("-inf")).view(n, ARGMAX_SLICES, width)
    best, where = padded.max(-1)  # the first maximum of each slice
    slice_ = best.argmax(-1, keepdim=True)  # the first slice holding the row's maximum
    return (slice_ * width + where.gather(-1, slice_)).squeeze(-1)
