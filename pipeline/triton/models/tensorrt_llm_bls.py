"""Triton Python model `tensorrt_llm_bls`: preprocessing -> tensorrt_llm -> postprocessing as BLS calls.

Decoupled: each request runs in a worker thread; the engine model is called as a decoupled BLS
request, and each of its responses is detokenized and forwarded (streaming) or the single response
is forwarded with the final flag (non-streaming). Self-contained so it also runs in the NGC container.

Cancellation: Triton 2.51 neither passes a client's cancel on to a BLS request already running nor lets a
BLS cancel one, so while the engine model runs, a watcher polls this request's cancel flag and, once it is
set, answers the client CANCELLED and sends the engine model a stop request (`stop` true, the running
request's id), as TensorRT-LLM's backend takes them; the engine then ends the request at its next step.
"""

import json
import os
import sys
import threading
import time
import traceback
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.triton.send import send
from pipeline.triton.tensors import ENGINE_INPUT_OF, PREPROCESSING_INPUT_OF

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PREPROCESSING, POSTPROCESSING = "preprocessing", "postprocessing"
# preprocessing output -> engine input
ENGINE_INPUT_FROM_PREPROCESSING = {
    "INPUT_ID": "input_ids",
    "REQUEST_INPUT_LEN": "input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len",
    "OUT_END_ID": "end_id",
    "OUT_PAD_ID": "pad_id",
    "STOP_WORDS_IDS": "stop_words_list",
    "BAD_WORDS_IDS": "bad_words_list",
}
PASSTHROUGH_OUTPUTS = (
    "cum_log_probs",
    "output_log_probs",
    "context_logits",
    "generation_logits",
    "batch_index",
    "sequence_index",
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
    "num_input_tokens",
    "num_output_tokens",
)

DEFAULT_NUM_DRAFT_TOKENS = 4  # draft-model speculation when the request sends no num_draft_tokens
FINALIZE_DEADLINE_S = 3.0  # how long unloading waits for running requests
CANCEL_POLL_S = 0.1  # how often a running request's cancel flag is read (one message to the server each)
# Request parameters Triton's front ends set themselves; any other parameter is an input name the model
# does not have (the HTTP generate endpoint turns unknown JSON fields into parameters).
FRONTEND_PARAMETER_PREFIX = "triton_"

# The launcher raises the server's stack limit (pipeline/triton/server.py: its HTTP parser's stack use), which
# the stub inherits; request threads need no more than Python's usual stack.
WORKER_STACK_BYTES = 8 * 1024 * 1024


