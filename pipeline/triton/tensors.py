"""Tensor signatures of the tensorrtllm_backend models (inflight_batcher_llm), decoder-only text subset.

Names, types and dims follow the backend's templates so that clients written for TensorRT-LLM on
Triton work unchanged. Left out: encoder-decoder, multimodal, prompt-table, LoRA, guided-decoding,
lookahead, KV-retention and disaggregated-serving tensors, which no specpipe engine produces.
"""

from __future__ import annotations

from dataclasses import dataclass

VARIABLE = -1  # Triton's wildcard dimension


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton data type without the TYPE_ prefix
    dims: tuple[int, ...] = (1,)
    optional: bool = False
    scalar: bool = False  # reshaped [1] -> [] as the C++ backend expects its per-request scalars
    ragged: bool = False  # allow_ragged_batch: each request of a batch keeps its own length


def _opt(name: str, dtype: str, dims: tuple[int, ...] = (1,), **flags: bool) -> Tensor:
    return Tensor(name, dtype, dims, optional=True, **flags)


# --- preprocessing: text -> token ids -------------------------------------------------------
# QUERY and REQUEST_OUTPUT_LEN (text_input, max_tokens) are needed but declared optional: Triton 2.51's
# streaming paths answer a missing required input of an ensemble with an empty success; the preprocessing
# model refuses it with an error that names the input.
PREPROCESSING_INPUTS = (
    _opt("QUERY", "STRING"),
    _opt("REQUEST_OUTPUT_LEN", "INT32"),
    _opt("BAD_WORDS_DICT", "STRING", (VARIABLE,)),
    _opt("STOP_WORDS_DICT", "STRING", (VARIABLE,)),
    _opt("END_ID", "INT32"),
    _opt("PAD_ID", "INT32"),
    _opt("APPLY_CHAT_TEMPLATE", "BOOL"),
)
PREPROCESSING_OUTPUTS = (
    Tensor("INPUT_ID", "INT32", (VARIABLE,)),
    Tensor("REQUEST_INPUT_LEN", "INT32"),
    Tensor("BAD_WORDS_IDS", "INT32", (2, VARIABLE)),
    Tensor("STOP_WORDS_IDS", "INT32", (2, VARIABLE)),
    Tensor("REQUEST_OUTPUT_LEN", "INT32", (VARIABLE,)),
    Tensor("OUT_END_ID", "INT32"),
    Tensor("OUT_PAD_ID", "INT32"),
)

# --- postprocessing: token ids -> text ------------------------------------------------------
POSTPROCESSING_INPUTS = (
    Tensor("TOKENS_BATCH", "INT32", (VARIABLE, VARIABLE)),
    Tensor("SEQUENCE_LENGTH", "INT32", (VARIABLE,)),
)
POSTPROCESSING_OUTPUTS = (Tensor("OUTPUT", "STRING", (VARIABLE,)),)

# --- tensorrt_llm: the engine model ---------------------------------------------------------
_ENGINE_SCALARS = (
    ("num_return_sequences", "INT32"),
    ("draft_acceptance_threshold", "FP32"),
    ("end_id", "INT32"),
    ("pad_id", "INT32"),
    ("beam_width", "INT32"),
    ("temperature", "FP32"),
    ("runtime_top_k", "INT32"),
    ("runtime_top_p", "FP32"),
    ("len_penalty", "FP32"),
    ("repetition_penalty", "FP32"),
    ("min_tokens", "INT32"),
    ("presence_penalty", "FP32"),
    ("frequency_penalty", "FP32"),
    ("seed", "UINT64"),
    ("return_log_probs", "BOOL"),
    ("return_context_logits", "BOOL"),
    ("return_generation_logits", "BOOL"),
    ("return_perf_metrics", "BOOL"),
    ("return_num_input_tokens", "BOOL"),
    ("return_num_output_tokens", "BOOL"),
    ("exclude_input_in_output", "BOOL"),
    ("stop", "BOOL"),
    ("streaming", "BOOL"),
    ("speculative", "BOOL"),  # portable engine: False serves the request with plain steps (default True)
)
ENGINE_INPUTS = (
    _opt("input_ids", "INT32", (VARIABLE,), ragged=True),
    Tensor("input_lengths", "INT32", scalar=True),
    Tensor("request_output_len", "INT32", scalar=True),
    _opt("draft_input_ids", "INT32", (VARIABLE,), ragged=True),
    _opt("draft_logits", "FP32", (VARIABLE, VARIABLE), ragged=True),
    _opt("stop_words_list", "INT32", (2, VARIABLE), ragged=True),
    _opt("bad_words_list", "INT32", (2, VARIABLE), ragged=True),
    _opt("embedding_bias", "FP32", (VARIABLE,), ragged=True),
) + tuple(_opt(name, dtype, scalar=True) for name, dtype in _ENGINE_SCALARS)

