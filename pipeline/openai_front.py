"""OpenAI-compatible HTTP front (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) over Triton gRPC.

Each request becomes one gRPC stream to the `tensorrt_llm_bls` model (the same chain as the ensemble; in
Triton 2.51 only a BLS request passes a client's cancel on to the engine); streamed Triton responses become
server-sent-event chunks. A client closing its connection, streaming or waiting for a whole answer, cancels
the gRPC stream. The speculative metrics of the last response are returned as an extra `spec` field so a
benchmark reads acceptance without a side channel.

Client mistakes are answered 400 (404 for an unknown model) in OpenAI's error format before anything
reaches Triton where the front can tell (sampling values, `n`, `stream`, a prompt over the byte limit
the preprocessing model applies); Triton's refusals are 400 too, a full engine queue 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from pipeline.client.client import close_stream
from pipeline.errors import UserError

BACKEND_MODEL = "tensorrt_llm_bls"
PREPROCESSING_MODEL = "preprocessing"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
INT32_MAX = 2**31 - 1  # max_tokens travels as an INT32 input
RETRY_AFTER_S = 1  # the Retry-After of a 503 when the engine's queue is full
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still connected
# Phrases of the model files' errors that are not the client's fault (pipeline/triton/models/*.py, Triton):
# gRPC streams carry an error's message but not its code.
BUSY_MARKERS = ("busy, retry later", "shutting down")
SERVER_FAULT_MARKERS = ("internal error", "is not healthy")
GREEDY_TOP_K = 1
FINAL_FLAG = "triton_final_response"
SPEC_OUTPUTS = ("total_accepted_draft_tokens", "total_draft_tokens", "acceptance_rate")
COUNT_OUTPUTS = ("num_input_tokens", "num_output_tokens")
SCALAR_OUTPUTS = SPEC_OUTPUTS + COUNT_OUTPUTS


class RequestError(Exception):
    """A malformed OpenAI request: answered with HTTP 400."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    speculative: bool = True  # the extra field `speculative`: false serves the request without drafting


@dataclass(frozen=True)
class TritonDelta:
    text: str
    final: bool
    outputs: dict[str, float]  # scalar extra outputs (perf metrics) of this response


def parse_sampling(body: dict[str, Any]) -> Sampling:
    def number(name: str, default: float, kind: type) -> Any:
        value = body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"'{name}' must be a finite number, got {value!r}")
        return kind(value)

    max_tokens = number("max_tokens", DEFAULT_MAX_TOKENS, int)
    if not 1 <= max_tokens <= INT32_MAX:
        raise RequestError(f"'max_tokens' must be between 1 and {INT32_MAX}, got {max_tokens}")
    temperature, top_p = number("temperature", 1.0, float), number("top_p", 1.0, float)
    if temperature < 0:
        raise RequestError(f"'temperature' must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p}")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n!r}")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise RequestError(f"'stream' must be true or false, got {body['stream']!r}")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a non-empty string or a list of them")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"'seed' must be an integer, got {seed!r}")
    speculative = body.get("speculative", True)
    if not isinstance(speculative, bool):
        raise RequestError(f"'speculative' must be true or false, got {speculative!r}")
    return Sampling(max_tokens, temperature, top_p, stop, seed, speculative)


