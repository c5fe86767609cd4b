"""Triton Python model `tensorrt_llm` for a portable engine: same tensors as the C++ tensorrtllm backend.

Decoupled: each request runs `Engine.stream` in its own worker thread, so `execute` returns at once
and the server keeps accepting requests. Streaming requests get one response per chunk carrying only
the new tokens; other requests get one response with the whole sequence. Every request ends with the
final flag. A request the engine refuses (`RequestError`) gets an INVALID_ARG error, a full engine queue
(`EngineBusy`) an UNAVAILABLE one; the server keeps serving.

Cancellation: between chunks the worker checks the request's own cancel flag (a client cancelling a
request sent to this model) and a stop request: a request with `stop` true and the `request_id` of one in
flight ends that one, as in TensorRT-LLM's backend; the BLS model sends those, since Triton 2.51 does not
pass a cancel on to composing or BLS requests already running. Either way the engine's stream is closed,
which ends the request in the engine at its next step and frees its cache. A cancelled request ends with a
CANCELLED error; a stopped one with an empty final response, no error: Triton 2.51 drops an error sent to a
BLS request whose own client cancelled, which left the BLS worker waiting for it forever.
"""

import json
import math
import os
import sys
import threading
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.engine.loader import open_engine
from pipeline.engine.runner import RequestError, SamplingParams
from pipeline.engine.sampling import EngineBusy
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.triton.send import send, serialized

# The launcher raises the server's stack limit (pipeline/triton/server.py: its HTTP parser's stack use), which
# the stub inherits; request threads need no more than Python's usual stack.
WORKER_STACK_BYTES = 8 * 1024 * 1024


FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# On unload, requests still running get this long to finish before they end with an UNAVAILABLE error.
FINALIZE_DEADLINE_S = 3.0
REPLACEMENT_CHAR = "\ufffd"  # what a token sequence ending inside a UTF-8 character decodes to
# Inputs the portable engine does not implement, with the value that means "off".
UNSUPPORTED_SCALARS = {
    "beam_width": 1,
    "num_return_sequences": 1,
    "return_log_probs": False,
    "return_context_logits": False,
    "return_generation_logits": False,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
}
UNSUPPORTED_LISTS = ("draft_logits", "embedding_bias")
# (key, metric name, description) of the acceptance counters exported on the metrics port.
COUNTERS = (
    ("requests", "specpipe_requests_total", "Requests completed by the portable engine"),
    ("generated", "specpipe_generated_tokens_total", "Tokens generated"),
    ("steps", "specpipe_decode_steps_total", "Target-model decoding steps (one verification per step)"),
    ("drafted", "specpipe_draft_tokens_total", "Draft tokens proposed to the target model"),
    ("accepted", "specpipe_accepted_draft_tokens_total", "Draft tokens the target model accepted"),
)
# Buckets of the per-request tokens-a-step histogram (1: nothing accepted; a 63-node tree reaches about 5).
TOKENS_PER_STEP_BUCKETS = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0]
METRICS_POLL_S = 1.0  # how often the speculative steps' tier counts are copied to the metrics


