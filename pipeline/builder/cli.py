"""`specpipe build`: a TensorRT-LLM checkpoint → an engine directory.

portable: config.json shaped like trtllm-build's ({version, pretrained_config, build_config}), the rank
          files hard-linked, tokenizer/, draft/ and specpipe.json; the portable PyTorch engine loads it.
trtllm:   runs `trtllm-build` (the exact command lines are printed with --dry-run), then adds
          specpipe.json and tokenizer/. Both builds are atomic: a failure leaves nothing.
"""

from __future__ import annotations

import argparse

from pipeline.builder.build import BuildOptions, build_engine, tree_summary
from pipeline.engine.config import EngineDir


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "build",
        help="build an engine directory from a TensorRT-LLM checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--backend", default="portable", help="portable | trtllm (default portable)")
    p.add_argument("--max-batch-size", type=int, default=BuildOptions.max_batch_size)
    p.add_argument("--max-input-len", type=int, default=BuildOptions.max_input_len)
    p.add_argument("--max-seq-len", type=int, default=BuildOptions.max_seq_len)
    p.add_argument(
        "--max-draft-len", type=int, help="draft tokens per step (default: checkpoint's, or 4 for a draft model)"
    )
    p.add_argument(
        "--choices",
        help="tree: preset (mc_sim_7b_63, top16, ...), chain:N, a literal list or a file; with --dynamic-tree the "
        "static tree batched steps cut their tiers from",
    )
    p.add_argument(
        "--dynamic-tree",
        action="store_true",
        help="EAGLE-2 dynamic trees instead of static choices (Medusa: portable backend only)",
    )
    p.add_argument("--dynamic-top-k", type=int)
    p.add_argument("--dynamic-depth", type=int)
    p.add_argument("--max-non-leaves-per-layer", type=int)
    p.add_argument("--speculative", help="'ngram' for prompt-lookup drafting on a plain checkpoint")
    p.add_argument("--ngram-k", type=int, default=BuildOptions.ngram_k)
    p.add_argument("--ngram-min-n", type=int, default=BuildOptions.ngram_min_n)
    p.add_argument("--ngram-max-n", type=int, default=BuildOptions.ngram_max_n)
    p.add_argument(
        "--acceptance", default="lossless", help="lossless | typical (Medusa typical acceptance, not lossless)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands (trtllm) or the build config (portable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    opts = BuildOptions(
        args.max_batch_size,
        args.max_input_len,
        args.max_seq_len,
        args.max_draft_len,
        args.choices,
        args.dynamic_tree,
        args.dynamic_top_k,
        args.dynamic_depth,
        args.max_non_leaves_per_layer,
        args.speculative,
        args.ngram_k,
        args.ngram_min_n,
        args.ngram_max_n,
        args.acceptance,
    )
    out = build_engine(args.checkpoint, args.output, args.backend, opts, args.dry_run)
    if not args.dry_run:
        summary = tree_summary(EngineDir.load(out).spec, opts)
        if summary:
            print(summary)
        print(f"engine written to {out}")
    return 0