PERF_METRIC_OUTPUTS = (
    Tensor("kv_cache_alloc_new_blocks", "INT32"),
    Tensor("kv_cache_reused_blocks", "INT32"),
    Tensor("kv_cache_alloc_total_blocks", "INT32"),
    Tensor("arrival_time_ns", "INT64"),
    Tensor("first_scheduled_time_ns", "INT64"),
    Tensor("first_token_time_ns", "INT64"),
    Tensor("last_token_time_ns", "INT64"),
    Tensor("acceptance_rate", "FP32"),
    Tensor("total_accepted_draft_tokens", "INT32"),
    Tensor("total_draft_tokens", "INT32"),
)
# Outputs the ensemble and BLS pass through unchanged from the engine model.
PASSTHROUGH_OUTPUTS = (
    (
        Tensor("cum_log_probs", "FP32", (VARIABLE,)),
        Tensor("output_log_probs", "FP32", (VARIABLE, VARIABLE)),
        Tensor("context_logits", "FP32", (VARIABLE, VARIABLE)),
        Tensor("generation_logits", "FP32", (VARIABLE, VARIABLE, VARIABLE)),
        Tensor("batch_index", "INT32"),
        Tensor("sequence_index", "INT32"),
    )
    + PERF_METRIC_OUTPUTS
    + (
        Tensor("num_input_tokens", "INT32"),
        Tensor("num_output_tokens", "INT32"),
    )
)
ENGINE_OUTPUTS = (
    Tensor("output_ids", "INT32", (VARIABLE, VARIABLE)),
    Tensor("sequence_length", "INT32", (VARIABLE,)),
) + PASSTHROUGH_OUTPUTS

# --- ensemble / tensorrt_llm_bls: the client-facing models ----------------------------------
# Client-facing input -> engine input, for inputs the ensemble hands straight to the engine.
ENGINE_INPUT_OF = {
    "num_return_sequences": "num_return_sequences",
    "exclude_input_in_output": "exclude_input_in_output",
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "temperature": "temperature",
    "length_penalty": "len_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "return_log_probs": "return_log_probs",
    "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits",
    "return_perf_metrics": "return_perf_metrics",
    "return_num_input_tokens": "return_num_input_tokens",
    "return_num_output_tokens": "return_num_output_tokens",
    "beam_width": "beam_width",
    "stream": "streaming",
    "speculative": "speculative",
}
# Client-facing input -> preprocessing input.
PREPROCESSING_INPUT_OF = {
    "text_input": "QUERY",
    "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT",
    "stop_words": "STOP_WORDS_DICT",
    "end_id": "END_ID",
    "pad_id": "PAD_ID",
    "apply_chat_template": "APPLY_CHAT_TEMPLATE",
}
# Preprocessing output -> engine input.
ENGINE_INPUT_FROM_PREPROCESSING = {
    "INPUT_ID": "input_ids",
    "REQUEST_INPUT_LEN": "input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len",
    "OUT_END_ID": "end_id",
    "OUT_PAD_ID": "pad_id",
    "STOP_WORDS_IDS": "stop_words_list",
    "BAD_WORDS_IDS": "bad_words_list",
}

ENSEMBLE_INPUTS = (
    _opt("text_input", "STRING"),  # needed; optional for the reason given at PREPROCESSING_INPUTS
    _opt("max_tokens", "INT32"),
    _opt("num_return_sequences", "INT32"),
    _opt("bad_words", "STRING", (VARIABLE,)),
    _opt("stop_words", "STRING", (VARIABLE,)),
    _opt("exclude_input_in_output", "BOOL"),
    _opt("end_id", "INT32"),
    _opt("pad_id", "INT32"),
    _opt("top_k", "INT32"),
    _opt("top_p", "FP32"),
    _opt("temperature", "FP32"),
    _opt("length_penalty", "FP32"),
    _opt("repetition_penalty", "FP32"),
    _opt("min_tokens", "INT32"),
    _opt("presence_penalty", "FP32"),
    _opt("frequency_penalty", "FP32"),
    _opt("seed", "UINT64"),
    _opt("return_log_probs", "BOOL"),
    _opt("return_context_logits", "BOOL"),
    _opt("return_generation_logits", "BOOL"),
    _opt("return_perf_metrics", "BOOL"),
    _opt("return_num_input_tokens", "BOOL"),
    _opt("return_num_output_tokens", "BOOL"),
    _opt("beam_width", "INT32"),
    _opt("stream", "BOOL"),
    _opt("speculative", "BOOL"),  # False: no drafting for this request (speculative engines)
    _opt("apply_chat_template", "BOOL"),  # the prompt is one user turn: wrap it in the tokenizer's chat template
)
ENSEMBLE_OUTPUTS = (Tensor("text_output", "STRING", (VARIABLE,)),) + PASSTHROUGH_OUTPUTS

BLS_INPUTS = ENSEMBLE_INPUTS + (
    _opt("num_draft_tokens", "INT32"),
    _opt("use_draft_logits", "BOOL", scalar=True),
)
BLS_OUTPUTS = ENSEMBLE_OUTPUTS