class SpecMetrics:
    """The engine's acceptance on the metrics port, next to Triton's nv_* metrics. Per finished request:
    the counters above, its tokens a step (histogram) and per depth the steps that drafted / accepted it.
    Every METRICS_POLL_S: steps run per tier and the current tier's nodes (batched speculative engines)."""

    def __init__(self, labels, controller):
        self.labels = labels
        self.controller = controller
        self.families = {}
        self.metrics = {}
        for key, name, description in COUNTERS:
            self.metrics[key] = self._metric(name, description, "COUNTER")
        self.tokens_per_step = self._metric(
            "specpipe_request_tokens_per_step",
            "Tokens a request emitted per target pass (accepted drafts + 1), one observation per request",
            "HISTOGRAM",
            buckets=TOKENS_PER_STEP_BUCKETS,
        )
        self.tier_steps_seen = {}

    def _metric(self, name, description, kind, labels=None, **kwargs):
        with serialized():  # metric updates go through the responses' shared-memory channel
            family = self.families.get(name)
            if family is None:
                family = pb_utils.MetricFamily(
                    name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind)
                )
                self.families[name] = family
            return family.Metric(labels={**self.labels, **(labels or {})}, **kwargs)

    def _labelled(self, key, name, description, kind, labels):
        metric = self.metrics.get(key)
        if metric is None:
            metric = self.metrics[key] = self._metric(name, description, kind, labels)
        return metric

    def request_done(self, result):
        stats = result.stats
        counts = {
            "requests": 1,
            "generated": len(result.token_ids),
            "steps": stats.steps,
            "drafted": stats.draft_tokens,
            "accepted": stats.accepted_tokens,
        }
        per_depth = []
        for depth, (drafted, accepted) in enumerate(
            zip(stats.drafted_per_depth, stats.accepted_per_depth + [0] * len(stats.drafted_per_depth)), 1
        ):
            per_depth.append((self._depth_metric("drafted", depth), drafted))
            per_depth.append((self._depth_metric("accepted", depth), accepted))
        with serialized():
            for key, value in counts.items():
                self.metrics[key].increment(value)
            for metric, value in per_depth:
                metric.increment(value)
            if stats.steps:
                self.tokens_per_step.observe(stats.acceptance_length)

    def _depth_metric(self, what, depth):
        return self._labelled(
            (what, depth),
            f"specpipe_depth_{what}_steps_total",
            f"Request steps whose draft reached this depth ({what}: and had it accepted)",
            "COUNTER",
            {"depth": str(depth)},
        )

    def poll(self, stopping):
        """Copy the controller's per-tier step counts and current tier until `stopping` is set."""
        tiers = self.controller.tiers
        current = self._metric(
            "specpipe_current_tier_nodes", "Nodes a request's tree had in the last speculative step (1: plain)", "GAUGE"
        )
        while not stopping.wait(METRICS_POLL_S):
            chosen = dict(self.controller.chosen)
            updates = []
            for index, steps in chosen.items():
                new = steps - self.tier_steps_seen.get(index, 0)
                if new:
                    metric = self._labelled(
                        ("tier", index),
                        "specpipe_tier_steps_total",
                        "Speculative steps run in each tier",
                        "COUNTER",
                        {"tier": tiers[index].name},
                    )
                    updates.append((metric, new))
                    self.tier_steps_seen[index] = steps
            with serialized():
                for metric, value in updates:
                    metric.increment(value)
                current.set(tiers[self.controller.current].num_nodes)


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request, name, default):
    value = _input(request, name)
    if value is None or value.size == 0:
        return default
    if value.size != 1:
        raise RequestError(f"input {name!r} must hold one value per request, got shape {list(value.shape)}")
    return value.reshape(-1)[0].item()


def _words_from_ids(tokenizer, words_list):
    """Text of each word in a [2, L] (ids, end offsets) list, the inverse of preprocessing's layout."""
    if words_list is None or words_list.size == 0:
        return ()
    ids, offsets = words_list.reshape(2, -1)
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        words.append(tokenizer.decode(ids[start:end].tolist()))
        start = int(end)
    return tuple(words)


