"""The scheduler: one thread owns the device and serves every request in flight.

Requests wait in a bounded queue (a full queue refuses at once with EngineBusy) and are admitted in arrival
order while the block pool can hold their worst case (prompt + max_tokens), so a running request never runs
out of blocks; blocks are taken as sequences grow and given back the moment a request finishes or is
cancelled. Each iteration queues one decode step for every running request, whose new tokens reach the host in
one copy while the next step runs, and behind it prompts' chunks of at most prefill_chunk tokens together (a
burst of short prompts in one iteration; a long prompt stalls the running streams by one chunk). A prompt's
first token is read an iteration later, behind the next decode step, so no iteration waits for the device
before queuing its step; the request decodes from the step after that. A request's
tokens reach its stream in chunks of at least the stream interval (STREAM_WAKES_PER_STEP,
CPU_STREAM_INTERVAL), and chunks a consumer has not taken yet merge, so a consumer wakes once for several
steps. A consumer that stops reading (closes the stream) cancels its request at the next iteration.

A speculative engine with a batched proposer runs a SpecStep instead: every running request drafts, is
verified and accepts in one step of the tier the controller chooses (adaptive.py). Its steps are queued
ahead too, drafting ones included: a row's next step takes its root and its cached length from the step
before on the device, so the host, which learns a row's accepted count only when it reads the step, grows
the row's table for the most that step may have accepted. Only host drafts (n-gram) need the text first.
Other speculative engines (the draft model) serve the queue one request at a time through the engine's
own decode loop (`serial`).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.engine.adaptive import POLICIES, TIER_NAME, AdaptiveConfig, RequestAcceptance, TierController
from pipeline.engine.kv_cache import BlockPool, CacheBudget
from pipeline.engine.readback import Pending, Readback
from pipeline.engine.request import ChunkQueue, GenerationResult, RequestStream, StopChecker, StreamChunk
from pipeline.engine.sampling import SEED_LIMIT, EngineBusy, SamplingParams
from pipeline.engine.spec_step import COUNT, DRAFT_COUNT, DRAFT_TOKENS, SpecStep
from pipeline.engine.stats import SpecStats
from pipeline.engine.step import (
    CARRY,
    NOT_CARRIED,
    POSITION,
    SEED,
    STATE,
    TABLE,
    TEMPERATURE,
    TOKEN,
    TOP_K,
    TOP_P,
    BatchStep,
)
from pipeline.errors import UserError

DEFAULT_MAX_QUEUE = 256
DEFAULT_PREFILL_CHUNK = 512
# The automatic stream interval holds each request's tokens until it has this share of the running
# requests' count (rounded up): every consumer thread woken costs the scheduler the GIL for a while, so a
# step wakes about this many of them whatever the load, and at most this many requests run with an interval of 1.
STREAM_WAKES_PER_STEP = 8
# On a CPU the consumers' work (a Triton send each) runs on the cores the step's products use, so every wake
# slows the step itself: with two or more requests running, a chunk holds this many tokens (100-200 ms of text
# at 4-16 requests on 2 cores; BENCHMARKS §8).
CPU_STREAM_INTERVAL = 4


@dataclass(frozen=True)
class SchedulerConfig:
    """How an engine serves: the serve-time options (`specpipe serve`, `open_engine(serving=...)`)."""

    max_batch_size: int | None = None  # rows a step runs at most; None: the engine's build value
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting for admission before new ones are refused
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens an iteration prefills at most
    cache: CacheBudget = field(default_factory=CacheBudget)
    batched: bool = True  # False: one request at a time through the engine's own decode loop
    speculation: str = "adaptive"  # speculative engines: adaptive tiers, "off", "full", or one tier's name
    # The tier controller's tuning; its policy is `speculation`'s.
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    invariant: bool = False  # CUDA: batch-invariant kernels for the target (kernels.invariant)
    # Tokens a request's stream chunk holds at least (its first and last chunks aside); None: automatic (on
    # CUDA 1 up to STREAM_WAKES_PER_STEP running requests, then growing with them; on a CPU see
    # CPU_STREAM_INTERVAL).
    stream_interval: int | None = None
    # CUDA: drafting tiers (by name) whose steps run compiled like the plain tier's in buckets of at most
    # compile_tier_rows rows: inductor fuses the small operations between the kernels (most of a one-row
    # drafting step's kernels), at one compilation a (bucket, tier, greedy or sampled) when the engine warms
    # up; steps with top-k or top-p stay uncompiled. None: the engine's dynamic tiers (EAGLE-2/3's own trees,
    # which run most steps at low load).
    compile_tiers: tuple[str, ...] | None = None
    compile_tier_rows: int = 4

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SchedulerConfig:
        """From flat options (the serve flags' names with underscores, `batched` for --serial); UserError
        for an unknown one."""
        cache_keys = {
            "kv_cache_fraction": "kv_cache_fraction",
            "max_num_tokens": "max_num_tokens",
            "kv_block_size": "block_size",
        }
        own = {"max_batch_size", "max_queue", "prefill_chunk", "stream_interval", "speculation", "invariant", "batched"}
        unknown = set(options) - own - set(cache_keys)
        if unknown:
            raise UserError(
                f"serving option(s) {', '.join(sorted(unknown))}: unknown; use "
                f"{', '.join(sorted(own | set(cache_keys)))}"
            )
        cache = CacheBudget(**{cache_keys[k]: v for k, v in options.items() if k in cache_keys})
        return cls(cache=cache, **{k: v for k, v in options.items() if k in own})

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue", "prefill_chunk", "stream_interval"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, int):
                raise UserError(f"--{name.replace('_', '-')} {value!r}: must be an integer")
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')} {value}: must be >= 1")
        if self.speculation not in POLICIES and not TIER_NAME.fullmatch(self.speculation):
            raise UserError(
                f"--speculation {self.speculation!r}: use {', '.join(POLICIES)}, or a tier's name (plain, chainN, "
                "treeN, dynamicN; the engine model's log lists them)"
            )


@dataclass(eq=False)  # compared by identity: the scheduler's lists find a request by what it is
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    stop: StopChecker
    chunks: ChunkQueue  # StreamChunks, or the exception that ended the request
    ints: np.ndarray  # the step's int inputs for this row (step.TOKEN ... TABLE)
    floats: np.ndarray
    table: list[int] = field(default_factory=list)  # pool blocks, in sequence order
    out: list[int] = field(default_factory=list)
    streamed: int = 0  # tokens of `out` put in its stream chunks so far
    stats: SpecStats = field(default_factory=SpecStats)
    cached: int = 0  # tokens whose KV is in the pool (or will be, once the step in flight has run), at least
    slack: int = 0  # ... and at most this many more: drafts a step not read yet may have accepted
    pending: int = 0  # decode steps queued for this request whose tokens the host has not read
    done: bool = False  # finished or cancelled: its blocks are back in the pool
    worst_blocks: int = 0  # blocks the request may come to hold
    cancelled: bool = False
    drafts: np.ndarray | None = None  # a speculative step's draft input for this row (spec_step.DRAFT_COUNT ...)
    acceptance: RequestAcceptance = field(default_factory=RequestAcceptance)  # paused while low
    # Accepted tokens its proposer has yet to take in (speculative steps), at most: one more after each plain
    # step that deferred its catch-up, 1 after one that caught up, the most possible after a drafting step
    # not read yet.
    pairs: int = 1
    row: int = 0  # its row in the last decode step queued

    def cancel(self) -> None:
        """Dropped at the scheduler's next iteration (any thread may call this)."""
        self.cancelled = True

    def grow(self, pool: BlockPool, tokens: int) -> None:
        """Blocks for `tokens` tokens, new ones written into the row's table column too."""
        held = len(self.table)
        pool.grow(self.table, tokens)
        if len(self.table) > held:
            self.ints[TABLE + held : TABLE + len(self.table)] = self.table[held:]

    @property
    def prefilled(self) -> bool:
        return self.cached >= len(self.prompt_ids)


@dataclass
class _Inflight:
    rows: list[Request]
    host: Pending  # the step's tokens on their way to the host
    tier: int = 0  # a speculative step's tier (0: plain)
    drafting: list[bool] = field(default_factory=list)  # per row: it drafted (a drafting tier)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        max_batch_size: int,
        step: BatchStep | None,
        result: Callable[..., GenerationResult],
        stop_checker: Callable[[SamplingParams], StopChecker],
        serial: Callable[[list[int], SamplingParams], Generator[StreamChunk, None, None]] | None = None,
    ):
        self.config = config
        self.max_batch_size = max_batch_size
        self.step = step
        self.result = result
        self.stop_checker = stop_checker
        self.serial = serial
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Condition()
        self.thread: threading.Thread | None = None
        self.inflight: _Inflight | None = None  # the decode step queued on the device, not read yet
        # Prompts prefilled last iteration and their first tokens on their way to the host (_read_firsts).
        self.firsts: tuple[list[Request], Pending] | None = None
        self.first_readback = Readback()
        self.spec = step if isinstance(step, SpecStep) else None
        self.controller = (
            TierController(self.spec.tiers, dataclasses.replace(config.adaptive, policy=config.speculation))
            if self.spec
            else None
        )
        self.free_states = list(range(max_batch_size, 0, -1))  # proposer-state rows; 0 is the padding rows'
        # Every admitted request's step inputs, a row each (its state row): a step's rows are one fancy index.
        if step is not None:
            ints, floats = step.new_row()
            self.row_ints = np.zeros((max_batch_size + 1, *ints.shape), ints.dtype)
            self.row_floats = np.zeros((max_batch_size + 1, *floats.shape), floats.dtype)
        self.last_read: float | None = None  # when the last decode step was read, unless a prefill came after
        # Prefill chunks run, the iterations that ran them, and the seconds they held the loop (the step they
        # settle first included).
        self.prefill_chunks, self.prefill_rounds, self.prefill_seconds = 0, 0, 0.0

    @property
    def batch(self) -> BatchStep:
        assert self.step is not None, "a scheduler serving one request at a time has no batched step"
        return self.step

    # -- the caller's side ----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request (validated by the engine) and stream its chunks; EngineBusy when the queue is full."""
        ints, floats = self.step.new_row() if self.step is not None else (np.zeros(0, np.int64), np.zeros(0))
        # One request at a time (serial), each chunk is the engine loop's group of steps: kept as it is.
        chunks = ChunkQueue(merge=self.serial is None)
        request = Request(list(prompt_ids), params, self.stop_checker(params), chunks, ints, floats)
        if self.step is not None:
            seed = params.seed if params.seed is not None else random.randrange(SEED_LIMIT)
            ints[TOP_K], ints[SEED] = params.top_k, seed
            floats[TEMPERATURE], floats[TOP_P] = 0.0 if params.greedy else params.temperature, params.top_p
            headroom = self.spec.headroom if self.spec is not None else 0  # a tree past the text
            request.worst_blocks = self.batch.pool.blocks_for(len(prompt_ids) + params.max_tokens + headroom)
            if self.spec is not None:
                request.drafts = self.spec.new_drafts()
        with self.lock:
            if len(self.waiting) >= self.config.max_queue:
                raise EngineBusy(
                    f"the engine is busy: {len(self.waiting)} requests are waiting (--max-queue "
                    f"{self.config.max_queue}); retry later"
                )
            self.waiting.append(request)
            if self.thread is None:
                # Not a daemon: the interpreter waits for it rather than killing it inside torch at exit.
                self.thread = threading.Thread(target=self._loop, name="specpipe-scheduler")
                self.thread.start()
            self.lock.notify()
        return RequestStream(request.chunks, request.cancel)

    def usage(self) -> dict[str, int]:
        """Requests waiting and running, and blocks in use (a snapshot, for tests and metrics)."""
        with self.lock:
            return {
                "waiting": len(self.waiting),
                "running": len(self.running),
                "used_blocks": self.step.pool.used_blocks if self.step is not None else 0,
            }

    # -- the device's side (the scheduler thread) -------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                self._drop_cancelled()
                if not self.waiting and not self.running:
                    # Only finished or cancelled rows' work can be left: nothing to read.
                    self.inflight, self.firsts = None, None
                    if self.controller is not None:
                        self.controller.idle()
                    self.thread = None  # idle: the next request starts another thread
                    return
                if self.serial is None:
                    self._admit()
            try:
                with torch.inference_mode():
                    if self.serial is not None:
                        self._serve_one()
                    else:
                        self._iterate()
            except Exception as exc:  # a failed step ends every request in it, loudly; the engine keeps serving
                with self.lock:
                    failed, self.running, self.inflight, self.firsts = self.running, [], None, None
                for request in failed:
                    self._finish(request, exc)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
        for request in [r for r in self.running if r.cancelled and self.step is not None]:
            self._release(request)

    def _admit(self) -> None:
        """Waiting requests join in arrival order while rows and the pool's worst case allow."""
        reserved = sum(r.worst_blocks - len(r.table) for r in self.running)
        while self.waiting and len(self.running) < self.max_batch_size:
            head = self.waiting[0]
            if len(self.batch.pool.free) - reserved < head.worst_blocks:
                break
            reserved += head.worst_blocks
            state = self.free_states.pop()
            self.row_ints[state], self.row_floats[state] = head.ints, head.floats
            head.ints, head.floats = self.row_ints[state], self.row_floats[state]  # views from now on
            head.ints[STATE] = state
            self.running.append(self.waiting.popleft())

    def _iterate(self) -> None:
        prefilling = self._prefilling()
        decoding = self._decoding()
        tier, drafting = 0, [False] * len(decoding)
        if decoding and self.spec is not None:
            decoding, tier, drafting = self._choose(decoding)
        launched = self._launch(decoding, tier, drafting) if decoding else None
        firsts: list[tuple[Request, torch.Tensor]] = []  # prompts finished now, with their first token
        if prefilling:  # queued behind the decode step: the device runs them back to back
            if self.controller is not None:
                self.controller.prefilled(len(prefilling))
            start = time.perf_counter()
            for r in prefilling:
                token = self._prefill_chunk(r)
                if token is not None:
                    firsts.append((r, token))
            self.prefill_chunks += len(prefilling)
            self.prefill_rounds += 1
            self.prefill_seconds += time.perf_counter() - start
            self.last_read = None  # the steps read next waited for the prefill: not timed
        self._read_inflight()  # the step before: read while the one just launched runs
        self.inflight = launched
        self._read_firsts()  # the last iteration's prompts' first tokens: they decode from the next step
        if firsts:
            pending = self.first_readback.start(torch.cat([t for _, t in firsts]))
            self.firsts = ([r for r, _ in firsts], pending)
            if pending.done is None:  # on the host already (CPU): nothing to wait for
                self._read_firsts()
        if prefilling:
            self.last_read = None

    def _prefilling(self) -> list[Request]:
        """The prompts whose next chunk this iteration prefills, in arrival order: the first one's, then more
        while their chunks together stay within prefill_chunk tokens (a burst of short prompts is prefilled
        in one iteration, not one an iteration). A prompt's chunks are cut at the same places whatever
        else runs, so its output does not depend on the load."""
        chosen: list[Request] = []
        tokens = 0
        for r in self.running:
            if r.prefilled:
                continue
            size = min(len(r.prompt_ids) - r.cached, self.config.prefill_chunk)
            if chosen and tokens + size > self.config.prefill_chunk:
                break
            chosen.append(r)
            tokens += size
        return chosen

    def _decoding(self) -> list[Request]:
        """Running requests that decode this iteration: prefilled, and short of max_tokens even if every
        step not read yet emitted one token."""
        return [
            r
            for r in self.running
            if r.prefilled and (r.out or r.pending) and not r.done and len(r.out) + r.pending < r.params.max_tokens
        ]

    def _prefill_chunk(self, r: Request) -> torch.Tensor | None:
        """Queue the next chunk of r's prompt -> its first token [1] on the device after the last chunk."""
        start = r.cached
        end = min(len(r.prompt_ids), start + self.config.prefill_chunk)
        r.grow(self.batch.pool, end)
        token = self.batch.prefill(r.prompt_ids[start:end], start, r.ints, r.floats, last=end == len(r.prompt_ids))
        r.cached = end
        return token

    def _read_firsts(self) -> None:
        """Emit the first tokens of the prompts prefilled last iteration. They are read an iteration later,
        behind the decode step queued since, rather than at once: reading at once would leave the device
        idle while the host prepares the next step, a wait for every iteration with a prompt in it (and
        prompts arriving one at a time come one an iteration)."""
        firsts, self.firsts = self.firsts, None
        if firsts is not None:
            rows, pending = firsts
            self._emit(rows, [[t] for t in pending.read()])

    def _choose(self, rows: list[Request]) -> tuple[list[Request], int, list[bool]]:
        """The tier of a speculative step for `rows` (the controller's choice) and which rows draft. A bucket's
        first step measures its tiers first, and host drafts (n-gram) read the step in flight first: both
        settle it, and the rows still decoding after it are the step's."""
        spec, controller = self.spec, self.controller
        assert spec is not None and controller is not None
        while rows and not controller.calibrated(spec.bucket(len(rows))):
            self._read_inflight()  # calibration's padding steps reuse the buckets' buffers: settle first
            self._calibrate(spec.bucket(len(rows)))
            self.last_read = None
            rows = self._decoding()
        drafting = [self._drafts(r, controller.steps) for r in rows]
        index = controller.choose(spec.bucket(len(rows)), len(rows), sum(drafting)) if rows else 0
        if index and spec.proposer.host_drafts and self.inflight is not None:
            self._read_inflight()
            rows = self._decoding()
            drafting = [self._drafts(r, controller.steps) for r in rows]
            if not controller.calibrated(spec.bucket(len(rows))):
                index = 0  # a smaller bucket not measured yet: a plain step, measured at the next one
        return rows, index, drafting

    def _launch(self, rows: list[Request], index: int, drafting: list[bool]) -> _Inflight:
        """Queue one decode step of tier `index` (0: plain) for `rows`. A row still waiting for the step in
        flight takes that step's last token and length on the device, so the step is queued before the
        host has read the one before it."""
        previous = self.inflight
        spec = self.spec
        reach = spec.max_nodes if spec is not None else 1  # a proposer's catch-up and a tree write past the root
        pool = self.batch.pool
        for i, r in enumerate(rows):
            r.grow(pool, r.cached + r.slack + reach)
            r.ints[POSITION] = r.cached
            if r.pending:
                assert previous is not None
                r.ints[CARRY] = r.row  # its row in the step before
            else:
                r.ints[TOKEN], r.ints[CARRY] = r.out[-1], NOT_CARRIED
            r.row = i
        ints, floats = self._inputs(rows)
        depth, defer = 0, False
        if spec is None:
            out = self.batch.decode(ints, floats)
        elif index == 0:
            # The proposer keeps up to max depth + 1 pairs a row pending: defer while every row has room.
            defer = max(r.pairs for r in rows) <= spec.max_depth
            out = spec.decode(ints, floats, defer=defer)
        else:
            tier = spec.tiers[index]
            depth = tier.depth
            for r, on in zip(rows, drafting):
                assert r.drafts is not None
                r.drafts[DRAFT_COUNT] = tier.num_nodes if on else 0
                if on and spec.proposer.host_drafts:
                    guess = spec.proposer.host_draft(r.prompt_ids + r.out)[: tier.depth]
                    r.drafts[DRAFT_COUNT] = len(guess)
                    r.drafts[DRAFT_TOKENS : DRAFT_TOKENS + len(guess)] = guess
            out = spec.speculate(ints, floats, np.stack([r.drafts for r in rows if r.drafts is not None]), index)
        for r in rows:
            r.cached += 1
            r.slack += depth
            r.pending += 1
            r.pairs = r.pairs + 1 if index == 0 and defer else depth + 1
        return _Inflight(rows, self.batch.readback.start(out), index, drafting)

    def _read_inflight(self) -> None:
        """The step in flight's tokens to the host (the step's one sync), emitted; a speculative step's cost
        (read to read) and acceptance to the controller."""
        inflight, self.inflight = self.inflight, None
        if inflight is None:
            return
        values = inflight.host.read()
        now = time.perf_counter()
        seconds = None if self.last_read is None else now - self.last_read
        self.last_read = now
        for r in inflight.rows:
            r.pending -= 1
        if inflight.tier == 0:
            live = [(r, t) for r, t in zip(inflight.rows, values) if not r.done]
            for r, _ in live:
                r.stats.record(0, 0, 0)
            if self.spec is not None and self.controller is not None:
                bucket = self.spec.bucket(len(inflight.rows))
                self.controller.timed_plain(bucket, seconds)
                self.controller.observe(0, [])
                self.controller.emitted(bucket, len(live))
            self._emit([r for r, _ in live], [[t] for _, t in live])
            return
        spec, controller = self.spec, self.controller
        assert spec is not None and controller is not None
        tier = spec.tiers[inflight.tier]
        rows, tokens, accepted = [], [], []
        for r, on, row in zip(inflight.rows, inflight.drafting, values):
            n = row[COUNT]
            r.cached += n
            r.slack -= tier.depth
            if not r.pending:  # its proposer's pairs to take in, unless a later step is queued already
                r.pairs = n + 1
            if r.done:
                continue
            r.stats.record(tier.num_nodes - 1 if on else 0, tier.depth if on else 0, n)
            rows.append(r)
            tokens.append(row[: n + 1])
            if on:
                accepted.append(n)
                r.acceptance.update(n, controller.steps, controller.config)
        bucket = spec.bucket(len(inflight.rows))
        if seconds is not None:
            controller.timed_drafting(bucket, inflight.tier, seconds)
        controller.observe(inflight.tier, accepted)
        controller.emitted(bucket, sum(len(t) for t in tokens))
        self._emit(rows, tokens)

    def _inputs(self, rows: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        """The rows' step inputs (ints, floats), gathered from their state rows."""
        states = [r.ints[STATE] for r in rows]
        return self.row_ints[states], self.row_floats[states]

    def _drafts(self, r: Request, step: int) -> bool:
        """Whether a request drafts this step: it did not opt out, and its acceptance is not paused."""
        return r.params.speculative and r.acceptance.drafts(step)

    def calibrate(self, bucket: int | None = None, sampled: bool = False) -> None:
        """Measure a batch bucket's tiers (None: every bucket's) now, at load, rather than at its first step;
        sampled: capture each tier's sampling graphs too (CUDA), which a first sampled request would otherwise
        capture inside its steps."""
        assert self.spec is not None and self.controller is not None
        with torch.inference_mode():
            for b in self.spec.buckets if bucket is None else [bucket]:
                if not self.controller.calibrated(b):
                    self._calibrate(b)
                if sampled:
                    for tier in range(len(self.spec.tiers)):
                        for defer in (False, True) if tier == 0 else (False,):
                            self._padding_step(b, tier, defer, temperature=1.0)

    def _calibrate(self, bucket: int) -> None:
        """Time every tier in `bucket` (the plain tier's deferring step: most steps in a row of plain steps);
        the plain tier's catching-up step is captured too, not timed."""
        assert self.controller is not None
        self._padding_step(bucket, 0, defer=False)
        self.controller.calibrate(bucket, functools.partial(self._padding_step, bucket))

    def _padding_step(self, bucket: int, tier: int, defer: bool | None = None, temperature: float = 0.0) -> None:
        """A step of `bucket` padding rows (the scratch block, state row 0), waited for: calibration."""
        spec = self.spec
        assert spec is not None
        ints, floats = spec.new_row()
        floats[TEMPERATURE], floats[TOP_P] = temperature, 1.0  # a sampled step unfiltered (step_mode)
        out = spec.speculate(
            np.stack([ints] * bucket),
            np.stack([floats] * bucket),
            np.stack([spec.new_drafts()] * bucket),
            tier,
            tier == 0 if defer is None else defer,
        )
        spec.readback.start(out).read()

    def stream_interval(self) -> int:
        """Tokens a stream chunk holds at least now (SchedulerConfig.stream_interval)."""
        if self.config.stream_interval is not None:
            return self.config.stream_interval
        if self.batch.device.type == "cpu":
            return 1 if len(self.running) <= 1 else CPU_STREAM_INTERVAL
        return max(1, -(-len(self.running) // STREAM_WAKES_PER_STEP))

    def _emit(self, rows: list[Request], tokens: list[list[int]]) -> None:
        """Each row's new tokens through its stop conditions; a chunk for its first tokens, its last ones,
        and whenever it holds the stream interval's worth; finished rows leave."""
        interval = self.stream_interval()
        for r, new_tokens in zip(rows, tokens):
            r.stop.take(r.out, new_tokens)
            if r.cancelled:
                continue  # dropped at the next iteration
            if r.stop.reason:
                result = self.result(r.prompt_ids, r.out, r.stop.reason, r.stats)
                result.kv_blocks = len(r.table)
                r.chunks.put(StreamChunk(r.out[r.streamed :], True, result))
                with self.lock:
                    self._release(r)
            elif not r.streamed or len(r.out) - r.streamed >= interval:
                r.chunks.put(StreamChunk(r.out[r.streamed :], False))
                r.streamed = len(r.out)

    def _release(self, r: Request) -> None:
        # A step still in flight may write this request's blocks: it was queued before any later owner's work.
        r.done = True
        self.batch.pool.release(r.table)
        if r.ints[STATE]:
            self.free_states.append(int(r.ints[STATE]))
            r.ints[STATE] = 0
        if r in self.running:
            self.running.remove(r)

    def _finish(self, r: Request, error: BaseException) -> None:
        with self.lock:
            if self.step is not None:
                self._release(r)
        r.chunks.put(error)

    def _serve_one(self) -> None:
        """A speculative engine: the oldest waiting request runs whole through the engine's decode loop."""
        with self.lock:
            if not self.waiting:
                return
            r = self.waiting.popleft()
            self.running.append(r)
        assert self.serial is not None
        chunks = self.serial(r.prompt_ids, r.params)
        try:
            for chunk in chunks:
                if r.cancelled:
                    break
                r.chunks.put(chunk)
        except Exception as exc:  # noqa: BLE001 - ends this request with its error; the next is served
            r.chunks.put(exc)
        finally:
            chunks.close()
            with self.lock:
                self.running.remove(r)
