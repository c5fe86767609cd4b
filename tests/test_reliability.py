"""The real tritonserver under hostile and careless clients: oversized bodies, bad inputs, cancelled streams,
a killed engine process. Each test ends by checking that the server still serves a normal request.

One server for the module, launched as `specpipe serve` launches it (a crashed tritonserver is restarted):
a tiny random engine speculating with n-grams, so that it serves one request at a time (a request that is
not cancelled makes the next one wait). Every test before the stub kills asserts that no crash happened
meanwhile. The stub-kill tests run last since they reload a model or restart the server.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
import uuid

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from conftest import convert_and_build
from tritonclient.utils import InferenceServerException

from pipeline.client.client import (
    BLS,
    ENGINE_MODEL,
    ENSEMBLE,
    Sampling,
    TritonRequestError,
    _grpc_input,
    _json_inputs,
    close_stream,
    engine_inputs,
    generate,
    infer_grpc,
    text_inputs,
)
from pipeline.triton.repo import write_repository
from pipeline.triton.server import MAX_RESTARTS, SHM_DIR, TritonServer, free_ports, python_stubs

MAX_INPUT_LEN, MAX_SEQ_LEN = 48, 1024
LIMITS = {"max_input_len": MAX_INPUT_LEN, "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 4}
# A cancelled stream asks for this many tokens (seconds of work on 2 cores if it ran to the end); the next
# request may then take its idle latency times SLOWDOWN_ALLOWED plus SLACK_S (a step or two of the
# cancelled request, a loaded machine).
LONG_MAX_TOKENS = 400
CHUNKS_BEFORE_CANCEL = 2
SLOWDOWN_ALLOWED, SLACK_S = 3.0, 2.0
THREADS_S = 10.0  # the stub's threads are back to their number before the cancel within this
# The watchdog polls every 0.5 s; the tiny engine reloads in about 10 s on 2 busy cores.
DETECT_S, RELOAD_S = 5.0, 120.0
# Streams orphaned by a killed BLS stub ask for this many tokens, so they are still running when it dies; the
# ensemble must answer within ORPHANED_ANSWER_S (each orphan's stuck send holds the others up to STUCK_SEND_S).
ORPHAN_MAX_TOKENS = 900
ORPHANED_ANSWER_S = 60.0
RETRY_S = 0.5

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
MB = 1_000_000
# "hello " repeated to 6 MB killed tritonserver 2.51 (SIGSEGV in its HTTP parser) when form-encoded.
BIG_BODIES_BYTES = (6 * MB, 18 * MB)
# An oversized prompt is refused on its byte count, before tokenization: well under this, even on 2 cores
# (tokenizing 6 MB took about 8 s there).
REFUSAL_S = 5.0
FORM, JSON = "application/x-www-form-urlencoded", "application/json"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    engine = convert_and_build(tiny_llama_dir, root / "build", speculative="ngram", ngram_k=4, **LIMITS)
    repo = write_repository(engine, root / "repo")
    with (
        open(root / "tritonserver.log", "w") as log,
        TritonServer(repo, free_ports(), log=log, max_restarts=MAX_RESTARTS) as server,
    ):
        yield server
    assert not list(SHM_DIR.glob(f"{server.shm_prefix}*")), "shared-memory regions left behind"


def _serves_normally(server) -> None:
    reply = generate(server.grpc_url, PROMPT, Sampling(max_tokens=MAX_TOKENS))
    assert reply.num_output_tokens > 0


def _kept_serving(server) -> None:
    """Serves a normal request, and tritonserver never died (a restart would hide a crash)."""
    assert not server.crashes, f"tritonserver crashed and was restarted: {server.tail_text()}"
    _serves_normally(server)


def _big_text(size: int) -> str:
    return "hello " * (size // len("hello "))


@pytest.mark.parametrize("content_type", [FORM, JSON])
def test_oversized_http_bodies_are_refused_and_the_server_keeps_serving(server, content_type):
    for size in BIG_BODIES_BYTES:
        body = json.dumps({"text_input": _big_text(size), "max_tokens": MAX_TOKENS}).encode()
        start = time.monotonic()
        reply = requests.post(
            f"http://{server.http_url}/v2/models/{ENSEMBLE}/generate",
            data=body,
            headers={"Content-Type": content_type},
            timeout=60,
        )
        assert time.monotonic() - start < REFUSAL_S
        assert reply.status_code == 400, reply.text[:300]
        assert "text_input has" in reply.json()["error"] and "max_input_len" in reply.json()["error"]
        assert server.process.poll() is None, "tritonserver died"
    _kept_serving(server)


def test_oversized_grpc_prompts_are_refused_and_the_server_keeps_serving(server):
    for size in BIG_BODIES_BYTES:
        inputs = text_inputs(_big_text(size), Sampling(max_tokens=MAX_TOKENS), stream=False)
        start = time.monotonic()
        with pytest.raises(TritonRequestError, match="text_input has .* bytes, over the"):
            infer_grpc(server.grpc_url, ENSEMBLE, inputs)
        assert time.monotonic() - start < REFUSAL_S
    _kept_serving(server)


BAD_HTTP_REQUESTS = {
    "missing text_input": ({"max_tokens": MAX_TOKENS}, "input 'text_input' is missing"),
    "missing max_tokens": ({"text_input": PROMPT}, "input 'max_tokens' is missing"),
    "unknown input name": (
        {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "tempreature": 0.5},
        "unknown input(s) 'tempreature'",
    ),
    "temperature NaN": (
        {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": float("nan")},
        "temperature must be a finite number",
    ),
    "temperature inf": (
        {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1e39},
        "temperature must be a finite number",
    ),
    "end_id outside the vocabulary": (
        {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "end_id": 10**6},
        "outside the vocabulary",
    ),
    "max_tokens 2^31": ({"text_input": PROMPT, "max_tokens": 2**31}, "wraps around"),
}


@pytest.mark.parametrize(
    "route",
    ["ensemble/generate", "ensemble/generate_stream", "tensorrt_llm_bls/generate", "tensorrt_llm_bls/generate_stream"],
)
def test_client_mistakes_are_400_with_one_message_on_every_http_route(server, route):
    for case, (body, message) in BAD_HTTP_REQUESTS.items():
        stream = route.endswith("stream")
        reply = requests.post(
            f"http://{server.http_url}/v2/models/{route}",
            data=json.dumps({**body, "stream": stream}),
            headers={"Content-Type": JSON},
            timeout=60,
        )
        assert reply.status_code == 400, (case, reply.text)
        assert message in reply.text, (case, reply.text)
    _kept_serving(server)


def test_missing_text_input_over_grpc_is_an_error(server):
    for model in (ENSEMBLE, BLS):
        inputs = text_inputs(PROMPT, Sampling(max_tokens=MAX_TOKENS), stream=True)
        del inputs["text_input"]
        with pytest.raises(TritonRequestError, match="input 'text_input' is missing"):
            infer_grpc(server.grpc_url, model, inputs)


def test_chat_template_input_wraps_the_prompt(server, tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    question = "What is the capital of France?"
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    inputs = text_inputs(question, Sampling(max_tokens=MAX_TOKENS), stream=False)
    inputs["apply_chat_template"] = np.array([[True]])
    for model in (ENSEMBLE, BLS):
        reply = infer_grpc(server.grpc_url, model, inputs)
        assert reply.num_input_tokens == len(tokenizer(templated).input_ids)
        assert reply.text == generate(server.grpc_url, templated, Sampling(max_tokens=MAX_TOKENS), model=model).text


def _latency(server, model: str = ENSEMBLE) -> float:
    start = time.monotonic()
    generate(server.grpc_url, PROMPT, Sampling(max_tokens=MAX_TOKENS), model=model)
    return time.monotonic() - start


def _cancel_grpc_stream(url: str, model: str, inputs: dict) -> None:
    """Open a stream, read CHUNKS_BEFORE_CANCEL responses, cancel it."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(model, [_grpc_input(k, v) for k, v in inputs.items()], request_id=uuid.uuid4().hex)
    for _ in range(CHUNKS_BEFORE_CANCEL):
        result, error = responses.get(timeout=60)
        assert error is None, error
    close_stream(client, cancel=True)


