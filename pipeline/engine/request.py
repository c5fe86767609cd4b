"""What one request carries through the engine: its stop conditions, its stream chunks, its result."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.engine.sampling import SamplingParams
from pipeline.engine.stats import SpecStats

# Extra characters decoded around a stop word, so that a word split across tokens is still seen.
STOP_WORD_TOKEN_MARGIN = 4


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated only; includes the end id when generation stopped on it
    text: str
    finish_reason: str  # "length" | "end_id" | "stop"
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass
class StreamChunk:
    token_ids: list[int]  # new since the previous chunk
    finished: bool
    result: GenerationResult | None = None


class StopChecker:
    """Applies end id, max_tokens and stop words to each new token, in order."""

    def __init__(self, params: SamplingParams, end_id: int | None, tokenizer):
        self.params, self.end_id, self.tokenizer = params, end_id, tokenizer
        self.window = max((len(w) for w in params.stop_words), default=0) + STOP_WORD_TOKEN_MARGIN
        self.reason: str | None = None

    def take(self, out: list[int], new: list[int]) -> list[int]:
        """Append new tokens to `out` until a stop condition; return those appended."""
        taken = []
        for tok in new:
            out.append(tok)
            taken.append(tok)
            if self.end_id is not None and tok == self.end_id:
                self.reason = "end_id"
            elif len(out) >= self.params.max_tokens:
                self.reason = "length"
            elif self.params.stop_words and self._hit_stop_word(out):
                self.reason = "stop"
            if self.reason:
                break
        return taken

    def _hit_stop_word(self, out: list[int]) -> bool:
        tail = self.tokenizer.decode(out[-self.window :], skip_special_tokens=True)
        return any(tail.endswith(w) for w in self.params.stop_words)
