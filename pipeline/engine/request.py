"""What one request carries through the engine: its stop conditions, its stream chunks, its result."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
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
    kv_blocks: int = 0  # KV cache blocks of the pool it held at its end (batched engines; 0 otherwise)


@dataclass
class StreamChunk:
    token_ids: list[int]  # new since the previous chunk
    finished: bool
    result: GenerationResult | None = None


class ChunkQueue:
    """A request's chunks on their way to its consumer; an exception ends the stream. With `merge`, chunks
    not taken yet merge into one (their tokens in order), so a consumer behind the scheduler takes several
    steps' tokens in one wake-up rather than a wake-up a step. The first chunk (the first token) stays alone:
    a stream's first response is its time to first token, however late its consumer reads."""

    def __init__(self, merge: bool = True) -> None:
        self._items: deque[StreamChunk | BaseException] = deque()
        self._ready = threading.Condition(threading.Lock())
        self.merge = merge
        self._first: StreamChunk | None = None

    def put(self, item: StreamChunk | BaseException) -> None:
        with self._ready:
            last = self._items[-1] if self._items else None
            if self._first is None and isinstance(item, StreamChunk):
                self._first = item
            if last is self._first:
                last = None  # the first chunk takes no other
            if self.merge and isinstance(item, StreamChunk) and isinstance(last, StreamChunk):
                self._items[-1] = StreamChunk(last.token_ids + item.token_ids, item.finished, item.result)
                return  # its consumer was woken for `last`
            self._items.append(item)
            self._ready.notify()

    def get(self) -> StreamChunk | BaseException:
        with self._ready:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()


class StreamClosed(Exception):
    """A request's stream was closed by another thread while its reader waited for a chunk."""


class RequestStream:
    """A request's chunks, in order, as an iterator. Closing it, from any thread, or dropping it before its last
    chunk cancels the request: the scheduler drops it at its next iteration and frees its blocks, and a reader
    that goes on reading gets the chunks already made, then StreamClosed."""

    def __init__(self, chunks: ChunkQueue, cancel: Callable[[], None]) -> None:
        self._chunks, self._cancel = chunks, cancel
        self._ended = self._closed = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamChunk:
        if self._ended:
            raise StopIteration
        item = self._chunks.get()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        self._ended = item.finished
        return item

    def close(self) -> None:
        if not (self._ended or self._closed):
            self._closed = True
            self._cancel()
            self._chunks.put(StreamClosed("the request's stream was closed"))

    def __del__(self) -> None:
        self.close()


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