def stream_options(body: dict[str, Any]) -> dict[str, Any]:
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError(f"'stream_options' must be an object, got {opts!r}")
    return opts


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TritonEnsemble:
    """Streams one generation from a Triton text model (ensemble or BLS), sending only the inputs it declares."""

    def __init__(self, url: str, model: str = BACKEND_MODEL):
        self.url = url
        self.model = model
        client = grpcclient.InferenceServerClient(url)
        try:
            meta = client.get_model_metadata(model, as_json=True)
            config = client.get_model_config(model, as_json=True)["config"]
            pre = client.get_model_config(PREPROCESSING_MODEL, as_json=True)["config"]
        finally:
            client.close()
        self.inputs = {i["name"]: i for i in meta["inputs"]}
        self.outputs = {o["name"] for o in meta["outputs"]}
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        self.max_input_len = int(pre["parameters"]["max_input_len"]["string_value"])

    def _tensor(self, name: str, values: list[Any]) -> grpcclient.InferInput:
        meta = self.inputs[name]
        arr = np.array(values, dtype=triton_to_np_dtype(meta["datatype"]))
        arr = arr.reshape(1, -1) if len(meta["shape"]) > 1 else arr.reshape(-1)
        tensor = grpcclient.InferInput(name, list(arr.shape), meta["datatype"])
        tensor.set_data_from_numpy(arr)
        return tensor

    def request_inputs(self, prompt: str, s: Sampling, end_id: int | None) -> list[grpcclient.InferInput]:
        greedy = s.temperature == 0.0
        wanted: dict[str, list[Any]] = {
            "text_input": [prompt.encode()],
            "max_tokens": [s.max_tokens],
            "stream": [self.decoupled],
            "exclude_input_in_output": [True],
            "return_perf_metrics": [True],
            "return_num_input_tokens": [True],
            "return_num_output_tokens": [True],
            # Greedy as top_k=1 at temperature 1: a zero temperature divides logits by zero in some backends.
            "temperature": [1.0 if greedy else s.temperature],
            "top_k": [GREEDY_TOP_K if greedy else 0],
            "top_p": [1.0 if greedy else s.top_p],
        }
        if s.stop:
            wanted["stop_words"] = [x.encode() for x in s.stop]
        if s.seed is not None:
            wanted["seed"] = [s.seed]
        if end_id is not None:
            wanted["end_id"] = [end_id]
        if not s.speculative:
            wanted["speculative"] = [False]
        return [self._tensor(k, v) for k, v in wanted.items() if k in self.inputs]

    async def generate(self, prompt: str, s: Sampling, end_id: int | None) -> AsyncIterator[TritonDelta]:
        """Yield text deltas; the sync gRPC stream runs on its own thread and feeds an asyncio queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[Any, Any]] = asyncio.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: loop.call_soon_threadsafe(queue.put_nowait, (result, error)))
        wanted_outputs = [
            grpcclient.InferRequestedOutput(n) for n in ("text_output", *SCALAR_OUTPUTS) if n in self.outputs
        ]
        finished = False  # the final response came: the stream is closed, not cancelled (close_stream)
        try:
            client.async_stream_infer(
                self.model,
                self.request_inputs(prompt, s, end_id),
                outputs=wanted_outputs,
                request_id=uuid.uuid4().hex,
                enable_empty_final_response=self.decoupled,
            )
            while not finished:
                result, error = await queue.get()
                if error is not None:
                    raise error
                delta = _delta(result)
                finished = delta.final or not self.decoupled
                yield delta
        finally:
            # stop_stream joins the stream thread; keep it off the event loop.
            threading.Thread(target=close_stream, args=(client, not finished), daemon=True).start()


def _delta(result: Any) -> TritonDelta:
    response = result.get_response()
    final = response.parameters[FINAL_FLAG].bool_param if FINAL_FLAG in response.parameters else False
    names = {o.name for o in response.outputs}
    text = ""
    if "text_output" in names:
        text = "".join(
            x.decode() if isinstance(x, bytes) else str(x) for x in result.as_numpy("text_output").reshape(-1)
        )
    extra = {n: float(result.as_numpy(n).reshape(-1)[0]) for n in SCALAR_OUTPUTS if n in names}
    return TritonDelta(text, final, extra)


def spec_field(completion_tokens: int, outputs: dict[str, float]) -> dict[str, Any] | None:
    """Acceptance of the request: tokens per target forward pass = tokens / (tokens - accepted drafts)."""
    if "total_accepted_draft_tokens" not in outputs:
        return None
    accepted = int(outputs["total_accepted_draft_tokens"])
    passes = completion_tokens - accepted
    return {
        "accepted_draft_tokens": accepted,
        "draft_tokens": int(outputs.get("total_draft_tokens", 0)),
        "acceptance_rate": outputs.get("acceptance_rate"),
        "acceptance_length": completion_tokens / passes if passes > 0 else None,
    }


ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 503: "server_overloaded"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": None, "code": status}
    }


def error_response(status: int, message: str) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def triton_status(message: str) -> int:
    """The HTTP status of a Triton error: 503 for a full queue or a stopping server, 500 for a fault of the
    server, 400 for the rest (the models' refusals of a request: limits, values, missing inputs)."""
    if any(m in message for m in BUSY_MARKERS):
        return 503
    if any(m in message for m in SERVER_FAULT_MARKERS):
        return 500
    return 400


def triton_error(exc: InferenceServerException) -> JSONResponse:
    return error_response(triton_status(exc.message()), f"Triton: {exc.message()}")


class OpenAIFront:
    """Turns OpenAI requests into ensemble streams; `chat` selects the chat-completions shapes."""

    def __init__(self, backend: TritonEnsemble, tokenizer: Any, model_name: str):
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        # The preprocessing model's byte limit: more bytes than max_input_len tokens can cover.
        self.max_prompt_bytes = backend.max_input_len * max(len(t.encode("utf-8")) for t in tokenizer.get_vocab())

    def check_prompt_bytes(self, text: str) -> None:
        size = len(text.encode("utf-8"))
        if size > self.max_prompt_bytes:
            raise RequestError(
                f"the prompt has {size} bytes, over the {self.max_prompt_bytes} that "
                f"{self.backend.max_input_len} tokens (the engine's max_input_len) can hold"
            )

    def count_tokens(self, text: str, special: bool) -> int:
        return len(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def prompt_of(self, body: dict[str, Any], chat: bool) -> str:
        if chat:
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) and "content" in m for m in messages)
            ):
                raise RequestError("'messages' must be a non-empty list of {role, content} objects")
            self.check_prompt_bytes("".join(str(m["content"]) for m in messages))
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string (one prompt per request)")
        self.check_prompt_bytes(prompt)
        return prompt

    async def run(
        self, body: dict[str, Any], chat: bool, running_usage: bool = False
    ) -> AsyncGenerator[tuple[str, str | None, dict[str, Any]], None]:
        """Yield (text delta, finish_reason or None, extras): the last item carries `usage` and `spec`,
        every item `usage` when `running_usage`. Counts are the engine's own (`num_output_tokens`, on every
        streamed response); without them the text so far is re-tokenized (quadratic in the reply, hence
        only on request)."""
        s = parse_sampling(body)
        prompt = self.prompt_of(body, chat)
        prompt_tokens = self.count_tokens(prompt, special=True)

        def usage(text: str, engine_count: float | None = None) -> dict[str, int]:
            n = int(engine_count) if engine_count is not None else self.count_tokens(text, special=False)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

        stopper = StopMatcher(s.stop)
        text, outputs = "", {}
        async for delta in self.backend.generate(prompt, s, self.tokenizer.eos_token_id):
            outputs.update(delta.outputs)
            piece = stopper.feed(delta.text)
            text += piece
            if piece:
                count = delta.outputs.get("num_output_tokens")
                yield piece, None, ({"usage": usage(text, count)} if running_usage else {})
            if stopper.stopped:
                break
        tail = "" if stopper.stopped else stopper.flush()
        text += tail
        final = usage(text)
        if "num_output_tokens" in outputs and not stopper.stopped:
            prompt_n = int(outputs.get("num_input_tokens", prompt_tokens))
            n = int(outputs["num_output_tokens"])
            final = {"prompt_tokens": prompt_n, "completion_tokens": n, "total_tokens": prompt_n + n}
        n = final["completion_tokens"]
        finish = "length" if n >= s.max_tokens and not stopper.stopped else "stop"
        yield tail, finish, {"usage": final, "spec": spec_field(n, outputs)}


