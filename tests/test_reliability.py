"""The real tritonserver under hostile and careless clients: oversized bodies, bad inputs, cancelled streams,
a killed engine process. Each test ends by checking that the server still serves a normal request.

One server for the module (a tiny random engine); the stub-kill test runs last since it reloads a model.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import convert_and_build
from pipeline.client.client import ENSEMBLE, Sampling, TritonRequestError, generate, infer_grpc, text_inputs
from pipeline.triton.repo import write_repository
from pipeline.triton.server import SHM_DIR, TritonServer, free_ports

MAX_INPUT_LEN, MAX_SEQ_LEN = 48, 160
LIMITS = {"max_input_len": MAX_INPUT_LEN, "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 4}
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
    repo = write_repository(convert_and_build(tiny_llama_dir, root / "build", **LIMITS), root / "repo")
    with open(root / "tritonserver.log", "w") as log, TritonServer(repo, free_ports(), log=log) as server:
        yield server
    assert not list(SHM_DIR.glob(f"{server.shm_prefix}*")), "shared-memory regions left behind"


def _serves_normally(server) -> None:
    reply = generate(server.grpc_url, PROMPT, Sampling(max_tokens=MAX_TOKENS))
    assert reply.num_output_tokens > 0


def _big_text(size: int) -> str:
    return "hello " * (size // len("hello "))


@pytest.mark.parametrize("content_type", [FORM, JSON])
def test_oversized_http_bodies_are_refused_and_the_server_keeps_serving(server, content_type):
    for size in BIG_BODIES_BYTES:
        body = json.dumps({"text_input": _big_text(size), "max_tokens": MAX_TOKENS}).encode()
        start = time.monotonic()
        reply = requests.post(f"http://{server.http_url}/v2/models/{ENSEMBLE}/generate", data=body,
                              headers={"Content-Type": content_type}, timeout=60)
        assert time.monotonic() - start < REFUSAL_S
        assert reply.status_code == 400, reply.text[:300]
        assert "text_input has" in reply.json()["error"] and "max_input_len" in reply.json()["error"]
        assert server.process.poll() is None, "tritonserver died"
    _serves_normally(server)


def test_oversized_grpc_prompts_are_refused_and_the_server_keeps_serving(server):
    for size in BIG_BODIES_BYTES:
        inputs = text_inputs(_big_text(size), Sampling(max_tokens=MAX_TOKENS), stream=False)
        start = time.monotonic()
        with pytest.raises(TritonRequestError, match="text_input has .* bytes, over the"):
            infer_grpc(server.grpc_url, ENSEMBLE, inputs)
        assert time.monotonic() - start < REFUSAL_S
    _serves_normally(server)
