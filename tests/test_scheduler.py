"""The batched core: paged KV cache, scheduler, batched step and device sampling (CPU, float32)."""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import convert_and_build

from pipeline.engine.kv_cache import CacheBudget
from pipeline.engine.loader import open_engine
from pipeline.engine.readback import Pending, Readback
from pipeline.engine.request import ChunkQueue, StreamChunk, StreamClosed
from pipeline.engine.runner import CUDA_MAX_BATCH_SIZE, Engine, default_batch_size
from pipeline.engine.sampling import (
    UNIFORM_BITS,
    EngineBusy,
    RequestError,
    SamplingParams,
    sample_rows,
    target_probs,
    unit_interval,
)
from pipeline.engine.scheduler import CPU_STREAM_INTERVAL, SchedulerConfig
from pipeline.errors import UserError

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog and runs", "hello", "1 2 3 4 5 6 7 8 9 10 11"]


@pytest.fixture(scope="module")
def engine_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    return convert_and_build(tiny_llama_dir, tmp_path_factory.mktemp("batched"))


@pytest.fixture(scope="module")
def engine(engine_dir: Path) -> Engine:
    return open_engine(engine_dir)


def jobs(engine: Engine, count: int) -> list[tuple[list[int], SamplingParams]]:
    """Requests of other prompt lengths, max_tokens, stop words and sampling parameters."""
    out = []
    for i in range(count):
        ids = engine.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids
        kind = i % 4
        if kind == 0:
            params = SamplingParams(max_tokens=7 + 5 * i, end_id=-1)
        elif kind == 1:
            params = SamplingParams(max_tokens=20, temperature=0.9, seed=100 + i, end_id=-1)
        elif kind == 2:
            params = SamplingParams(max_tokens=25, temperature=1.2, top_k=8, top_p=0.8, seed=i, end_id=-1)
        else:
            params = SamplingParams(max_tokens=30, end_id=-1, stop_words=("e",))
        out.append((ids, params))
    return out


def run_together(engine: Engine, work: list[tuple[list[int], SamplingParams]]) -> tuple[list[list[int]], int]:
    """Every request from its own thread at once: (each one's streamed tokens, most requests seen running)."""
    results: list[list[int]] = [[] for _ in work]
    widest = [0]
    start = threading.Barrier(len(work))

    def run(i: int) -> None:
        ids, params = work[i]
        start.wait()
        for chunk in engine.stream(ids, params):
            widest[0] = max(widest[0], engine.scheduler.usage()["running"])
            results[i].extend(chunk.token_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, widest[0]


def test_a_request_gets_the_same_tokens_alone_and_in_batches_of_2_to_8(engine):
    work = jobs(engine, 8)
    alone = [engine.generate(ids, params).token_ids for ids, params in work]
    assert any(p.stop_words for _, p in work) and any(p.temperature > 0 for _, p in work)
    for size in (2, 5, 8):
        together, widest = run_together(engine, work[:size])
        assert together == alone[:size], size
        assert widest > 1, "the requests never shared a step"
    assert engine.scheduler.usage() == {"waiting": 0, "running": 0, "used_blocks": 0}


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine):
    ids = engine.tokenizer(PROMPTS[1]).input_ids
    hot = SamplingParams(max_tokens=16, temperature=1.3, top_p=0.9, seed=7, end_id=-1)
    first = engine.generate(ids, hot).token_ids
    assert engine.generate(ids, hot).token_ids == first
    seeds = {
        tuple(engine.generate(ids, SamplingParams(max_tokens=16, temperature=1.3, seed=s, end_id=-1)).token_ids)
        for s in range(4)
    }
    assert len(seeds) > 1


def test_prefill_chunks_do_not_change_a_prompts_output(engine_dir, engine):
    chunked = open_engine(engine_dir, serving=SchedulerConfig(prefill_chunk=3))
    for ids, params in jobs(engine, 4):
        assert chunked.generate(ids, params).token_ids == engine.generate(ids, params).token_ids


def test_a_burst_of_short_prompts_is_prefilled_in_one_iteration(engine_dir, engine):
    """Prompts arriving together share an iteration's prefill_chunk tokens (one chunk each, cut where it is
    cut alone), so the last of a burst does not wait for one iteration per prompt ahead of it; the outputs
    are those of each request alone."""
    work = [(ids, SamplingParams(max_tokens=6, end_id=-1)) for ids, _ in jobs(engine, 4)]
    alone = [engine.generate(ids, params).token_ids for ids, params in work]
    sizes = [len(ids) for ids, _ in work]
    for budget, rounds in ((sum(sizes), 1), (max(sizes), None)):
        burst = open_engine(engine_dir, serving=SchedulerConfig(prefill_chunk=budget))
        scheduler = burst.scheduler
        with scheduler.lock:  # all four queued before the scheduler's first iteration
            streams = [burst.stream(ids, params) for ids, params in work]
        assert [[t for c in s for t in c.token_ids] for s in streams] == alone
        assert scheduler.prefill_chunks == len(work)
        if rounds is not None:
            assert scheduler.prefill_rounds == rounds
        else:  # each iteration takes whole chunks while they fit: more than one round, fewer than one each
            assert 1 < scheduler.prefill_rounds <= len(work)