def _choice(chat: bool, text: str, finish: str | None, stream: bool) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    key = "delta" if stream else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}


def create_app(front: OpenAIFront) -> FastAPI:
    app = FastAPI(title="specpipe OpenAI-compatible front")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": front.model_name, "object": "model", "owned_by": "specpipe"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        if body.get("model") not in (None, front.model_name):
            return JSONResponse(
                error_body(
                    404,
                    f"model {body['model']!r} does not exist; this server serves {front.model_name!r} (GET /v1/models)",
                ),
                status_code=404,
            )
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": front.model_name,
        }
        try:
            opts = stream_options(body)
        except RequestError as exc:
            return error_response(400, str(exc))
        events = front.run(body, chat, running_usage=bool(opts.get("continuous_usage_stats")))
        try:
            first = await events.__anext__()  # surfaces request and Triton errors before any bytes are sent
        except RequestError as exc:
            return error_response(400, str(exc))
        except InferenceServerException as exc:
            return triton_error(exc)
        if body.get("stream"):
            return StreamingResponse(_sse(head, chat, first, events, opts), media_type="text/event-stream")
        try:
            items = await _unless_disconnected(request, _collect(first, events))
        except InferenceServerException as exc:
            return triton_error(exc)
        if items is None:  # the client left; the gRPC stream was cancelled
            return error_response(499, "client closed the connection")
        text = "".join(piece for piece, _, _ in items)
        _, finish, extras = items[-1]
        extras = {"usage": extras["usage"], "spec": extras.get("spec")}
        obj = "chat.completion" if chat else "text_completion"
        return {**head, "object": obj, "choices": [_choice(chat, text, finish, stream=False)], **extras}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


