"""Tensor parallel on the CPU: a TP-2 engine runs as two processes over gloo, each on its own shard.

The TP-2 engine's greedy output is token-identical to the TP-1 engine's (float32), with several requests
in flight at once, in-process and through `specpipe generate`; engines whose heads do not split are
refused; a speculative TP-2 engine runs its shards merged in one process; a rank that dies or hangs ends
the request with an error and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import convert_and_build

from pipeline.engine import parallel
from pipeline.engine.config import EngineDir
from pipeline.engine.loader import load_engine, open_engine
from pipeline.engine.parallel import ParallelConfig, RankFailure
from pipeline.engine.runner import Engine
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import UserError

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog and runs", "hello", "1 2 3 4 5 6 7 8 9"]
MAX_TOKENS = 24
# Long enough to be mid-generation when a rank is killed or stopped.
LONG_REQUEST_TOKENS = 400
# A short collective timeout and stop grace, so that the hang test ends quickly.
QUICK = ParallelConfig(timeout_s=3.0, stop_grace_s=1.0)
POLL_S = 0.002
# SmolLM2-135M's attention: 9 query heads over 3 KV heads.
SMOLLM2_HEADS = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536}


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {tp: convert_and_build(tiny_llama_dir, root / f"tp{tp}", tp=tp) for tp in (1, 2)}


@pytest.fixture(scope="module")
def reference(engines: dict[int, Path]) -> tuple[Engine, list[list[int]]]:
    """The TP-1 engine and its greedy tokens for each prompt."""
    engine = open_engine(engines[1])
    params = SamplingParams(max_tokens=MAX_TOKENS, end_id=-1)
    return engine, [engine.generate(ids(engine, p), params).token_ids for p in PROMPTS]


@pytest.fixture
def tp2(engines: dict[int, Path]) -> Iterator[Engine]:
    engine = open_engine(engines[2])
    yield engine
    parallel.shutdown()


def ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer(text).input_ids


def gone(pid: int) -> bool:
    """No such process any more (a reaped child leaves nothing under /proc)."""
    return not Path(f"/proc/{pid}").exists()


def test_tp2_greedy_matches_tp1_with_requests_in_flight(tp2: Engine, reference: tuple[Engine, list[list[int]]]) -> None:
    group = parallel.live()
    assert group is not None and len(group.pids) == 1 and all(not gone(p) for p in group.pids)
    # Each rank's pool holds its half of the KV heads.
    assert tp2.target.cfg.num_kv_heads == reference[0].target.cfg.num_kv_heads // 2
    params = SamplingParams(max_tokens=MAX_TOKENS, end_id=-1)
    work = PROMPTS * 2  # eight requests at once, over the four prompts
    results: list[list[int] | BaseException] = [[] for _ in work]
    start = threading.Barrier(len(work))

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = tp2.generate(ids(tp2, work[i]), params).token_ids
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    widest = 0
    while any(t.is_alive() for t in threads):
        widest = max(widest, tp2.scheduler.usage()["running"])
        time.sleep(POLL_S)
    assert results == reference[1] * 2
    assert widest > 1  # the requests shared steps


def test_generate_cli_spawns_the_ranks(engines: dict[int, Path], reference: tuple[Engine, list[list[int]]]) -> None:
    cmd = [sys.executable, "-m", "pipeline", "generate", "--engine", str(engines[2]), "--prompt", PROMPTS[0]]
    cmd += ["--max-tokens", str(MAX_TOKENS), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # Not asked for end_id=-1: the reference's tokens up to its first end token, if any.
    want = reference[1][0]
    eos = reference[0].tokenizer.eos_token_id
    assert out["token_ids"] == (want[: want.index(eos)] if eos in want else want)


def test_heads_that_do_not_split_are_refused(engines: dict[int, Path], tmp_path: Path) -> None:
    """A SmolLM2-shaped engine (9 heads, 3 KV heads) marked TP 2: refused before any rank starts."""
    engine = tmp_path / "smollm2-tp2"
    shutil.copytree(engines[1], engine)
    config = json.loads((engine / "config.json").read_text())
    config["pretrained_config"].update(SMOLLM2_HEADS)
    config["pretrained_config"]["mapping"].update(tp_size=2, world_size=2)
    (engine / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"size 2 does not split this model's 9 attention heads, 3 KV heads") as err:
        open_engine(engine)
    assert "--tp-size 1 or 3" in str(err.value)
    assert parallel.live() is None


def test_a_speculative_tp2_engine_runs_its_shards_merged_in_one_process(tiny_llama_dir: Path, tmp_path: Path) -> None:
    spec = open_engine(convert_and_build(tiny_llama_dir, tmp_path / "spec", tp=2, speculative="ngram", ngram_k=4))
    assert parallel.live() is None  # no ranks started
    plain = open_engine(convert_and_build(tiny_llama_dir, tmp_path / "plain"))
    ids = plain.tokenizer("hello hello hello").input_ids
    params = SamplingParams(max_tokens=12, end_id=-1)
    assert spec.generate(ids, params).token_ids == plain.generate(ids, params).token_ids


def interrupt_mid_request(engine: Engine, interrupt: signal.Signals) -> tuple[BaseException, float, list[int]]:
    """Start a long request, send `interrupt` to rank 1 after its first tokens: (the request's error, seconds
    from the signal to the error, the ranks' pids)."""
    group = parallel.live()
    assert group is not None
    pids = group.pids
    chunks = engine.stream(ids(engine, PROMPTS[1]), SamplingParams(max_tokens=LONG_REQUEST_TOKENS, end_id=-1))
    next(chunks)
    next(chunks)
    os.kill(pids[0], interrupt)
    sent = time.monotonic()
    with pytest.raises(RankFailure) as err:
        for _ in chunks:
            pass
    return err.value, time.monotonic() - sent, pids


def test_a_killed_rank_ends_the_request_and_leaves_no_process(tp2: Engine) -> None:
    error, seconds, pids = interrupt_mid_request(tp2, signal.SIGKILL)
    assert "rank 1 of 2 was killed by signal SIGKILL" in str(error) and "restart it" in str(error)
    assert seconds < parallel.RANK_TIMEOUT_S / 10  # the connection closes: no waiting for the timeout
    assert all(gone(p) for p in pids) and parallel.live() is None
    # The engine stays failed, with the same error, and the process is free for another group.
    with pytest.raises(RankFailure, match="SIGKILL"):
        tp2.generate(ids(tp2, PROMPTS[0]), SamplingParams(max_tokens=2))


def test_a_hung_rank_ends_the_request_within_the_timeout(engines: dict[int, Path]) -> None:
    engine = load_engine(EngineDir.load(engines[2]), torch.device("cpu"), None, None, QUICK)
    try:
        error, seconds, pids = interrupt_mid_request(engine, signal.SIGSTOP)
        assert f"did not answer within {QUICK.timeout_s:g} s" in str(error)
        assert seconds < QUICK.timeout_s + parallel.DEATH_NOTICE_S + QUICK.stop_grace_s + 5
        assert all(gone(p) for p in pids)  # the stopped rank was killed and reaped
    finally:
        parallel.shutdown()