class _Copied:
    """A copy that has run (what a CUDA event reports once the device got there)."""

    def synchronize(self) -> None:
        pass


class HeldReadback(Readback):
    """First tokens handed over as from a device: the scheduler reads them an iteration later, behind the
    next decode step, as on CUDA (on the CPU it reads them at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = 0

    def start(self, values: torch.Tensor) -> Pending:
        self.groups += 1
        return Pending(values.clone(), _Copied())  # type: ignore[arg-type]


def test_first_tokens_read_an_iteration_later_change_no_output(engine_dir, engine):
    """On CUDA a prompt's first token is read behind the next decode step (no wait for the device in an
    iteration that prefills): the request decodes from the step after. Mixed requests, alone and together,
    give the tokens they give read at once; a stream closed while its first token is on the way frees its
    blocks."""
    work = jobs(engine, 8)
    alone = [engine.generate(ids, params).token_ids for ids, params in work]
    held = open_engine(engine_dir)
    readback = held.scheduler.first_readback = HeldReadback()
    assert [held.generate(ids, params).token_ids for ids, params in work] == alone
    together, widest = run_together(held, work)
    assert together == alone and widest > 1
    assert readback.groups >= len(work)
    with held.scheduler.lock:  # queued together: the first tokens are on the way when the stream closes
        streams = [held.stream(ids, params) for ids, params in work[:3]]
    streams[0].close()
    assert [t for c in streams[1] for t in c.token_ids] == alone[1]
    assert [t for c in streams[2] for t in c.token_ids] == alone[2]
    assert held.scheduler.usage() == {"waiting": 0, "running": 0, "used_blocks": 0}


def test_the_stream_interval_groups_tokens_and_keeps_them(engine_dir, engine):
    """Chunks after the first hold at least the interval's tokens (the last may hold fewer); the tokens are
    those of an interval of 1. Automatic on a CPU: one token a chunk for one request, CPU_STREAM_INTERVAL
    while several run."""
    assert engine.scheduler.stream_interval() == 1
    ids, params = jobs(engine, 1)[0][0], SamplingParams(max_tokens=40, end_id=-1)
    streams = [engine.stream(ids, params) for _ in range(2)]
    sizes = [len(c.token_ids) for c in streams[0]]  # read while the other request runs (its chunks merge)
    assert statistics.median(sizes[1:-1]) >= CPU_STREAM_INTERVAL, sizes
    assert sum(len(c.token_ids) for c in streams[1]) == params.max_tokens
    work = jobs(engine, 4)
    alone = [engine.generate(ids, params).token_ids for ids, params in work]
    grouped = open_engine(engine_dir, serving=SchedulerConfig(stream_interval=4))
    for (ids, params), want in zip(work, alone):
        sizes = [len(c.token_ids) for c in grouped.stream(ids, params)]
        assert sum(sizes) == len(want) and sizes[0] == 1 and min(sizes[1:-1], default=4) >= 4, sizes
        assert grouped.generate(ids, params).token_ids == want
    with pytest.raises(UserError, match="--stream-interval 0: must be >= 1"):
        SchedulerConfig(stream_interval=0)
    # A tier's name is checked against the engine's tiers when it loads; anything else when the option is read.
    with pytest.raises(UserError, match="--speculation 'tree 16': use adaptive, off, full, or a tier's name"):
        SchedulerConfig(speculation="tree 16")


def test_a_cuda_engine_batches_at_least_64_rows_unless_serving_says_otherwise(engine_dir):
    """An engine built with the CPU-sized default (8) would leave a GPU queueing requests it could batch."""
    assert default_batch_size(8, torch.device("cuda")) == CUDA_MAX_BATCH_SIZE == 64
    assert default_batch_size(128, torch.device("cuda")) == 128
    assert default_batch_size(8, torch.device("cpu")) == 8
    built = open_engine(engine_dir).capacity["max_batch_size"]  # on this CPU: the build value
    assert built == default_batch_size(built, torch.device("cpu"))
    assert open_engine(engine_dir, serving=SchedulerConfig(max_batch_size=3)).capacity["max_batch_size"] == 3


def test_more_requests_than_blocks_queue_and_complete(tiny_llama_dir, tmp_path, engine):
    # 8 blocks of 8 tokens: each request's worst case (prompt + max_tokens) takes 3-6 blocks.
    short = convert_and_build(tiny_llama_dir, tmp_path, max_seq_len=64, max_input_len=24)
    with pytest.raises(UserError, match="max-num-tokens"):
        open_engine(short, serving=SchedulerConfig(cache=CacheBudget(max_num_tokens=32)))
    small = open_engine(short, serving=SchedulerConfig(cache=CacheBudget(block_size=8, max_num_tokens=64)))
    assert small.capacity["kv_cache_tokens"] == 64
    work = jobs(engine, 6)
    together, widest = run_together(small, work)
    assert together == [engine.generate(ids, params).token_ids for ids, params in work]
    assert 1 <= widest < len(work)
    assert small.scheduler.usage()["used_blocks"] == 0


def test_cancel_finish_and_stop_words_free_their_blocks(engine):
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    streams = [engine.stream(ids, SamplingParams(max_tokens=200, end_id=-1)) for _ in range(3)]
    for s in streams:
        next(s)
        next(s)
    assert engine.scheduler.usage()["used_blocks"] > 0
    for s in streams:
        s.close()  # a client that goes away mid-stream
    done = engine.generate(ids, SamplingParams(max_tokens=40, end_id=-1, stop_words=("e",)))
    assert done.finish_reason in ("stop", "length")
    usage = engine.scheduler.usage()
    assert usage["used_blocks"] == 0 and usage["running"] == 0


def test_a_stream_closed_from_another_thread_cancels_its_request(engine):
    """The Triton model closes a request's stream from the thread that found its response send stuck: the
    request leaves the engine and frees its blocks although its reader never reads again, and a reader
    reading on gets StreamClosed (no hang)."""
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    stuck = engine.stream(ids, SamplingParams(max_tokens=400, end_id=-1))
    next(stuck)  # running; its reader then stops reading (blocked in a send)
    threading.Thread(target=stuck.close).start()
    deadline = time.monotonic() + 30
    while engine.scheduler.usage()["used_blocks"]:
        assert time.monotonic() < deadline, "the closed request still holds blocks"
        time.sleep(0.05)
    waiting = engine.stream(ids, SamplingParams(max_tokens=400, end_id=-1))
    next(waiting)
    errors: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            while True:
                next(waiting)
        except Exception as exc:  # noqa: BLE001 - what the reader got is the test's subject
            errors.put(exc)

    reader = threading.Thread(target=read)
    reader.start()
    waiting.close()
    reader.join(timeout=30)
    assert isinstance(errors.get_nowait(), StreamClosed)
    assert engine.generate(ids, SamplingParams(max_tokens=6, end_id=-1)).finish_reason == "length"


def test_a_full_queue_answers_busy_and_the_engine_keeps_serving(engine_dir, engine):
    busy = open_engine(engine_dir, serving=SchedulerConfig(max_batch_size=1, max_queue=2))
    ids = engine.tokenizer(PROMPTS[2]).input_ids
    long = busy.stream(ids, SamplingParams(max_tokens=300, end_id=-1))
    next(long)  # running: the one row is taken
    queued = [busy.stream(ids, SamplingParams(max_tokens=4, end_id=-1)) for _ in range(2)]  # submitted now
    assert busy.scheduler.usage()["waiting"] == 2
    with pytest.raises(EngineBusy, match="busy"):
        busy.stream(ids, SamplingParams(max_tokens=4, end_id=-1))
    long.close()
    for s in queued:
        assert len(list(s)[-1].result.token_ids) == 4
    want = engine.generate(ids, SamplingParams(max_tokens=6, end_id=-1)).token_ids
    assert busy.generate(ids, SamplingParams(max_tokens=6, end_id=-1)).token_ids == want


def test_a_bad_request_is_refused_and_the_batch_around_it_is_unaffected(engine):
    work = jobs(engine, 4)
    alone = [engine.generate(ids, params).token_ids for ids, params in work]
    errors = []

    def bad() -> None:
        for params in (
            SamplingParams(temperature=float("nan")),
            SamplingParams(seed=-1),
            SamplingParams(temperature=float("inf")),
        ):
            with pytest.raises(RequestError) as err:
                list(engine.stream([1, 2], params))
            errors.append(str(err.value))

    thread = threading.Thread(target=bad)
    thread.start()
    together, _ = run_together(engine, work)
    thread.join()
    assert together == alone
    assert len(errors) == 3 and all(("temperature" in e or "seed" in e) for e in errors)


def test_the_sampler_uniforms_are_never_0_or_1():
    """The hash's smallest and largest values map strictly inside (0, 1) in float32: a uniform of 1 made an
    infinite Gumbel draw, and a NaN (always the argmax) on a token that top-k had masked."""
    extremes = unit_interval(torch.tensor([0, 1, (1 << UNIFORM_BITS) - 2, (1 << UNIFORM_BITS) - 1]))
    assert extremes.dtype == torch.float32
    assert bool(((extremes > 0) & (extremes < 1)).all()), extremes.tolist()
    assert bool(torch.isfinite(-torch.log(-torch.log(extremes))).all())


def test_the_device_sampler_draws_from_the_filtered_distribution():
    """Gumbel-max over hashed uniforms, position by position, matches target_probs (temperature, top-k,
    top-p) in frequency; greedy rows take the argmax."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    draws = 20000
    for p in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.5, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.7),
    ):
        rows = torch.ones(draws)
        tokens = sample_rows(
            logits.expand(draws, -1),
            rows * p.temperature,
            (rows * p.top_k).long(),
            rows * p.top_p,
            torch.full((draws,), 5),
            torch.arange(draws),
            filtered=True,
        )  # one draw a position
        freq = torch.bincount(tokens, minlength=12) / draws
        want = target_probs(logits[None], p)[0]
        assert (freq - want).abs().max() < 0.015, (p, freq, want)
        assert freq[want == 0].sum() == 0
    greedy = sample_rows(
        logits.expand(3, -1),
        torch.zeros(3),
        torch.zeros(3, dtype=torch.long),
        torch.ones(3),
        torch.tensor([1, 2, 3]),
        torch.zeros(3, dtype=torch.long),
        filtered=True,
    )
    assert torch.equal(greedy, logits.argmax().expand(3))


