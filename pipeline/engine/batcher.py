"""Continuous batching for plain decoding: one thread steps every active request together.

Requests join between steps (each prefill runs alone, into a free row of the batch KV cache) and
leave when they stop; the last active row then moves into the freed one, so active requests always
hold rows 0..n-1 and a step reads one contiguous slice of the cache. A step with a single active
request is exactly the single-stream step (same kernels, CUDA graphs included), so batch-1 output
is unchanged, and a greedy request alone queues several steps on the device per host read
(`_run_ahead`), the next group queued before the current one is read, so the device does not wait
while the host reads, emits and launches. Speculative engines do not batch: their proposers keep
per-request state (draft KV caches, head inputs), so they serve one request at a time.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from pipeline.engine.model import decode_context
from pipeline.engine.readback import Pending
from pipeline.engine.request import StopChecker, StreamChunk
from pipeline.engine.sampling import SamplingParams, choose
from pipeline.engine.stats import SpecStats

if TYPE_CHECKING:
    from pipeline.engine.runner import Engine


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop: StopChecker
    chunks: queue.Queue  # StreamChunk, or the exception that ended the batch loop
    out: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    length: int = 0  # tokens whose KV is cached, or will be once the queued group has run
    last: int = 0  # the last emitted token, not yet cached
    cancelled: bool = False
    queued: "_Group | None" = None  # run-ahead steps on the device, not yet read

    @property
    def unread(self) -> int:
        """Tokens that queued steps produce but that were not emitted yet (the last emitted token's
        KV is not cached, hence the + 1)."""
        return self.length - len(self.prompt_ids) - len(self.out) + 1


@dataclass
class _Group:
    """Greedy steps queued on the device."""

    tokens: Pending  # [steps]
    last: torch.Tensor  # [1] long on the device: the input of the group after this one


class Batcher:
    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.rows = engine.batch_cache.k.shape[1]
        self.pending: collections.deque[_Request] = collections.deque()
        self.active: list[_Request] = []  # request i holds cache row i
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None  # runs while any request is pending or active

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamChunk]:
        generator, stop = self.engine.request_state(params)
        request = _Request(list(prompt_ids), params, generator, stop, queue.Queue())
        with self.lock:
            self.pending.append(request)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="specpipe-batcher")
                self.thread.start()
        try:
            while True:
                item = request.chunks.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            request.cancelled = True  # a consumer that stops reading frees the row at the next step

    # -- the batch loop (its own thread) -------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                if not self.pending and not self.active:
                    # Idle: end the thread (the next request starts another). It is not a daemon, so
                    # the interpreter waits for it rather than killing it inside torch at exit.
                    self.thread = None
                    return
                joining = [self.pending.popleft() for _ in range(min(len(self.pending), self.rows - len(self.active)))]
            try:
                with torch.inference_mode():
                    for request in joining:
                        self._prefill(request)
                    if self.active:
                        self._step()
            except Exception as exc:  # a failed step ends every request in it, loudly
                for request in self.active + [r for r in joining if r not in self.active]:
                    request.chunks.put(exc)
                self.active.clear()

    def _prefill(self, request: _Request) -> None:
        engine, row = self.engine, len(self.active)
        cache = engine.cache if row == 0 else engine.batch_cache.rows(row, row + 1)  # row 0 has graphs
        prompt = torch.tensor(request.prompt_ids, device=engine.device)
        target = engine.prefill(prompt, cache)
        first = choose(engine.target.logits(target.hidden[-1:]), request.params, request.generator)
        request.length, request.last = len(prompt), int(first)
        self.active.append(request)
        self._emit([request], [[request.last]], counts_step=False)

    def _step(self) -> None:
        engine, n = self.engine, len(self.active)
        if n == 1 and self.active[0].params.greedy and not self.pending:
            return self._run_ahead(self.active[0])
        for r in list(self.active):  # a request leaving run-ahead: its queued steps first
            if r.queued is not None:
                group, r.queued = r.queued, None
                self._emit([r], [group.tokens.read()], counts_step=True)
        if not self.active:
            return
        n = len(self.active)
        tokens = torch.tensor([r.last for r in self.active], device=engine.device)
        lengths = torch.tensor([r.length for r in self.active], device=engine.device)
        if n == 1:
            hidden = engine.forward(tokens, self.active[0].length, lengths, None).hidden
        else:
            longest = max(r.length for r in self.active)  # from the host copy: no device sync
            ctx = decode_context(engine.batch_cache.rows(0, n), engine.target.rotary, lengths, longest + 1)
            hidden = engine.target(tokens[:, None], ctx)[0][:, 0]
        logits = engine.target.logits(hidden)
        chosen = logits.argmax(-1)
        for i, r in enumerate(self.active):
            if not r.params.greedy:
                chosen[i] = choose(logits[i:i + 1], r.params, r.generator)[0]
        for r in self.active:
            r.length += 1
        self._emit(list(self.active), [[t] for t in chosen.tolist()], counts_step=True)  # the step's one sync

    def _run_ahead(self, r: _Request) -> None:
        """A greedy request alone: each step's input is the previous step's argmax, which never has to
        visit the host, so up to engine.run_ahead steps are queued on the device as a group and read
        back with one sync. The next group is queued before the current one is read, so the device
        never idles while Python reads, emits and launches; a stop inside a group discards the steps
        after it (and the group queued behind it), and a request that arrives waits at most one group."""
        if r.queued is None:
            r.queued = self._queue(r, torch.tensor([r.last], device=self.engine.device))
        group = r.queued
        more = r.params.max_tokens - len(r.out) - r.unread
        # With one step a group (the CPU, where the host is the device) nothing would overlap.
        r.queued = self._queue(r, group.last) if more > 0 and self.engine.run_ahead > 1 else None
        self._emit([r], [group.tokens.read()], counts_step=True)

    def _queue(self, r: _Request, token: torch.Tensor) -> _Group:
        """Queue greedy steps from `token` (on the device) at r.length, up to run_ahead and max_tokens."""
        engine = self.engine
        steps = min(engine.run_ahead, r.params.max_tokens - len(r.out) - r.unread)
        positions = torch.arange(r.length, r.length + steps, device=engine.device)
        chosen = []
        for i in range(steps):
            hidden = engine.forward(token, r.length + i, positions[i:i + 1], None).hidden
            token = engine.greedy(hidden)
            chosen.append(token)
        r.length += steps
        return _Group(engine.readback.start(torch.cat(chosen)), token)

    def _emit(self, requests: list[_Request], tokens: list[list[int]], counts_step: bool) -> None:
        """Each request's new tokens, in order, through its stop conditions; one chunk per request."""
        finished = []
        for r, toks in zip(requests, tokens):
            new = r.stop.take(r.out, toks)
            if counts_step:
                for _ in new:
                    r.stats.record(0, 0, 0)
            r.last = new[-1]
            if r.cancelled:
                finished.append(r)
            elif r.stop.reason:
                r.chunks.put(StreamChunk(new, True, self.engine.result(r.prompt_ids, r.out, r.stop.reason, r.stats)))
                finished.append(r)
            else:
                r.chunks.put(StreamChunk(new, False))
        for r in finished:
            self._leave(r)

    def _leave(self, request: _Request) -> None:
        """Free the request's row; the last active request moves into it."""
        row, last = self.active.index(request), len(self.active) - 1
        if row != last:
            mover = self.active[last]
            self.engine.batch_cache.move_row(last, row, mover.length)
            self.active[row] = mover
        self.active.pop()
