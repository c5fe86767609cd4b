"""Requests to the Triton server over gRPC (streaming API) and HTTP (generate / generate_stream), timed.

Decoupled models answer over gRPC only through the streaming API, so every gRPC request uses it;
`stream=False` asks the model for one response. Timings are client-side: TTFT is the first response
carrying output, inter-token latencies are the gaps between later responses.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

ENSEMBLE, BLS, ENGINE_MODEL = "ensemble", "tensorrt_llm_bls", "tensorrt_llm"
TEXT_MODELS = (ENSEMBLE, BLS)
REQUEST_TIMEOUT_S = 600.0
NUMPY_TO_TRITON = {
    np.dtype(np.int32): "INT32",
    np.dtype(np.float32): "FP32",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.int64): "INT64",
    np.dtype(np.object_): "BYTES",
}
PERF_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "kv_cache_alloc_total_blocks")
COUNT_OUTPUTS = ("num_input_tokens", "num_output_tokens")


class TritonRequestError(RuntimeError):
    """The server refused or failed a request; the message is Triton's."""


@dataclass
class Reply:
    text: str = ""
    output_ids: list[int] = field(default_factory=list)  # only from the engine model (tensorrt_llm)
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    responses: int = 0
    ttft_s: float = 0.0
    inter_token_latencies_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0
    kv_cache_alloc_total_blocks: int = 0  # the engine's KV cache blocks the request held

    @property
    def acceptance_length(self) -> float:
        """Tokens per target step: every step emits its accepted drafts plus one token of its own."""
        steps = self.num_output_tokens - self.total_accepted_draft_tokens
        return self.num_output_tokens / steps if steps > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "acceptance_length": self.acceptance_length}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 64
    temperature: float | None = None  # None: leave the input unset (the model's default)
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    end_id: int | None = None
    stop_words: tuple[str, ...] = ()
    speculative: bool | None = None  # False: the engine serves this request without drafting


def text_inputs(prompt: str | bytes, sampling: Sampling, stream: bool) -> dict[str, np.ndarray]:
    """Inputs of the ensemble / BLS model for one prompt, batch dimension first."""
    text = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")
    inputs = {
        "text_input": np.array([[text]], dtype=np.object_),
        "max_tokens": np.array([[sampling.max_tokens]], dtype=np.int32),
        "stream": np.array([[stream]], dtype=np.bool_),
        "exclude_input_in_output": np.array([[True]], dtype=np.bool_),
        "return_perf_metrics": np.array([[True]], dtype=np.bool_),
        "return_num_input_tokens": np.array([[True]], dtype=np.bool_),
        "return_num_output_tokens": np.array([[True]], dtype=np.bool_),
    }
    if sampling.stop_words:
        inputs["stop_words"] = np.array([[w.encode("utf-8") for w in sampling.stop_words]], dtype=np.object_)
    _add_sampling(inputs, sampling, {"top_k": "top_k", "top_p": "top_p"})
    return inputs


def engine_inputs(input_ids: list[int], sampling: Sampling, stream: bool) -> dict[str, np.ndarray]:
    """Inputs of the engine model (tensorrt_llm) for one tokenized prompt: exact token ids come back."""
    inputs = {
        "input_ids": np.array([input_ids], dtype=np.int32),
        "input_lengths": np.array([[len(input_ids)]], dtype=np.int32),
        "request_output_len": np.array([[sampling.max_tokens]], dtype=np.int32),
        "streaming": np.array([[stream]], dtype=np.bool_),
        "exclude_input_in_output": np.array([[True]], dtype=np.bool_),
        "return_perf_metrics": np.array([[True]], dtype=np.bool_),
        "return_num_input_tokens": np.array([[True]], dtype=np.bool_),
        "return_num_output_tokens": np.array([[True]], dtype=np.bool_),
    }
    _add_sampling(inputs, sampling, {"top_k": "runtime_top_k", "top_p": "runtime_top_p"})
    return inputs


def _add_sampling(inputs: dict[str, np.ndarray], s: Sampling, names: dict[str, str]) -> None:
    for name, value, dtype in (
        ("temperature", s.temperature, np.float32),
        (names["top_k"], s.top_k, np.int32),
        (names["top_p"], s.top_p, np.float32),
        ("seed", s.seed, np.uint64),
        ("end_id", s.end_id, np.int32),
        ("speculative", s.speculative, np.bool_),
    ):
        if value is not None:
            inputs[name] = np.array([[value]], dtype=dtype)


def _grpc_input(name: str, value: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), NUMPY_TO_TRITON[value.dtype])
    tensor.set_data_from_numpy(value)
    return tensor