def _error(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tensorrt_llm: {message}", code))


class Stopped(Exception):
    """The request ended before its last token: cancelled by the client, a stop request, or unloading."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code  # None: ended by a stop request, answered with an empty final


def _tensor(name, values, dtype):
    return pb_utils.Tensor(name, np.array(values, dtype=dtype).reshape(1, -1))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        serving = SchedulerConfig.from_options(json.loads(params.get("serving") or "{}"))
        self.engine = open_engine(params["engine_dir"], device=params["device"], serving=serving)
        print(f"specpipe: {args['model_name']} serves {json.dumps(self.engine.capacity)}", flush=True)
        self.exclude_input_default = params["exclude_input_in_output"].lower() in ("true", "1")
        threading.stack_size(WORKER_STACK_BYTES)
        self.workers = set()
        self.workers_lock = threading.Lock()
        self.stopping = threading.Event()  # set on unload: running requests end at their next chunk
        self.stop_events = {}  # request id -> event a stop request sets; guarded by workers_lock
        self.vocab_size = self.engine.target.cfg.vocab_size
        labels = {"model": args["model_name"], "spec_mode": self.engine.spec.mode}
        controller = self.engine.scheduler.controller  # None: no speculative steps
        self.metrics = SpecMetrics(labels, controller)
        if controller is not None:
            threading.Thread(target=self.metrics.poll, args=(self.stopping,), daemon=True).start()

    def execute(self, requests):
        for request in requests:
            worker = threading.Thread(target=self._serve, args=(request, time.time_ns()), daemon=True)
            with self.workers_lock:
                self.workers.add(worker)
            worker.start()
        return None

    def finalize(self):
        """Let running requests finish for FINALIZE_DEADLINE_S, end the rest with an error, then leave the
        process at once: the interpreter's own teardown (torch, transformers) takes seconds, which pushed
        tritonserver past its exit timeout."""
        deadline = time.monotonic() + FINALIZE_DEADLINE_S
        with self.workers_lock:
            workers = list(self.workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        self.stopping.set()
        for worker in workers:
            worker.join()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _serve(self, request, arrival_ns):
        sender = request.get_response_sender()
        try:
            self._generate(request, sender, arrival_ns)
        except RequestError as exc:
            send(sender, _error(exc, pb_utils.TritonError.INVALID_ARG), flags=FINAL)
        except EngineBusy as exc:
            send(sender, _error(f"busy, retry later ({exc})", pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
        except Stopped as exc:
            send(sender, None if exc.code is None else _error(exc, exc.code), flags=FINAL)
        except Exception as exc:  # a bug must still end the request; the server keeps serving others
            traceback.print_exc()
            send(
                sender,
                _error(f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL),
                flags=FINAL,
            )
        finally:
            with self.workers_lock:
                self.workers.discard(threading.current_thread())

    def _stop_other(self, request, sender):
        """A stop request: end the running request with this request's id, answer with an empty final."""
        with self.workers_lock:
            event = self.stop_events.get(request.request_id())
        if event is not None:
            event.set()
        send(sender, flags=FINAL)

    def _check_running(self, request, stop_event):
        if request.is_cancelled():
            raise Stopped("cancelled", pb_utils.TritonError.CANCELLED)
        if stop_event.is_set():
            raise Stopped("stopped by a stop request", None)
        if self.stopping.is_set():
            raise Stopped("the server is shutting down; retry on another or later", pb_utils.TritonError.UNAVAILABLE)

    def _parse(self, request):
        input_ids = _input(request, "input_ids")
        if input_ids is None:
            raise RequestError("input 'input_ids' is missing; send the prompt's token ids")
        if input_ids.ndim == 2 and input_ids.shape[0] != 1:
            raise RequestError(f"batch of {input_ids.shape[0]} in one request; send one prompt per request")
        length = int(_scalar(request, "input_lengths", input_ids.size))
        if not 0 <= length <= input_ids.size:
            raise RequestError(f"input_lengths {length} does not fit input_ids of {input_ids.size} tokens")
        for name, off in UNSUPPORTED_SCALARS.items():
            if _scalar(request, name, off) != off:
                raise RequestError(f"input {name!r} is not supported by the portable engine; leave it unset")
        for name in UNSUPPORTED_LISTS:
            value = _input(request, name)
            if value is not None and value.size:
                raise RequestError(f"input {name!r} is not supported by the portable engine; leave it unset")
        if _words_from_ids(self.engine.tokenizer, _input(request, "bad_words_list")):
            raise RequestError("bad_words are not supported by the portable engine; leave them empty")
        max_tokens = int(_scalar(request, "request_output_len", 0))
        if max_tokens < 1:
            raise RequestError(
                f"max_tokens must be >= 1, got {max_tokens} (a number over 2147483647 does not fit "
                "the INT32 input and wraps around)"
            )
        for name in ("temperature", "runtime_top_p"):
            value = _scalar(request, name, 0.0)
            if not math.isfinite(value):
                raise RequestError(f"{name.replace('runtime_', '')} must be a finite number, got {value}")
        end_id = _scalar(request, "end_id", None)
        if end_id is not None and end_id != -1 and not 0 <= end_id < self.vocab_size:
            raise RequestError(
                f"end_id {end_id} is outside the vocabulary [0, {self.vocab_size}); send a token id, or -1 for none"
            )
        seed = _scalar(request, "seed", None)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_scalar(request, "temperature", 0.0)),
            top_k=int(_scalar(request, "runtime_top_k", 0)),
            top_p=float(_scalar(request, "runtime_top_p", 1.0)),
            seed=None if seed is None else int(seed),
            end_id=end_id,
            stop_words=_words_from_ids(self.engine.tokenizer, _input(request, "stop_words_list")),
            speculative=bool(_scalar(request, "speculative", True)),
        )
        return input_ids.reshape(-1)[:length].tolist(), params

    def _generate(self, request, sender, arrival_ns):
        if _scalar(request, "stop", False):
            return self._stop_other(request, sender)
        prompt, params = self._parse(request)
        streaming = bool(_scalar(request, "streaming", False))
        exclude_input = bool(_scalar(request, "exclude_input_in_output", self.exclude_input_default))
        want_perf = bool(_scalar(request, "return_perf_metrics", False))
        want_counts = (
            bool(_scalar(request, "return_num_input_tokens", False)),
            bool(_scalar(request, "return_num_output_tokens", False)),
        )
        self.engine.validate(prompt, params)
        drafts = _input(request, "draft_input_ids")
        if drafts is not None and drafts.size:
            # A BLS draft loop's verification call: one greedy pass, one response.
            ids = self.engine.verify_external(prompt, drafts.reshape(-1).tolist())[: params.max_tokens]
            send(
                sender,
                pb_utils.InferenceResponse(output_tensors=self._tokens(ids if exclude_input else prompt + ids)),
                flags=FINAL,
            )
            return
        scheduled_ns = None  # the engine runs one request at a time (its KV cache); others wait in stream()
        first_token_ns = None
        pending = []  # streamed tokens held back until they end on a whole UTF-8 character
        sent = 0  # tokens streamed so far
        request_id = request.request_id()
        stop_event = threading.Event()
        if request_id:
            with self.workers_lock:
                self.stop_events[request_id] = stop_event
        stream = self.engine.stream(prompt, params)
        try:
            for chunk in stream:
                scheduled_ns = scheduled_ns or time.time_ns()
                if first_token_ns is None and chunk.token_ids:
                    first_token_ns = time.time_ns()
                self._check_running(request, stop_event)
                pending.extend(chunk.token_ids)
                if streaming and pending and not chunk.finished and self._ends_cleanly(pending):
                    sent += len(pending)
                    outputs = self._tokens(pending)
                    if want_counts[1]:  # the running count: a client's usage per chunk without re-tokenizing
                        outputs.append(_tensor("num_output_tokens", [sent], np.int32))
                    send(sender, pb_utils.InferenceResponse(output_tensors=outputs), on_stuck=stream.close)
                    pending = []
        finally:
            stream.close()  # cancels the request in the engine if it is still running
            if request_id:
                with self.workers_lock:
                    if self.stop_events.get(request_id) is stop_event:
                        del self.stop_events[request_id]
        result = chunk.result
        last_token_ns = time.time_ns()
        self.metrics.request_done(result)
        if streaming:
            ids = pending
        else:
            ids = result.token_ids if exclude_input else list(result.prompt_token_ids) + list(result.token_ids)
        outputs = self._tokens(ids)
        if want_perf:
            stats = result.stats
            outputs += [
                # Every block a request holds is its own (no prefix reuse): all new, none reused.
                _tensor("kv_cache_alloc_new_blocks", [result.kv_blocks], np.int32),
                _tensor("kv_cache_reused_blocks", [0], np.int32),
                _tensor("kv_cache_alloc_total_blocks", [result.kv_blocks], np.int32),
                _tensor("arrival_time_ns", [arrival_ns], np.int64),
                _tensor("first_scheduled_time_ns", [scheduled_ns], np.int64),
                _tensor("first_token_time_ns", [first_token_ns or last_token_ns], np.int64),
                _tensor("last_token_time_ns", [last_token_ns], np.int64),
                _tensor("acceptance_rate", [stats.acceptance_rate], np.float32),
                _tensor("total_accepted_draft_tokens", [stats.accepted_tokens], np.int32),
                _tensor("total_draft_tokens", [stats.draft_tokens], np.int32),
            ]
        if want_counts[0]:
            outputs.append(_tensor("num_input_tokens", [len(result.prompt_token_ids)], np.int32))
        if want_counts[1]:
            outputs.append(_tensor("num_output_tokens", [len(result.token_ids)], np.int32))
        send(sender, pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL)

    def _ends_cleanly(self, tokens):
        return not self.engine.tokenizer.decode(tokens).endswith(REPLACEMENT_CHAR)

    @staticmethod
    def _tokens(ids):
        return [
            pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32).reshape(1, 1, -1)),
            pb_utils.Tensor("sequence_length", np.array([[len(ids)]], dtype=np.int32)),
        ]