def _cancel_http_stream(url: str, model: str, inputs: dict) -> None:
    body = {**_json_inputs(inputs), "stream": True}
    with requests.post(f"http://{url}/v2/models/{model}/generate_stream", json=body, stream=True, timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith(b"data:"))
        for _ in range(CHUNKS_BEFORE_CANCEL):
            next(events)


@pytest.mark.parametrize("route", ["grpc tensorrt_llm_bls", "http tensorrt_llm_bls", "grpc tensorrt_llm"])
def test_a_cancelled_stream_frees_the_engine(server, route):
    """Unless a cancelled stream ends in the engine, the next request waits for all its LONG_MAX_TOKENS
    tokens. (Through the ensemble Triton 2.51 does not pass the cancel on: docs/serving.md.)"""
    protocol, model = route.split()
    baseline = _latency(server)
    stub = next(pid for pid, name in python_stubs(server.process.pid).items() if name == model)
    threads = _threads(stub)
    sampling = Sampling(max_tokens=LONG_MAX_TOKENS, end_id=-1)
    if model == ENGINE_MODEL:
        inputs = engine_inputs([1, 2, 3, 4, 5], sampling, stream=True)
    else:
        inputs = text_inputs(PROMPT, sampling, stream=True)
    cancel = _cancel_grpc_stream if protocol == "grpc" else _cancel_http_stream
    ours = threading.active_count()
    cancel(server.grpc_url if protocol == "grpc" else server.http_url, model, inputs)
    assert _latency(server) < baseline * SLOWDOWN_ALLOWED + SLACK_S
    # Nor in the client (the OpenAI front cancels this way when its client goes away).
    deadline = time.monotonic() + THREADS_S
    while threading.active_count() > ours:
        assert time.monotonic() < deadline, f"{threading.enumerate()}: the cancelled stream left a thread"
        time.sleep(0.1)
    # Nothing of the cancelled request stays behind in the model's stub (a worker waiting for a response
    # Triton never delivers grew the BLS stub by megabytes a minute under a stream of cancels).
    deadline = time.monotonic() + THREADS_S
    while _threads(stub) > threads:
        assert time.monotonic() < deadline, f"{model}: a thread of the cancelled request is still running"
        time.sleep(0.1)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_a_send_waits_for_no_stuck_sender():
    """Sends are serialized; a send that never returns (a response to a requester that died) holds the lock.
    Here a second stuck sender and a good one wait behind it: the stuck one takes over the lock first and is
    stuck under it too; the good send and every later one still go through."""
    from pipeline.triton.send import STUCK_SEND_S, send

    release, entered = threading.Event(), threading.Semaphore(0)

    class Stuck:
        def send(self, response=None, flags=0):
            entered.release()
            release.wait()  # blocked until the test ends

    class Sent:
        def __init__(self):
            self.done = threading.Event()

        def send(self, response=None, flags=0):
            self.done.set()

    def start(sender) -> None:
        threading.Thread(target=send, args=(sender,), daemon=True).start()

    try:
        start(Stuck())
        assert entered.acquire(timeout=5)
        start(Stuck())
        time.sleep(0.3)  # its wait for the first one's lock ends first
        good = Sent()
        start(good)
        assert entered.acquire(timeout=STUCK_SEND_S + 5)
        assert good.done.wait(timeout=2 * STUCK_SEND_S + 5)
        later = Sent()
        start(later)
        assert later.done.wait(timeout=STUCK_SEND_S + 5)
    finally:
        release.set()