class BlsError(Exception):
    """A composing model answered with an error; its message and code go back to the client."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = pb_utils.TritonError.INTERNAL if code is None else code


def _raise_error(response):
    error = response.error()
    code = error.code() if hasattr(error, "code") else None
    raise BlsError(error.message(), code)


def unknown_inputs(request):
    """Names the client sent that are neither inputs nor front-end parameters."""
    params = json.loads(request.parameters() or "{}")
    return sorted(name for name in params if not name.startswith(FRONTEND_PARAMETER_PREFIX))


class Reply:
    """One request's response sender, shared by its worker and its cancel watcher: closed by the first
    final response, after which neither sends nor reads the request (Triton has released it)."""

    def __init__(self, request):
        self.request = request
        self.sender = request.get_response_sender()
        self.lock = threading.Lock()
        self.closed = False

    def send(self, response=None, flags=0):
        with self.lock:
            if self.closed:
                return
            send(self.sender, response, flags)
            self.closed = bool(flags & FINAL)

    def cancel_if_asked(self):
        """Answer CANCELLED if the client cancelled and nothing final was sent; True if it did."""
        with self.lock:
            if self.closed or not self.request.is_cancelled():
                return False
            error = pb_utils.TritonError("tensorrt_llm_bls: cancelled", pb_utils.TritonError.CANCELLED)
            send(self.sender, pb_utils.InferenceResponse(error=error), flags=FINAL)
            self.closed = True
            return True


class CancelWatcher:
    """While the engine model runs one request for this BLS request, stop it once the client cancels."""

    def __init__(self, reply, engine_model):
        self.reply = reply
        self.engine_model = engine_model
        self.inner_id = uuid.uuid4().hex
        self.done = threading.Event()
        self.cancelled = False
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.finish()

    def finish(self):
        self.done.set()
        self.thread.join()

    def _watch(self):
        # The watcher answers the client; the engine model ends the stopped request with an empty final
        # (Triton 2.51 would drop an error on its way here, leaving the worker waiting for it).
        while not self.done.wait(CANCEL_POLL_S):
            if self.reply.closed:
                return
            if self.reply.cancel_if_asked():
                self.cancelled = True
                self._send_stop()
                return

    def _send_stop(self):
        one = np.array([[1]], dtype=np.int32)
        inputs = [
            pb_utils.Tensor("input_lengths", one),
            pb_utils.Tensor("request_output_len", one),
            pb_utils.Tensor("stop", np.array([[True]])),
        ]
        stop = pb_utils.InferenceRequest(
            model_name=self.engine_model, request_id=self.inner_id, inputs=inputs, requested_output_names=["output_ids"]
        )
        for _ in stop.exec(decoupled=True):
            pass  # one empty final response


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _exec(request):
    response = request.exec()
    if response.has_error():
        _raise_error(response)
    return response


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.engine_model = params["tensorrt_llm_model_name"]
        self.draft_model = params["tensorrt_llm_draft_model_name"]
        self.accumulate = params["accumulate_tokens"].lower() in ("true", "1")
        self.num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS
        threading.stack_size(WORKER_STACK_BYTES)
        self.workers = set()
        self.workers_lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            worker = threading.Thread(target=self._serve, args=(request,), daemon=True)
            with self.workers_lock:
                self.workers.add(worker)
            worker.start()
        return None

    def finalize(self):
        """Wait up to FINALIZE_DEADLINE_S for running requests (the engine model ends them on its own unload),
        then leave the process at once: the interpreter's teardown takes seconds, which pushed tritonserver
        past its exit timeout."""
        deadline = time.monotonic() + FINALIZE_DEADLINE_S
        with self.workers_lock:
            workers = list(self.workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _serve(self, request):
        reply = Reply(request)
        try:
            unknown = unknown_inputs(request)
            if unknown:
                raise BlsError(
                    f"tensorrt_llm_bls: unknown input(s) {', '.join(map(repr, unknown))}; "
                    "see the model's inputs at /v2/models/tensorrt_llm_bls/config",
                    pb_utils.TritonError.INVALID_ARG,
                )
            self._generate(request, reply)
        except BlsError as exc:
            reply.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), exc.code)), flags=FINAL)
        except Exception as exc:  # a bug must still end the request; the server keeps serving others
            traceback.print_exc()
            reply.send(
                pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"tensorrt_llm_bls: internal error: {type(exc).__name__}: {exc}")
                ),
                flags=FINAL,
            )
        finally:
            with self.workers_lock:
                self.workers.discard(threading.current_thread())

    def _engine_inputs(self, request):
        """{engine input name: array}: the preprocessed prompt plus the client's sampling inputs."""
        pre_inputs = [
            pb_utils.Tensor(inner, value)
            for outer, inner in PREPROCESSING_INPUT_OF.items()
            if (value := _input(request, outer)) is not None
        ]
        pre = _exec(
            pb_utils.InferenceRequest(
                model_name=PREPROCESSING,
                inputs=pre_inputs,
                requested_output_names=list(ENGINE_INPUT_FROM_PREPROCESSING),
            )
        )
        inputs = {
            inner: pb_utils.get_output_tensor_by_name(pre, outer).as_numpy()
            for outer, inner in ENGINE_INPUT_FROM_PREPROCESSING.items()
        }
        inputs.update(
            {inner: value for outer, inner in ENGINE_INPUT_OF.items() if (value := _input(request, outer)) is not None}
        )
        return inputs

    def _engine_request(self, request, request_id):
        inputs = [pb_utils.Tensor(name, value) for name, value in self._engine_inputs(request).items()]
        return pb_utils.InferenceRequest(
            model_name=self.engine_model,
            inputs=inputs,
            request_id=request_id,
            requested_output_names=["output_ids", "sequence_length", *PASSTHROUGH_OUTPUTS],
        )

    def _call(self, model, inputs, ids, max_tokens, drafts=()):
        """New token ids from one non-streaming engine call on the sequence `ids`."""
        call = dict(
            inputs,
            input_ids=np.array([ids], dtype=np.int32),
            input_lengths=np.array([[len(ids)]], dtype=np.int32),
            request_output_len=np.array([[max_tokens]], dtype=np.int32),
            exclude_input_in_output=np.array([[True]]),
            streaming=np.array([[False]]),
        )
        if drafts:
            call["draft_input_ids"] = np.array([drafts], dtype=np.int32)
        request = pb_utils.InferenceRequest(
            model_name=model,
            requested_output_names=["output_ids", "sequence_length"],
            inputs=[pb_utils.Tensor(k, v) for k, v in call.items()],
        )
        new = []
        for response in request.exec(decoupled=True):
            if response.has_error():
                _raise_error(response)
            if (ids_tensor := pb_utils.get_output_tensor_by_name(response, "output_ids")) is not None:
                new.extend(ids_tensor.as_numpy().reshape(-1).tolist())
        return new

    def _speculate(self, request, reply, streaming):
        """Draft-target speculation as TensorRT-LLM's BLS runs it: the draft model proposes up to
        num_draft_tokens, the target verifies them (draft_input_ids) and returns the accepted ones
        plus its own next token; repeat until max_tokens or the end id."""
        inputs = self._engine_inputs(request)
        prompt = inputs.pop("input_ids").reshape(-1)[: int(inputs.pop("input_lengths").reshape(-1)[0])].tolist()
        max_tokens = int(inputs.pop("request_output_len").reshape(-1)[0])
        end_id = int(inputs["end_id"].reshape(-1)[0]) if "end_id" in inputs else None
        num_draft = _input(request, "num_draft_tokens")
        k = int(num_draft.reshape(-1)[0]) if num_draft is not None else self.num_draft_tokens
        out = []
        while len(out) < max_tokens and not (out and out[-1] == end_id):
            if reply.cancel_if_asked():
                return
            remaining = max_tokens - len(out)
            drafts = (
                self._call(self.draft_model, inputs, prompt + out, min(k, remaining - 1))
                if remaining > 1 and k > 0
                else []
            )
            if end_id in drafts:
                drafts = drafts[: drafts.index(end_id) + 1]
            new = self._call(self.engine_model, inputs, prompt + out, len(drafts) + 1, drafts)[:remaining]
            if end_id in new:
                new = new[: new.index(end_id) + 1]
            out += new
            if streaming and new:
                reply.send(pb_utils.InferenceResponse(output_tensors=[self._text(new)]))
        if streaming:
            reply.send(flags=FINAL)
        else:
            reply.send(pb_utils.InferenceResponse(output_tensors=[self._text(out)]), flags=FINAL)

    def _text(self, ids):
        tokens = np.array(ids, dtype=np.int32).reshape(1, 1, -1)
        return pb_utils.Tensor("text_output", self._detokenize(tokens, np.array([[len(ids)]], dtype=np.int32)))

    def _detokenize(self, tokens, lengths):
        post = _exec(
            pb_utils.InferenceRequest(
                model_name=POSTPROCESSING,
                requested_output_names=["OUTPUT"],
                inputs=[pb_utils.Tensor("TOKENS_BATCH", tokens), pb_utils.Tensor("SEQUENCE_LENGTH", lengths)],
            )
        )
        return pb_utils.get_output_tensor_by_name(post, "OUTPUT").as_numpy()

    def _generate(self, request, reply):
        stream_flag = _input(request, "stream")
        streaming = stream_flag is not None and bool(stream_flag.reshape(-1)[0])
        if self.draft_model:
            return self._speculate(request, reply, streaming)
        with CancelWatcher(reply, self.engine_model) as watcher:
            self._forward(request, reply, streaming, watcher)

    def _forward(self, request, reply, streaming, watcher):
        """The engine model's responses, detokenized, to the client, until the watcher sees a cancel."""
        accumulated = None
        for response in self._engine_request(request, watcher.inner_id).exec(decoupled=True):
            if watcher.cancelled:
                return  # the watcher has answered the client and stopped the request in the engine model
            if response.has_error():
                _raise_error(response)
            ids_tensor = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if ids_tensor is None:
                continue  # the empty response that only carries the final flag
            tokens = ids_tensor.as_numpy()
            lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy()
            if self.accumulate and streaming:  # resend the whole text so far, as the reference BLS does
                accumulated = tokens if accumulated is None else np.concatenate([accumulated, tokens], axis=-1)
                tokens = accumulated
                lengths = np.full(tokens.shape[:2], tokens.shape[-1], dtype=np.int32)
            outputs = [pb_utils.Tensor("text_output", self._detokenize(tokens, lengths))]
            outputs += [
                t
                for name in PASSTHROUGH_OUTPUTS
                if (t := pb_utils.get_output_tensor_by_name(response, name)) is not None
            ]
            if streaming:
                reply.send(pb_utils.InferenceResponse(output_tensors=outputs))
            else:
                reply.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL)
                return
        reply.send(flags=FINAL)