async def _collect(first: tuple, events: AsyncIterator[tuple]) -> list[tuple]:
    return [first] + [item async for item in events]


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`, or cancel it (which cancels its gRPC stream, so the engine stops) and return None once
    the client has closed the connection; checked every DISCONNECT_POLL_S."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


async def _sse(
    head: dict[str, Any], chat: bool, first: tuple, events: AsyncGenerator[tuple, None], opts: dict[str, Any]
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per text delta, `spec` on the finishing chunk, optional usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    every_usage = bool(opts.get("continuous_usage_stats"))

    def chunk(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps({**head, 'object': obj, **payload})}\n\n"

    try:
        item = first
        while True:
            text, finish, extras = item
            payload: dict[str, Any] = {"choices": [_choice(chat, text, finish, stream=True)]}
            if finish is not None:
                payload["spec"] = extras["spec"]
                if every_usage:
                    payload["usage"] = extras["usage"]
            elif every_usage:
                payload["usage"] = extras["usage"]
            yield chunk(payload)
            if finish is not None:
                break
            item = await events.__anext__()
        if opts.get("include_usage"):
            yield chunk({"choices": [], "usage": extras["usage"]})
    except InferenceServerException as exc:
        yield f"data: {json.dumps(error_body(triton_status(exc.message()), f'Triton: {exc.message()}'))}\n\n"
    finally:
        await events.aclose()  # on a closed connection too: cancels the gRPC stream, so the engine stops
    yield "data: [DONE]\n\n"


def load_tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

    if not (Path(tokenizer_dir) / "tokenizer_config.json").is_file():
        raise UserError(f"{tokenizer_dir}: no tokenizer_config.json; pass the engine's tokenizer/ folder")
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def connect(triton_grpc_url: str, model: str = BACKEND_MODEL) -> TritonEnsemble:
    try:
        return TritonEnsemble(triton_grpc_url, model)
    except InferenceServerException as exc:
        raise UserError(
            f"Triton at {triton_grpc_url}: cannot read model {model!r} ({exc.message()}); "
            "start the server first and check the gRPC port"
        ) from None


def build_app(triton_grpc_url: str, model_name: str, tokenizer_dir: Path) -> FastAPI:
    return create_app(OpenAIFront(connect(triton_grpc_url), load_tokenizer(tokenizer_dir), model_name))


def serve(triton_grpc_url: str, host: str, port: int, model_name: str, tokenizer_dir: Path) -> None:
    """Serve the OpenAI API on host:port until interrupted (blocking)."""
    uvicorn.run(build_app(triton_grpc_url, model_name, tokenizer_dir), host=host, port=port, log_level="warning")
