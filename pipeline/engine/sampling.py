"""Sampling parameters and token choice: one distribution on the host generator (speculative acceptance),
or a whole batch on the device, each row with its own temperature, top-k, top-p and seed.

The device sampler draws by Gumbel-max over counter-based uniforms: the uniform of token v for a row is
a hash of (seed, position of the token being drawn, v), computed with the same integer ops on any
device. So a seed fixes a request's output whether it ran alone or in a batch, on the CPU or a GPU, and
nothing is copied to the host but the chosen tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A vocabulary-long argmax in two parallel stages: the maximum of each of this many slices, then the
# argmax of those. One argmax over 128k logits is one block's reduction (28 us on an H200).
ARGMAX_SLICES = 256
# The counter hash: two rounds of xor-shift-multiply on 32-bit values held in int64. The multiplier is
# below 2^31, so no product of a 32-bit value overflows int64 on any device.
HASH_MULTIPLIER = 0x45D9F3B
MASK32 = 0xFFFFFFFF
SEED_SALT = 0x9E3779B9  # separates a seed's high word from its low word before they are combined
# Bits of the hash a uniform takes: (i + 0.5) / 2^23 is exact in float32 for every i < 2^23, so a uniform
# is never 0 or 1. (With 24 bits the largest i + 0.5 rounds up to 2^24: a uniform of 1, an infinite Gumbel
# draw, and NaN where top-k/top-p had masked that token, which argmax then picked.)
UNIFORM_BITS = 23
SEED_LIMIT = 1 << 63


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
    speculative: bool = True  # False: a speculative engine serves this request with plain steps

    @property
    def greedy(self) -> bool:
        """Temperature 0, or top_k 1 at any temperature (clients send greedy that way, since a temperature of
        0 divides by zero in some backends): the argmax, exact and without the sampler's vocabulary sort."""
        return self.temperature == 0.0 or self.top_k == 1

    def check(self) -> None:
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not math.isfinite(self.temperature):
            raise RequestError(f"temperature must be a finite number, got {self.temperature}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise RequestError(f"seed must be in [0, 2^63), got {self.seed}")


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


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of x (int64 holding values in [0, 2^32)), identical on every device."""
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    return (x >> 16) ^ x


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds (int64, >= 0) and [B] positions -> [B, vocab] float32 uniforms in (0, 1)."""
    key = _mix32(_mix32(seeds & MASK32) ^ _mix32(((seeds >> 32) ^ SEED_SALT) & MASK32) ^ (positions & MASK32))
    ids = torch.arange(vocab, device=seeds.device)
    return unit_interval(_mix32(_mix32(key[:, None] ^ ids[None, :])) >> (32 - UNIFORM_BITS))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """UNIFORM_BITS-bit integers -> float32 in (0, 1), both ends excluded."""
    return (bits.float() + 0.5) / float(1 << UNIFORM_BITS)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    filtered: bool,
) -> torch.Tensor:
    """[B, V] logits -> [B] tokens: argmax where temperature is 0, else a draw from softmax(logits / T)
    restricted to the top_k highest (0 = all) and then to the smallest set of mass >= top_p; the draw is
    Gumbel-max over uniforms(seeds, positions). `filtered` False skips the top-k/top-p work (no row uses them)."""
    greedy = temperature <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    if filtered:
        ordered, order = scaled.sort(-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        keep = (ranks[None, :] < top_k[:, None]) | (top_k[:, None] <= 0)
        probs = ordered.masked_fill(~keep, float("-inf")).softmax(-1)
        keep &= (probs.cumsum(-1) - probs) < top_p[:, None]  # the first token always stays
        scaled = scaled.masked_fill(~torch.zeros_like(keep).scatter(-1, order, keep), float("-inf"))
    gumbel = -torch.log(-torch.log(uniforms(seeds, positions, logits.shape[-1])))
    drawn = (scaled + gumbel).argmax(-1)
    return torch.where(greedy, argmax_rows(logits), drawn)