class _Accumulator:
    """Folds the responses of one request into a Reply, timing each response as it arrives."""

    def __init__(self) -> None:
        self.reply = Reply()
        self.start = time.perf_counter()
        self.last: float | None = None
        self.chunks: list[str] = []

    def add(self, outputs: dict[str, Any]) -> None:
        now = time.perf_counter()
        has_output = False
        if outputs.get("text_output") is not None:
            text = outputs["text_output"]
            self.chunks.append(text)
            has_output = bool(text)
        if outputs.get("output_ids") is not None:
            ids = [int(x) for x in np.asarray(outputs["output_ids"]).reshape(-1)]
            self.reply.output_ids.extend(ids)
            has_output = has_output or bool(ids)
        for name in PERF_OUTPUTS + COUNT_OUTPUTS:
            if outputs.get(name) is not None:
                value = np.asarray(outputs[name]).reshape(-1)[0].item()
                setattr(self.reply, name, value)
        if has_output:
            if self.last is None:
                self.reply.ttft_s = now - self.start
            else:
                self.reply.inter_token_latencies_s.append(now - self.last)
            self.last = now
        self.reply.responses += 1

    def finish(self) -> Reply:
        self.reply.total_s = time.perf_counter() - self.start
        self.reply.text = "".join(self.chunks)
        return self.reply


def _grpc_outputs(result: grpcclient.InferResult) -> dict[str, Any]:
    outputs = {}
    for out in result.get_response().outputs:
        value = result.as_numpy(out.name)
        if out.name == "text_output":
            value = b"".join(np.asarray(value).reshape(-1)).decode("utf-8")
        outputs[out.name] = value
    return outputs


def infer_grpc(url: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float | None = None) -> Reply:
    """One request over gRPC's streaming API; returns when the final response arrives (a wait for a response
    longer than timeout_s, default REQUEST_TIMEOUT_S, is an error)."""
    timeout_s = REQUEST_TIMEOUT_S if timeout_s is None else timeout_s
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    finished = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        acc = _Accumulator()
        client.async_stream_infer(
            model, [_grpc_input(k, v) for k, v in inputs.items()], enable_empty_final_response=True
        )
        while True:
            try:
                result, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise TritonRequestError(f"{model}: no response within {timeout_s:.0f} s") from None
            if error is not None:
                raise TritonRequestError(error.message() if isinstance(error, InferenceServerException) else str(error))
            acc.add(_grpc_outputs(result))
            if result.get_response().parameters["triton_final_response"].bool_param:
                finished = True
                return acc.finish()
    finally:
        close_stream(client, cancel=not finished)


def close_stream(client: grpcclient.InferenceServerClient, cancel: bool) -> None:
    """End a gRPC stream and its client; `cancel`: its requests too. tritonclient's cancel (2.51) does not
    end the stream's request queue, so gRPC's thread feeding requests from it would wait there for good, a
    thread a cancelled stream (in the OpenAI front, one a client that went away): the queue is ended here."""
    stream = getattr(client, "_stream", None)
    client.stop_stream(cancel_requests=cancel)
    if cancel and stream is not None:
        stream._request_queue.put(None)  # the end of the requests: gRPC's feeding thread returns
    client.close()


def _json_inputs(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    body = {}
    for name, value in inputs.items():
        flat = value.reshape(-1).tolist()
        flat = [v.decode("utf-8") if isinstance(v, bytes) else v for v in flat]
        body[name] = flat[0] if len(flat) == 1 and name not in ("stop_words", "bad_words") else flat
    return body


def _sse_events(reply: requests.Response) -> Iterable[dict[str, Any]]:
    for line in reply.iter_lines(decode_unicode=True):
        # requests decodes every line: a text/event-stream reply always has an encoding (ISO-8859-1 at least)
        assert isinstance(line, str)
        if line and line.startswith("data:"):
            yield json.loads(line[len("data:") :])


def infer_http(
    url: str, model: str, inputs: dict[str, np.ndarray], stream: bool, timeout_s: float | None = None
) -> Reply:
    """One request through Triton's generate extension (`generate`, or `generate_stream` as SSE)."""
    timeout_s = REQUEST_TIMEOUT_S if timeout_s is None else timeout_s
    endpoint = f"http://{url}/v2/models/{model}/{'generate_stream' if stream else 'generate'}"
    acc = _Accumulator()
    with requests.post(endpoint, json=_json_inputs(inputs), stream=stream, timeout=timeout_s) as reply:
        if reply.status_code != 200:
            raise TritonRequestError(reply.json().get("error", reply.text) if reply.content else reply.reason)
        for event in _sse_events(reply) if stream else [reply.json()]:
            if "error" in event:
                raise TritonRequestError(event["error"])
            acc.add(event)
    return acc.finish()


def generate(
    url: str,
    prompt: str | bytes,
    sampling: Sampling = Sampling(),
    *,
    stream: bool = False,
    protocol: str = "grpc",
    model: str = ENSEMBLE,
) -> Reply:
    """Text in, text out through the ensemble or the BLS model."""
    inputs = text_inputs(prompt, sampling, stream)
    if protocol == "grpc":
        return infer_grpc(url, model, inputs)
    if protocol == "http":
        return infer_http(url, model, inputs, stream)
    raise ValueError(f"protocol {protocol!r}: expected grpc or http")


def generate_ids(url: str, input_ids: list[int], sampling: Sampling = Sampling(), *, stream: bool = False) -> Reply:
    """Token ids in, token ids out through the engine model over gRPC (exact, no detokenization)."""
    return infer_grpc(url, ENGINE_MODEL, engine_inputs(input_ids, sampling, stream))