def test_slow_sends_that_queue_past_the_stuck_time_stay_serialized():
    """Senders queued behind one another wait in all longer than STUCK_SEND_S, yet no holder is stuck: none
    may take another's lock for stuck (two sends at once crash the backend)."""
    from pipeline.triton.send import STUCK_SEND_S, send

    hold = STUCK_SEND_S / 3
    inside, most, guard = [0], [0], threading.Lock()

    class Slow:
        def send(self, response=None, flags=0):
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(hold)
            with guard:
                inside[0] -= 1

    threads = [threading.Thread(target=send, args=(Slow(),)) for _ in range(5)]  # the last waits 4 holds
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10 * STUCK_SEND_S)
    assert most[0] == 1, f"{most[0]} sends ran at once"


def test_a_killed_engine_stub_is_reloaded_and_health_tells_the_truth(server):
    stubs = python_stubs(server.process.pid)
    victim = next(pid for pid, model in stubs.items() if model == ENGINE_MODEL)
    os.kill(victim, signal.SIGKILL)
    ready = f"http://{server.http_url}/v2/health/ready"
    deadline = time.monotonic() + DETECT_S
    while requests.get(ready, timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "still ready after the engine's stub died"
        time.sleep(0.1)
    assert requests.get(f"http://{server.http_url}/v2/models/{ENGINE_MODEL}/ready", timeout=5).status_code != 200
    deadline = time.monotonic() + RELOAD_S
    while requests.get(ready, timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "not ready again after the reload"
        time.sleep(0.5)
    assert server.watchdog.reloads == [ENGINE_MODEL]
    _kept_serving(server)
    assert "stub of model 'tensorrt_llm' died" in server.tail_text()


def test_streams_orphaned_by_a_killed_bls_stub_stop_nothing_else(server):
    """A BLS stub killed with a stream on every engine row: the engine's responses to its requests are never
    acknowledged, so each of their sends blocks for good (the ensemble hung behind them), and their requests
    held every engine row until max_tokens (past a minute with the CPU busy). Each stuck send cancels its
    request: the ensemble still answers, BLS is reloaded and serves again. tritonserver 2.51 itself at times
    aborts as the stub dies (boost::interprocess::lock_exception); the launcher then restarts it, and a
    client retrying meanwhile is answered all the same."""
    responses: queue.Queue = queue.Queue()
    clients = []
    for _ in range(LIMITS["max_batch_size"]):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: responses.put(error))
        inputs = text_inputs(PROMPT, Sampling(max_tokens=ORPHAN_MAX_TOKENS, end_id=-1), stream=True)
        client.async_stream_infer(BLS, [_grpc_input(k, v) for k, v in inputs.items()])
        clients.append(client)
    for _ in range(CHUNKS_BEFORE_CANCEL * len(clients)):
        assert responses.get(timeout=60) is None
    victim = next(pid for pid, model in python_stubs(server.process.pid).items() if model == BLS)
    os.kill(victim, signal.SIGKILL)
    answered: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: answered.put(_retried_latency(server, ENSEMBLE)), daemon=True).start()
    assert answered.get(timeout=ORPHANED_ANSWER_S) > 0, "the ensemble did not answer"
    deadline = time.monotonic() + RELOAD_S
    while server.watchdog.reloads[-1:] != [BLS] and not server.crashes:
        assert time.monotonic() < deadline, f"{BLS} not reloaded {RELOAD_S:.0f} s after its stub died"
        time.sleep(0.5)
    assert _retried_latency(server, BLS) > 0
    assert server.failure is None
    for client in clients:  # their streams never end: the BLS that served them is gone
        client.stop_stream(cancel_requests=True)
        client.close()


