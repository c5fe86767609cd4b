"""The OpenAI-compatible front against a real tritonserver serving a tiny random-model engine."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import uvicorn

from pipeline.bench.stream_client import completion_request, stream_completion
from pipeline.convert.tiny import make_tiny_model
from pipeline.openai_front import RETRY_AFTER_S, StopMatcher, build_app, error_response, triton_status
from pipeline.triton.repo import write_repository
from pipeline.triton.server import TritonServer, free_port
from tests.conftest import convert_and_build

MODEL = "tiny"
PROMPT = "The quick brown fox"
MAX_TOKENS = 12
READY_TIMEOUT_S = 30.0
# A cancelled stream asked for this many tokens (seconds of work on 2 cores if it ran to the end); the next
# request may then take its idle latency times SLOWDOWN_ALLOWED plus SLACK_S (a step or two of the
# cancelled request, a loaded machine).
LONG_MAX_TOKENS = 400
SLOWDOWN_ALLOWED, SLACK_S = 3.0, 2.0
THREADS_SETTLE_S = 5.0
GIVE_UP_S = 0.25  # a non-streaming client's read timeout: a fraction of the long request's time, idle or not


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory):
    """Triton on a tiny ngram-speculative engine, the front on a free port; yields (base_url, tokenizer dir)."""
    root = tmp_path_factory.mktemp("front")
    engine = convert_and_build(
        make_tiny_model(root / "hf"), root / "build", speculative="ngram", ngram_k=4, max_input_len=48, max_seq_len=1024
    )
    # Drafting every step: the adaptive controller may stop drafting a random model's n-grams.
    repo = write_repository(engine, root / "repo", serving={"speculation": "full"})
    tokenizer_dir = engine / "tokenizer"
    with TritonServer(repo, log=open(root / "triton.log", "w")) as triton:
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                build_app(triton.grpc_url, MODEL, tokenizer_dir), host="127.0.0.1", port=port, log_level="warning"
            )
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started, "OpenAI front did not start"
        yield f"http://127.0.0.1:{port}", tokenizer_dir
        server.should_exit = True
        thread.join(READY_TIMEOUT_S)


def _post(base: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{base}{path}", json=body, timeout=120)


def test_models_lists_the_served_name(front):
    base, _ = front
    data = requests.get(f"{base}/v1/models", timeout=10).json()
    assert [m["id"] for m in data["data"]] == [MODEL]


def test_completion_streaming_equals_non_streaming(front):
    base, _ = front
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    plain = _post(base, "/v1/completions", body).json()
    assert plain["object"] == "text_completion"
    text = plain["choices"][0]["text"]
    usage = plain["usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert plain["spec"]["acceptance_length"] >= 1.0

    streamed = stream_completion(base, completion_request(MODEL, PROMPT, MAX_TOKENS))
    assert streamed.text == text  # greedy: the same tokens whichever way they travel
    assert streamed.completion_tokens == usage["completion_tokens"]
    assert streamed.finish_reason in ("length", "stop")
    assert streamed.spec is not None and streamed.spec["acceptance_length"] >= 1.0
    assert len(streamed.timing.chunk_times) >= 1


def test_finished_requests_leave_no_thread_behind(front):
    """The front closes a finished stream (a cancel would leave a gRPC thread waiting for good)."""
    base, _ = front
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    _post(base, "/v1/completions", body)
    time.sleep(THREADS_SETTLE_S)
    before = threading.active_count()
    for _ in range(5):
        _post(base, "/v1/completions", body)
        stream_completion(base, completion_request(MODEL, PROMPT, 2))
    deadline = time.monotonic() + THREADS_SETTLE_S  # each stream is closed on a thread of its own
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before


def test_a_request_can_opt_out_of_speculation(front):
    """`speculative: false` reaches the engine: no drafts for that request, the same greedy text."""
    base, _ = front
    body = {"model": MODEL, "prompt": "one two three one two three one two", "max_tokens": MAX_TOKENS, "temperature": 0}
    drafted = _post(base, "/v1/completions", body).json()
    assert drafted["spec"]["draft_tokens"] > 0  # a repeating prompt: the n-gram table proposes
    plain = _post(base, "/v1/completions", {**body, "speculative": False}).json()
    assert plain["spec"]["draft_tokens"] == 0
    assert plain["choices"][0]["text"] == drafted["choices"][0]["text"]
    bad = _post(base, "/v1/completions", {**body, "speculative": "no"})
    assert bad.status_code == 400 and "speculative" in bad.json()["error"]["message"]


def test_sse_framing_ends_with_done(front):
    base, _ = front
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=120) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in resp.iter_lines(decode_unicode=True) if ln]
    assert all(ln.startswith("data: ") for ln in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    assert "spec" in chunks[-1]


def test_stream_usage_options(front):
    """include_usage adds a final usage chunk; continuous_usage_stats puts the running count on every chunk."""
    base, _ = front
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    total = _post(base, "/v1/completions", body).json()["usage"]

    def chunks(opts: dict) -> list[dict]:
        streamed = {**body, "stream": True, "stream_options": opts}
        with requests.post(f"{base}/v1/completions", json=streamed, stream=True, timeout=120) as resp:
            return [json.loads(ln[6:]) for ln in resp.iter_lines(decode_unicode=True) if ln.startswith("data: {")]

    plain = chunks({})
    assert all("usage" not in c for c in plain)
    last = chunks({"include_usage": True})[-1]
    assert last["choices"] == [] and last["usage"] == total
    running = [c["usage"]["completion_tokens"] for c in chunks({"continuous_usage_stats": True})]
    assert running == sorted(running) and running[-1] == total["completion_tokens"]
    bad = _post(base, "/v1/completions", {**body, "stream": True, "stream_options": "yes"})
    assert bad.status_code == 400 and "stream_options" in bad.json()["error"]["message"]


def test_chat_applies_the_template(front):
    base, tokenizer_dir = front
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": PROMPT}]
    chat = _post(
        base, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    ).json()
    assert chat["object"] == "chat.completion"
    templated = AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    plain = _post(
        base, "/v1/completions", {"model": MODEL, "prompt": templated, "max_tokens": 8, "temperature": 0}
    ).json()
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]

    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    with requests.post(f"{base}/v1/chat/completions", json=body, stream=True, timeout=120) as resp:
        lines = [ln for ln in resp.iter_lines(decode_unicode=True) if ln.startswith("data: {")]
    deltas = [json.loads(ln[6:])["choices"][0]["delta"].get("content", "") for ln in lines]
    assert "".join(deltas) == chat["choices"][0]["message"]["content"]


def test_errors_are_openai_shaped(front):
    base, _ = front
    bad_json = requests.post(
        f"{base}/v1/completions", data=b"{not json", timeout=10, headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    missing = _post(base, "/v1/completions", {"model": MODEL, "max_tokens": 4})
    assert missing.status_code == 400 and "prompt" in missing.json()["error"]["message"]
    no_messages = _post(base, "/v1/chat/completions", {"model": MODEL})
    assert no_messages.status_code == 400
    too_long = _post(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT * 2000, "max_tokens": 4})
    assert too_long.status_code == 400 and "bytes" in too_long.json()["error"]["message"]


CLIENT_MISTAKES = {
    "temperature -1": ({"temperature": -1}, "temperature"),
    "top_p 2": ({"top_p": 2}, "top_p"),
    "max_tokens 10^9": ({"max_tokens": 10**9}, "max_seq_len"),
    "max_tokens 2^31": ({"max_tokens": 2**31}, "max_tokens"),
    "n 2": ({"n": 2}, "'n'"),
    "stream yes": ({"stream": "yes"}, "stream"),
    "prompt over max_input_len tokens": ({"prompt": "fox " * 200}, "max_input_len"),
}


@pytest.mark.parametrize("case", sorted(CLIENT_MISTAKES))
def test_client_mistakes_are_400_in_openai_format(front, case):
    base, _ = front
    fields, message = CLIENT_MISTAKES[case]
    reply = _post(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


def test_unknown_model_is_404(front):
    base, _ = front
    reply = _post(base, "/v1/completions", {"model": "gpt-4", "prompt": PROMPT, "max_tokens": 4})
    assert reply.status_code == 404 and "gpt-4" in reply.json()["error"]["message"]


def test_a_closed_stream_stops_the_engine(front):
    """The engine serves one request at a time (speculative): a stream whose connection closes must end
    in the engine, or the next request waits for all of its tokens."""
    base, _ = front
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    start = time.monotonic()
    _post(base, "/v1/completions", body)
    baseline = time.monotonic() - start
    # Plain steps (no drafting), so that the long request takes seconds whatever the n-gram table accepts.
    long = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": LONG_MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "speculative": False,
    }
    with requests.post(f"{base}/v1/completions", json=long, stream=True, timeout=120) as resp:
        lines = resp.iter_lines()
        for _ in range(2):
            next(lines)
    start = time.monotonic()
    _post(base, "/v1/completions", body)
    assert time.monotonic() - start < baseline * SLOWDOWN_ALLOWED + SLACK_S

    # A non-streaming request whose client gives up: the front notices the closed connection.
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{base}/v1/completions", json={**long, "stream": False}, timeout=GIVE_UP_S)
    start = time.monotonic()
    _post(base, "/v1/completions", body)
    assert time.monotonic() - start < baseline * SLOWDOWN_ALLOWED + SLACK_S


def test_stop_strings_cut_the_text(front):
    base, _ = front
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    full = _post(base, "/v1/completions", body).json()["choices"][0]["text"]
    if len(full) < 3:
        pytest.skip("the random model produced too little text to place a stop string")
    stop = full[2:4]
    cut = _post(base, "/v1/completions", {**body, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_stop_matcher_holds_back_a_partial_stop():
    m = StopMatcher(("END",))
    assert m.feed("abcE") == "ab"  # "cE" might start "END"
    assert m.feed("N") == "c"
    assert m.feed("Dxyz") == ""
    assert m.stopped
    free = StopMatcher(())
    assert free.feed("abc") == "abc" and free.flush() == "" and not free.stopped


def test_triton_errors_map_to_http_statuses():
    """The engine's full queue (EngineBusy, answered by the engine model as "busy, retry later") is a 503
    with Retry-After; a server fault 500; the models' refusals 400. Tested on the messages: the engine
    does not raise EngineBusy yet, so no request can be made busy end to end."""
    assert triton_status("tensorrt_llm: busy, retry later (queue full)") == 503
    assert triton_status("tensorrt_llm: the server is shutting down; retry on another or later") == 503
    assert triton_status("in ensemble 'ensemble', Stub process 'tensorrt_llm_0_0' is not healthy.") == 500
    assert triton_status("tensorrt_llm: internal error: RuntimeError: x") == 500
    assert triton_status("tensorrt_llm: max_tokens must be >= 1, got 0") == 400
    busy = error_response(503, "Triton: tensorrt_llm: busy, retry later")
    assert busy.status_code == 503 and busy.headers["retry-after"] == str(RETRY_AFTER_S)
    assert json.loads(busy.body)["error"]["type"] == "server_overloaded"
