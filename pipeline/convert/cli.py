"""`specpipe convert`: a target (HF folder, GGUF, or smollm2) and an optional draft → a TensorRT-LLM checkpoint."""

from __future__ import annotations

import argparse

from pipeline.convert.convert import DraftInputs, convert


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert", help="convert a target (and draft) to a TensorRT-LLM 1.2 checkpoint", description=__doc__
    )
    p.add_argument("--target", required=True, help="Hugging Face folder, .gguf file, or 'smollm2'")
    p.add_argument("--output", required=True, help="checkpoint folder to write (replaced atomically)")
    p.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 (default float32)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1)
    draft = p.add_argument_group("speculative inputs (at most one)")
    draft.add_argument("--medusa", help="Medusa heads: FasterDecoding, ModelOpt or vLLM layout")
    draft.add_argument("--num-medusa-heads", type=int, help="heads to use (default: as many as the tensors hold)")
    draft.add_argument("--eagle", help="EAGLE-1/2 draft folder (SafeAILab layout)")
    draft.add_argument("--num-eagle-layers", type=int, help="EAGLE tree depth (default 4)")
    draft.add_argument("--max-non-leaves-per-layer", type=int, help="EAGLE-2 non-leaf nodes per layer (default 10)")
    draft.add_argument("--eagle3", help="EAGLE-3 draft folder (kept beside the target in draft/)")
    draft.add_argument(
        "--draft-vocab",
        type=int,
        help="EAGLE-3: keep this many tokens in the draft's vocabulary, "
        "the most frequent in --vocab-tokens (the LM head a draft depth reads shrinks with it)",
    )
    draft.add_argument(
        "--vocab-tokens",
        help="token file (.npz of token ids, e.g. the drafts' training data in "
        "drafts/distill/) whose responses rank the tokens for --draft-vocab",
    )
    draft.add_argument("--draft-model", help="smaller Llama-family model sharing the tokenizer (folder or .gguf)")
    draft.add_argument("--max-draft-len", type=int, help="draft tokens per step (Medusa/EAGLE default 63)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    drafts = DraftInputs(
        medusa=args.medusa,
        num_medusa_heads=args.num_medusa_heads,
        eagle=args.eagle,
        num_eagle_layers=args.num_eagle_layers,
        max_non_leaves_per_layer=args.max_non_leaves_per_layer,
        eagle3=args.eagle3,
        draft_vocab=args.draft_vocab,
        vocab_tokens=args.vocab_tokens,
        draft_model=args.draft_model,
        max_draft_len=args.max_draft_len,
    )
    out = convert(args.target, args.output, dtype=args.dtype, tp=args.tp_size, pp=args.pp_size, drafts=drafts)
    print(f"checkpoint written to {out}")
    return 0