def _retried_latency(server, model: str) -> float:
    """Latency of a normal request, retried every RETRY_S while the server is restarting (as a client would
    on UNAVAILABLE or a refused connection), until RELOAD_S."""
    deadline = time.monotonic() + RELOAD_S
    while True:
        try:
            return _latency(server, model)
        except (TritonRequestError, InferenceServerException):
            if time.monotonic() > deadline:
                raise
            time.sleep(RETRY_S)


def test_a_stub_killed_as_the_server_comes_up_is_reloaded(tiny_llama_dir, tmp_path):
    """The watchdog knows every stub from the moment the server is ready: a BLS stub killed before its first
    look is reloaded too (it was missed, and every BLS request failed from then on), and BLS serves again."""
    engine = convert_and_build(tiny_llama_dir, tmp_path / "build", **LIMITS)
    repo = write_repository(engine, tmp_path / "repo")
    with open(tmp_path / "tritonserver.log", "w") as log, TritonServer(repo, free_ports(), log=log) as server:
        victim = next(pid for pid, model in python_stubs(server.process.pid).items() if model == BLS)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + RELOAD_S
        while server.watchdog.reloads != [BLS]:
            assert time.monotonic() < deadline, f"{BLS} not reloaded {RELOAD_S:.0f} s after its stub died"
            time.sleep(0.5)
        reply = generate(server.grpc_url, PROMPT, Sampling(max_tokens=MAX_TOKENS), model=BLS)
        assert reply.num_output_tokens > 0


