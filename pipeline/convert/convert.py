"""`convert`: one target (plus at most one draft input) → one TensorRT-LLM checkpoint folder, atomically."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.convert.checkpoint import write_checkpoint
from pipeline.convert.llama import check_parallel, llama_config, llama_tensors
from pipeline.convert.source import TargetSource, load_target, parse_dtype
from pipeline.errors import UserError, atomic_output_dir


@dataclass(frozen=True)
class DraftInputs:
    """At most one speculative input; the numbers override what the draft's own files say."""

    medusa: str | None = None
    num_medusa_heads: int | None = None
    eagle: str | None = None
    num_eagle_layers: int | None = None
    max_non_leaves_per_layer: int | None = None
    eagle3: str | None = None
    draft_vocab: int | None = None  # EAGLE-3: a smaller draft vocabulary, its most frequent tokens in vocab_tokens
    vocab_tokens: str | None = None
    draft_model: str | None = None
    max_draft_len: int | None = None

    def kind(self) -> str:
        given = [k for k in ("medusa", "eagle", "eagle3", "draft_model") if getattr(self, k)]
        if len(given) > 1:
            raise UserError(
                f"--{given[0].replace('_', '-')} and --{given[1].replace('_', '-')}: give at most one draft input"
            )
        return given[0] if given else "none"


def convert(
    target: str | Path | TargetSource,
    output: str | Path,
    dtype: str = "float32",
    tp: int = 1,
    pp: int = 1,
    drafts: DraftInputs = DraftInputs(),
) -> Path:
    """Write the checkpoint for `target` (and its draft) into `output`; nothing is left on failure."""
    torch_dtype = parse_dtype(dtype)
    kind = drafts.kind()
    if (drafts.draft_vocab is not None or drafts.vocab_tokens is not None) and kind != "eagle3":
        raise UserError("--draft-vocab: only EAGLE-3 drafts have a vocabulary of their own (d2t); give --eagle3")
    if kind == "eagle" and pp != 1:
        raise UserError(
            f"--pp-size {pp}: EAGLE checkpoints need pp_size 1 (TensorRT-LLM has no EAGLE pipeline parallelism)"
        )
    source = target if isinstance(target, TargetSource) else load_target(target)
    check_parallel(source.config, tp, pp)
    config = llama_config(source.config, torch_dtype, tp, pp)
    tensors = llama_tensors(source, torch_dtype)
    with atomic_output_dir(output) as tmp:
        if kind == "medusa":
            from pipeline.convert.medusa import add_medusa

            assert drafts.medusa is not None  # kind() named it

            config, tensors = add_medusa(
                config, tensors, source, drafts.medusa, torch_dtype, drafts.num_medusa_heads, drafts.max_draft_len
            )
        elif kind == "eagle":
            from pipeline.convert.eagle import add_eagle

            assert drafts.eagle is not None  # kind() named it

            config, tensors = add_eagle(
                config,
                tensors,
                source,
                drafts.eagle,
                torch_dtype,
                drafts.num_eagle_layers,
                drafts.max_draft_len,
                drafts.max_non_leaves_per_layer,
            )
        elif kind == "eagle3":
            from pipeline.convert.eagle3 import write_eagle3_draft

            assert drafts.eagle3 is not None  # kind() named it

            write_eagle3_draft(tmp, source, drafts.eagle3, torch_dtype, drafts.draft_vocab, drafts.vocab_tokens)
        elif kind == "draft_model":
            from pipeline.convert.draft_model import write_draft_model

            assert drafts.draft_model is not None  # kind() named it

            write_draft_model(tmp, source, drafts.draft_model, torch_dtype, tp)
        write_checkpoint(tmp, config, tensors, source.tokenizer)
    return Path(output)
