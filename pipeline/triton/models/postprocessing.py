"""Triton Python model `postprocessing`: token ids -> text, one string per sequence (batch x beam).

Self-contained (numpy, transformers, Triton's pb_utils) so it also runs in the NGC TensorRT-LLM container.
"""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.skip_special_tokens = params["skip_special_tokens"]["string_value"].lower() in ("true", "1")
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"]["string_value"])

    def finalize(self):
        """Leave the process at once: the interpreter's teardown (transformers imports torch) takes seconds,
        which pushed tritonserver past its exit timeout."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            tokens = tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])  # [batch, beam, len]
            lengths = lengths.reshape(tokens.shape[0], -1)
            texts = [
                [
                    self.tokenizer.decode(seq[:n].tolist(), skip_special_tokens=self.skip_special_tokens).encode(
                        "utf-8"
                    )
                    for seq, n in zip(beams, beam_lengths)
                ]
                for beams, beam_lengths in zip(tokens, lengths)
            ]
            output = pb_utils.Tensor("OUTPUT", np.array(texts, dtype=np.object_))
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