PAGED_KERNEL_CHECK = Path(__file__).with_name("paged_kernel_check.py")


def test_the_paged_decode_kernel_matches_the_gathered_attention():
    """The CUDA kernel under Triton's interpreter on CPU tensors, rows of different lengths and tables."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(PAGED_KERNEL_CHECK)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok" in done.stdout


@pytest.mark.parametrize("batched", [True, False])
def test_a_speculative_engine_serves_concurrent_requests_exactly(batched, tiny_llama_dir, tmp_path, engine):
    """An n-gram engine batches its requests in speculative steps (or, unbatched, serves its queue one
    request at a time through the speculative loop); each request gets plain greedy's tokens, and a full
    queue is busy."""
    spec = open_engine(
        convert_and_build(tiny_llama_dir, tmp_path, speculative="ngram", ngram_k=4),
        serving=SchedulerConfig(max_queue=3, batched=batched),
    )
    assert spec.batched == batched
    work = [(ids, SamplingParams(max_tokens=p.max_tokens, end_id=-1)) for ids, p in jobs(engine, 3)]
    together, widest = run_together(spec, work)
    assert together == [engine.generate(ids, params).token_ids for ids, params in work]
    assert widest == (3 if batched else 1)
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    running = spec.stream(ids, SamplingParams(max_tokens=300, end_id=-1))
    next(running)
    queued = [spec.stream(ids, SamplingParams(max_tokens=3, end_id=-1)) for _ in range(3)]
    with pytest.raises(EngineBusy):
        spec.stream(ids, SamplingParams(max_tokens=3, end_id=-1))
    running.close()
    for s in queued:
        assert len(list(s)[-1].result.token_ids) == 3


def test_chunks_a_consumer_has_not_taken_merge_in_order():
    """A consumer behind the scheduler gets one chunk of every step's tokens since it last read, but for the
    first token, which comes alone; an error after them still comes on its own; without merging (one request
    at a time) each chunk stays."""
    q = ChunkQueue()
    q.put(StreamChunk([1], False))
    q.put(StreamChunk([2, 3], False))
    q.put(StreamChunk([4], True, result=None))
    assert q.get() == StreamChunk([1], False)
    got = q.get()
    assert isinstance(got, StreamChunk) and got.token_ids == [2, 3, 4] and got.finished
    q.put(StreamChunk([5], False))
    q.put(RuntimeError("step failed"))
    assert q.get() == StreamChunk([5], False) and isinstance(q.get(), RuntimeError)
    kept = ChunkQueue(merge=False)
    kept.put(StreamChunk([1], False))
    kept.put(StreamChunk([2], False))
    assert [kept.get(), kept.get()] == [StreamChunk([1], False), StreamChunk([2], False)]