# A restart loads every model again: about 10 s for a tiny engine on 2 cores, longer beside a busy server.
RESTART_S = 120.0


def _processes_naming(text: str) -> list[int]:
    """Pids of living processes whose command line contains text."""
    from pathlib import Path

    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue  # the process ended while we looked
    return pids


def test_a_killed_tritonserver_is_restarted_on_the_same_ports(tiny_llama_dir, tmp_path):
    """`specpipe serve`'s launcher: tritonserver killed with SIGKILL comes back on the same ports (not ready
    meanwhile), serves again, and a requested stop leaves no process behind."""
    from pipeline.triton.server import MAX_RESTARTS, group_members

    engine = convert_and_build(tiny_llama_dir, tmp_path / "build", **LIMITS)
    repo = write_repository(engine, tmp_path / "repo")
    log_file = tmp_path / "tritonserver.log"
    with open(log_file, "w") as log, TritonServer(repo, free_ports(), log=log, max_restarts=MAX_RESTARTS) as server:
        _serves_normally(server)
        first_pid = server.process.pid
        os.kill(first_pid, signal.SIGKILL)
        ready = f"http://{server.http_url}/v2/health/ready"
        deadline = time.monotonic() + DETECT_S
        while _is_ready(ready):
            assert time.monotonic() < deadline, "still ready after tritonserver was killed"
            time.sleep(0.1)
        deadline = time.monotonic() + RESTART_S
        while not _is_ready(ready):
            assert time.monotonic() < deadline, f"not ready again {RESTART_S:.0f} s after the kill; see {log_file}"
            time.sleep(0.5)
        _serves_normally(server)
        assert server.process.pid != first_pid
        assert len(server.crashes) == 1 and server.failure is None
        assert list(SHM_DIR.glob(f"{server.shm_prefix}*")), "the restarted server's stubs have no shared memory"
        pids = (first_pid, server.process.pid)
        # The launcher notes the restart once its watchdog is back, which can come after clients see ready.
        deadline = time.monotonic() + RESTART_S
        while "tritonserver is ready again" not in log_file.read_text():
            assert time.monotonic() < deadline, f"no restart note {RESTART_S:.0f} s after ready; see {log_file}"
            time.sleep(0.1)
    text = log_file.read_text()
    assert f"tritonserver (pid {first_pid}) exited unasked with signal SIGKILL" in text
    assert "tritonserver is ready again" in text
    assert not _processes_naming(server.shm_prefix), "a tritonserver or stub is still running"
    assert not [pid for pid in pids if group_members(pid)], "a process of a server's group is still running"
    assert not list(SHM_DIR.glob(f"{server.shm_prefix}*")), "shared-memory regions left behind"


def _is_ready(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.ConnectionError:
        return False
