"""Triton Python model `preprocessing`: text -> token ids, stop/bad words -> the [2, -1] id layout.

Self-contained (numpy, transformers, Triton's pb_utils) so it also runs in the NGC TensorRT-LLM
container, where specpipe is not installed. Tokenizes exactly like `tokenizer(text).input_ids`, after the
tokenizer's chat template (one user turn) when APPLY_CHAT_TEMPLATE is set.

A prompt longer in bytes than max_input_len tokens can be is refused before tokenization (tokenizing
megabytes takes seconds and gigabytes); every refusal is an INVALID_ARG error naming the input.
"""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

WORDS_PAD = -1  # pads the id and offset rows of a words list, as the C++ backend expects
# Request parameters Triton's front ends set themselves; any other parameter is an input name the model
# does not have (the HTTP generate endpoint turns unknown JSON fields into parameters).
FRONTEND_PARAMETER_PREFIX = "triton_"


class ClientError(ValueError):
    """A request this model refuses; the message names the input and what to send instead."""


def max_token_bytes(tokenizer):
    """An upper bound on the text bytes one token covers: the longest vocabulary entry in UTF-8. Byte-level
    BPE spells each byte as one character of at most 2 UTF-8 bytes and SentencePiece a space as a 3-byte
    character, so the spelled entry is never shorter than the text it stands for."""
    return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())


def words_to_ids(tokenizer, words):
    """[2, L] int32: row 0 the concatenated ids of all words, row 1 their end offsets, -1 padded."""
    ids, offsets = [], []
    for word in words:
        word_ids = tokenizer.encode(word, add_special_tokens=False)
        if word_ids:
            ids.extend(word_ids)
            offsets.append(len(ids))
    width = max(len(ids), 1)
    out = np.full((2, width), WORDS_PAD, dtype=np.int32)
    out[0, : len(ids)] = ids
    out[1, : len(offsets)] = offsets
    if not ids:
        out[0, 0] = 0  # an empty list: one dummy id with no offset, so nothing is ever matched
    return out


def decode_utf8(value, what):
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ClientError(f"{what} is not valid UTF-8 (byte {exc.start}); send UTF-8 text") from None


def pad_rows(rows, fill):
    width = max((r.shape[-1] for r in rows), default=1)
    return np.stack(
        [np.pad(r, [(0, 0)] * (r.ndim - 1) + [(0, width - r.shape[-1])], constant_values=fill) for r in rows]
    )


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        tokenizer_dir = params["tokenizer_dir"]["string_value"]
        self.add_special_tokens = params["add_special_tokens"]["string_value"].lower() in ("true", "1")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        max_input_len = int(params["max_input_len"]["string_value"])
        # A text over this many bytes has more than max_input_len tokens whatever it says.
        self.max_prompt_bytes = max_input_len * max_token_bytes(self.tokenizer)
        self.max_input_len = max_input_len
        self.end_id = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.pad_id = self.end_id if pad is None else pad

    def finalize(self):
        """Leave the process at once: the interpreter's teardown (transformers imports torch) takes seconds,
        which pushed tritonserver past its exit timeout."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._preprocess(request)))
            except ClientError as exc:
                error = pb_utils.TritonError(f"preprocessing: {exc}", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses

    def _optional(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _words(self, request, name, batch):
        words = self._optional(request, name)
        if words is None:
            return [[] for _ in range(batch)]
        return [[decode_utf8(w, name) for w in row.reshape(-1) if len(w)] for row in words.reshape(batch, -1)]

    def _ids_or_default(self, request, name, default, batch):
        value = self._optional(request, name)
        if value is None:
            return np.full((batch, 1), default, dtype=np.int32)
        return value.reshape(batch, 1).astype(np.int32)

    def _prompt(self, raw, chat):
        """The text to tokenize: UTF-8 checked, within the byte limit, chat-templated when asked."""
        if len(raw) > self.max_prompt_bytes:
            raise ClientError(
                f"text_input has {len(raw)} bytes, over the {self.max_prompt_bytes} that "
                f"{self.max_input_len} tokens (this engine's max_input_len) can hold; shorten the prompt"
            )
        text = decode_utf8(raw, "text_input")
        if not chat:
            return text
        if not getattr(self.tokenizer, "chat_template", None):
            raise ClientError("apply_chat_template: this model's tokenizer has no chat template; leave it unset")
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )

    def _preprocess(self, request):
        unknown = sorted(
            name for name in json.loads(request.parameters() or "{}") if not name.startswith(FRONTEND_PARAMETER_PREFIX)
        )
        if unknown:
            raise ClientError(
                f"unknown input(s) {', '.join(map(repr, unknown))}; see the model's inputs at "
                "/v2/models/ensemble/config"
            )
        query = self._optional(request, "QUERY")
        if query is None or query.size == 0:
            raise ClientError("input 'text_input' is missing; send the prompt as text_input")
        batch = query.shape[0]
        chat = self._optional(request, "APPLY_CHAT_TEMPLATE")
        chat = [False] * batch if chat is None else [bool(c) for c in chat.reshape(batch, -1)[:, 0]]
        texts = [self._prompt(q, c) for q, c in zip(query.reshape(batch, -1)[:, 0], chat)]
        ids = [
            np.array(self.tokenizer(t, add_special_tokens=self.add_special_tokens).input_ids, dtype=np.int32)
            for t in texts
        ]
        lengths = np.array([[len(x)] for x in ids], dtype=np.int32)
        stop = [words_to_ids(self.tokenizer, w) for w in self._words(request, "STOP_WORDS_DICT", batch)]
        bad = [words_to_ids(self.tokenizer, w) for w in self._words(request, "BAD_WORDS_DICT", batch)]
        output_len = self._optional(request, "REQUEST_OUTPUT_LEN")
        if output_len is None or output_len.size != batch:
            raise ClientError("input 'max_tokens' is missing; send the number of tokens to generate")
        output_len = output_len.reshape(batch, -1).astype(np.int32)
        return [
            pb_utils.Tensor("INPUT_ID", pad_rows(ids, self.pad_id).astype(np.int32)),
            pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
            pb_utils.Tensor("STOP_WORDS_IDS", pad_rows(stop, WORDS_PAD).astype(np.int32)),
            pb_utils.Tensor("BAD_WORDS_IDS", pad_rows(bad, WORDS_PAD).astype(np.int32)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len),
            pb_utils.Tensor("OUT_END_ID", self._ids_or_default(request, "END_ID", self.end_id, batch)),
            pb_utils.Tensor("OUT_PAD_ID", self._ids_or_default(request, "PAD_ID", self.pad_id, batch)),
        ]
