"""The real tritonserver on a generated repository: outputs equal the engine's, clear errors, concurrency, verify.

One server per engine for the whole module (module-scoped fixtures); tiny random engines keep it fast.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import convert_and_build

from pipeline.client.client import (
    BLS,
    ENSEMBLE,
    Sampling,
    TritonRequestError,
    generate,
    generate_ids,
    infer_grpc,
    infer_http,
    text_inputs,
)
from pipeline.client.verify import verify
from pipeline.convert.tiny import TINY_SHAPES, make_random_medusa, make_tiny_model
from pipeline.engine.kv_cache import DEFAULT_BLOCK_SIZE
from pipeline.engine.loader import open_engine
from pipeline.engine.runner import Engine, SamplingParams
from pipeline.triton.repo import write_repository
from pipeline.triton.server import READY_TIMEOUT_S, SHM_DIR, TritonServer, free_ports

MAX_INPUT_LEN, MAX_SEQ_LEN = 48, 160
MAX_TOKENS = 12
METRICS_WAIT_S = 10.0
STOP_TIMEOUT_S = 60.0  # `specpipe serve` stops tritonserver and its stubs on SIGTERM within this
PROMPTS = ("The quick brown fox", "Once upon a time there was", "def add(a, b):", "Medusa heads and EAGLE drafts")
LIMITS = {"max_input_len": MAX_INPUT_LEN, "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 4}


@pytest.fixture(scope="module")
def plain_engine(tiny_llama_dir, tmp_path_factory) -> Path:
    return convert_and_build(tiny_llama_dir, tmp_path_factory.mktemp("plain"), **LIMITS)


@pytest.fixture(scope="module")
def medusa_engine(tiny_llama_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("medusa")
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    heads = make_random_medusa(root / "heads", hidden=TINY_SHAPES["hidden_size"], vocab=vocab, heads=2)
    return convert_and_build(
        tiny_llama_dir, root / "build", medusa=heads, num_medusa_heads=2, choices="[[0], [0, 0], [1], [0, 1]]", **LIMITS
    )


@contextlib.contextmanager
def _serve(engine_dir: Path, tmp: Path):
    """tritonserver on a repository for the engine; stopped when the block ends, a failing one included."""
    repo = write_repository(engine_dir, tmp / "repo")
    with open(tmp / "tritonserver.log", "w") as log, TritonServer(repo, free_ports(), log=log) as server:
        yield server
    assert not list(SHM_DIR.glob(f"{server.shm_prefix}*")), "shared-memory regions left behind"


@pytest.fixture(scope="module")
def server(plain_engine, tmp_path_factory):
    with _serve(plain_engine, tmp_path_factory.mktemp("serve_plain")) as running:
        yield running


@pytest.fixture(scope="module")
def engine(plain_engine) -> Engine:
    return open_engine(plain_engine)


def direct(engine: Engine, prompt: str, max_tokens: int = MAX_TOKENS):
    return engine.generate(engine.tokenizer(prompt).input_ids, SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("model", [ENSEMBLE, BLS])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream", [False, True])
def test_text_equals_engine_output(server, engine, model, protocol, stream):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    prompt = PROMPTS[(model == BLS) + 2 * stream]
    expected = direct(engine, prompt)
    reply = generate(url, prompt, Sampling(max_tokens=MAX_TOKENS), stream=stream, protocol=protocol, model=model)
    assert reply.text == expected.text
    assert reply.num_output_tokens == len(expected.token_ids)
    assert reply.num_input_tokens == len(expected.prompt_token_ids)
    assert reply.ttft_s > 0
    if stream:
        assert reply.responses >= 2  # tokens arrived in pieces


def test_engine_model_returns_the_engine_token_ids(server, engine):
    expected = direct(engine, PROMPTS[2])
    for stream in (False, True):
        reply = generate_ids(server.grpc_url, expected.prompt_token_ids, Sampling(max_tokens=MAX_TOKENS), stream=stream)
        assert reply.output_ids == expected.token_ids
        assert reply.total_draft_tokens == 0 and reply.acceptance_rate == 0.0  # plain decoding drafts nothing
        # The blocks its text fills in the pool (the last token drawn is never written).
        cached = len(expected.prompt_token_ids) + len(expected.token_ids) - 1
        assert reply.kv_cache_alloc_total_blocks == -(-cached // DEFAULT_BLOCK_SIZE)


def _raw_ensemble(server, **overrides):
    inputs = text_inputs("The quick brown fox", Sampling(max_tokens=4), stream=False)
    inputs.update(overrides)
    return infer_grpc(server.grpc_url, ENSEMBLE, inputs)


BAD_REQUESTS = {
    "empty prompt": (dict(text_input=np.array([[b""]], dtype=object)), "prompt is empty"),
    "max_tokens 0": (dict(max_tokens=np.array([[0]], dtype=np.int32)), "max_tokens must be >= 1"),
    "max_tokens negative": (dict(max_tokens=np.array([[-5]], dtype=np.int32)), "max_tokens must be >= 1"),
    "max_tokens over the limit": (dict(max_tokens=np.array([[MAX_SEQ_LEN]], dtype=np.int32)), "max_seq_len"),
    "prompt over max_input_len": (
        dict(text_input=np.array([[b"fox " * 4 * MAX_INPUT_LEN]], dtype=object)),
        "max_input_len",
    ),
    "wrong dtype": (
        dict(max_tokens=np.array([[4.0]], dtype=np.float32)),
        "data-type is .FP32., but model .ensemble. expects .INT32.",
    ),
    "wrong shape": (dict(text_input=np.array([[b"a", b"b"]], dtype=object)), "shape"),
    "invalid UTF-8": (dict(text_input=np.array([[b"\xff\xfe fox"]], dtype=object)), "not valid UTF-8"),
    "temperature < 0": (dict(temperature=np.array([[-1.0]], dtype=np.float32)), "temperature"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_a_clear_error_and_the_server_keeps_serving(server, engine, case):
    overrides, message = BAD_REQUESTS[case]
    with pytest.raises(TritonRequestError, match=message):
        _raw_ensemble(server, **overrides)
    reply = generate(server.grpc_url, PROMPTS[0], Sampling(max_tokens=MAX_TOKENS))
    assert reply.text == direct(engine, PROMPTS[0]).text


def test_unknown_model_and_http_errors_are_clear(server):
    inputs = text_inputs("The quick brown fox", Sampling(max_tokens=4), stream=False)
    with pytest.raises(TritonRequestError, match="unknown model"):
        infer_grpc(server.grpc_url, "no_such_model", inputs)
    with pytest.raises(TritonRequestError, match="max_tokens must be >= 1"):
        infer_http(server.http_url, ENSEMBLE, {**inputs, "max_tokens": np.array([[0]], dtype=np.int32)}, stream=False)
    with pytest.raises(TritonRequestError, match="unknown model|not found"):
        infer_http(server.http_url, "no_such_model", inputs, stream=True)


def test_two_streaming_clients_at_once(server, engine):
    prompts = PROMPTS[2:4]
    replies: dict[str, object] = {}

    def run(prompt: str) -> None:
        replies[prompt] = generate(server.grpc_url, prompt, Sampling(max_tokens=MAX_TOKENS), stream=True)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt in prompts:
        expected = direct(engine, prompt)
        assert replies[prompt].text == expected.text
        assert replies[prompt].num_output_tokens == len(expected.token_ids)


def test_requests_leave_no_thread_behind(server):
    """A finished gRPC stream is closed, not cancelled: tritonclient's cancel left gRPC's request thread
    waiting for good, one thread a request (8,000 in a soak)."""
    generate(server.grpc_url, PROMPTS[0], Sampling(max_tokens=2))
    before = threading.active_count()
    for _ in range(5):
        generate(server.grpc_url, PROMPTS[0], Sampling(max_tokens=2))
        generate(server.grpc_url, PROMPTS[0], Sampling(max_tokens=2), stream=True)
    assert threading.active_count() == before


def test_many_streams_batch_and_stay_exact(server, engine):
    """More concurrent streams than the engine has batch rows, over gRPC and HTTP: the plain engine
    batches them (responses are sent from several threads at once) and each stream gets its own text."""
    jobs = [(PROMPTS[i % len(PROMPTS)], 24 + 4 * i, "grpc" if i % 2 else "http") for i in range(6)]
    replies: dict[int, object] = {}

    def run(i: int) -> None:
        prompt, n, protocol = jobs[i]
        url = server.grpc_url if protocol == "grpc" else server.http_url
        replies[i] = generate(url, prompt, Sampling(max_tokens=n), stream=True, protocol=protocol)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (prompt, n, _) in enumerate(jobs):
        assert replies[i].text == direct(engine, prompt, n).text, jobs[i]


def test_top_k_1_is_greedy_at_any_temperature(server, engine):
    """Clients (the OpenAI front among them) send greedy as temperature 1 with top_k 1: the same tokens."""
    for prompt in PROMPTS:
        reply = generate(server.grpc_url, prompt, Sampling(max_tokens=MAX_TOKENS, temperature=1.0, top_k=1))
        assert reply.text == direct(engine, prompt).text, prompt


def test_acceptance_counters_on_the_metrics_port(server):
    generate(server.grpc_url, PROMPTS[0], Sampling(max_tokens=MAX_TOKENS))
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    assert "nv_inference_request_success" in text  # Triton's own metrics
    for name in ("specpipe_requests_total", "specpipe_draft_tokens_total", "specpipe_accepted_draft_tokens_total"):
        assert f"{name}{{" in text, name
    generated = [line for line in text.splitlines() if line.startswith("specpipe_generated_tokens_total{")]
    assert generated and float(generated[0].split()[-1]) >= MAX_TOKENS


def test_verifier_reports_no_mismatch_plain(server, tiny_llama_dir):
    results = verify(server.grpc_url, tiny_llama_dir, list(PROMPTS), MAX_TOKENS)
    assert [r.match for r in results] == [True] * len(PROMPTS)
    assert all(r.acceptance_length == 1.0 for r in results)


@contextlib.contextmanager
def _serve_cli(engine_dir: Path, tmp: Path, *repo_options: str):
    """`specpipe triton-repo` + `specpipe serve` as a user runs them; stopped with SIGTERM when the block ends
    (a failing one included, so no server outlives its test), checked clean after a passing one."""
    repo, ports = tmp / "repo", free_ports()
    specpipe = [sys.executable, "-m", "pipeline"]
    subprocess.run(
        [*specpipe, "triton-repo", "--engine", str(engine_dir), "--output", str(repo), *repo_options], check=True
    )
    with open(tmp / "serve.log", "w") as log:
        proc = subprocess.Popen(
            [
                *specpipe,
                "serve",
                "--repo",
                str(repo),
                "--http-port",
                str(ports.http),
                "--grpc-port",
                str(ports.grpc),
                "--metrics-port",
                str(ports.metrics),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        ready = f"http://127.0.0.1:{ports.http}/v2/health/ready"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(ready, timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            proc.kill()
            pytest.fail(f"specpipe serve did not become ready; see {tmp / 'serve.log'}")
        own_regions = f"triton_python_backend_shm_region_specpipe{proc.pid}_*"
        assert list(SHM_DIR.glob(own_regions))
        try:
            yield ports
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        assert code == 0
    assert not list(SHM_DIR.glob(own_regions)), "shared-memory regions left behind"
    with pytest.raises(OSError):
        urllib.request.urlopen(ready, timeout=1)


def _metric_values(text: str, name: str) -> dict[str, float]:
    """Prometheus lines of one metric: {labels: value}."""
    return {
        line[len(name) : line.rindex(" ")]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    }


def test_verifier_reports_no_mismatch_medusa_through_the_cli_server(medusa_engine, tiny_llama_dir, tmp_path):
    """Served by `specpipe serve` with the full tree every step (the adaptive controller would soon stop
    drafting with random heads): exact, drafting unless a request opts out, and the speculative metrics
    (tokens a step, per-depth acceptance, tiers run) on the metrics port."""
    with _serve_cli(medusa_engine, tmp_path, "--speculation", "full") as ports:
        grpc_url = f"127.0.0.1:{ports.grpc}"
        results = verify(grpc_url, tiny_llama_dir, list(PROMPTS[:2]), MAX_TOKENS)
        assert [r.match for r in results] == [True, True]
        reply = generate(grpc_url, PROMPTS[1], Sampling(max_tokens=MAX_TOKENS), stream=True)
        assert reply.total_draft_tokens > 0  # the heads drafted; random heads are rarely right
        opted_out = generate(grpc_url, PROMPTS[1], Sampling(max_tokens=MAX_TOKENS, speculative=False), stream=True)
        assert opted_out.total_draft_tokens == 0 and opted_out.text == reply.text

        def tiers_seen(text: str) -> tuple[bool, bool]:
            """(the opted-out request's plain steps counted, drafting steps counted)."""
            tiers = _metric_values(text, "specpipe_tier_steps_total")
            plain = any('tier="plain"' in labels for labels in tiers)
            return plain, any('tier="plain"' not in labels and value > 0 for labels, value in tiers.items())

        deadline = time.monotonic() + METRICS_WAIT_S  # the model copies the tier counts once a second
        while True:
            text = urllib.request.urlopen(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=10).read().decode()
            if all(tiers_seen(text)) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        requests = sum(_metric_values(text, "specpipe_requests_total").values())
        observed = sum(_metric_values(text, "specpipe_request_tokens_per_step_count").values())
        assert requests == observed >= 4  # one observation a request
        drafted_depth1 = _metric_values(text, "specpipe_depth_drafted_steps_total")
        assert any('depth="1"' in labels and value > 0 for labels, value in drafted_depth1.items())
        assert tiers_seen(text) == (True, True), _metric_values(text, "specpipe_tier_steps_total")
        assert _metric_values(text, "specpipe_current_tier_nodes")


@pytest.mark.slow
def test_verifier_smollm2(smollm2_engine_dir, smollm2_source, tmp_path):
    with _serve(smollm2_engine_dir, tmp_path) as server:
        results = verify(server.grpc_url, smollm2_source, ["What is the capital of France?"], 24)
        assert results[0].match, results[0]


def test_bls_draft_model_loop_is_lossless(tiny_llama_dir, tmp_path):
    """A draft-model engine's repository carries the draft as `tensorrt_llm_draft`; the BLS model then
    speculates as TensorRT-LLM's does (draft proposes, target verifies draft_input_ids) and its text
    equals plain greedy decoding, streamed or not; the ensemble path (in-engine speculation) agrees."""
    draft = make_tiny_model(tmp_path / "draft", seed=5, num_hidden_layers=1)
    engine_dir = convert_and_build(tiny_llama_dir, tmp_path / "build", draft_model=draft, max_draft_len=3, **LIMITS)
    plain = open_engine(convert_and_build(tiny_llama_dir, tmp_path / "plain", **LIMITS))
    with _serve(engine_dir, tmp_path) as server:
        for prompt, n in ((PROMPTS[0], MAX_TOKENS), (PROMPTS[2], 21)):
            expected = direct(plain, prompt, n).text
            for stream in (False, True):
                bls = generate(server.grpc_url, prompt, Sampling(max_tokens=n), stream=stream, model=BLS)
                assert bls.text == expected, (prompt, stream)
            assert generate(server.grpc_url, prompt, Sampling(max_tokens=n)).text == expected
        metrics = urllib.request.urlopen(server.metrics_url).read().decode()
        drafted = [
            line
            for line in metrics.splitlines()
            if line.startswith("nv_inference_request_success{") and 'model="tensorrt_llm_draft"' in line
        ]
        assert drafted and float(drafted[0].split()[-1]) > 0, "the BLS loop never asked the draft model"
