"""`specpipe generate` and `specpipe eval-acceptance`: the portable engine in-process."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.engine.sampling import RequestError, SamplingParams
from pipeline.engine.stats import SpecStats
from pipeline.errors import UserError

if TYPE_CHECKING:
    from pipeline.engine.scheduler import SchedulerConfig

NEVER_PAUSE = -1.0  # a request_cutoff no running mean of accepted tokens falls below


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with a portable engine")
    p.add_argument("--engine", required=True, type=Path)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=generate)

    e = sub.add_parser("eval-acceptance", help="acceptance length of a speculative engine on a prompt set")
    e.add_argument("--engine", required=True, type=Path)
    e.add_argument("--prompts", type=Path, default=None, help="JSONL (default: MT-bench first turns)")
    e.add_argument(
        "--prompt-ids",
        type=Path,
        default=None,
        help="instead: a JSON list of prompts' token ids, used as they are (e.g. the held-out ShareGPT split, "
        "bench/inputs/sharegpt-held-out-smollm2-chat-ids.json)",
    )
    e.add_argument(
        "--tier", default="full", help="the tier every step drafts with (default full: the engine's own tree)"
    )
    e.add_argument("--num-prompts", type=int, default=80)
    e.add_argument("--max-tokens", type=int, default=256)
    e.add_argument("--device", default="cpu")
    e.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    e.set_defaults(func=eval_acceptance)


def prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    """Exactly `tokenizer(text).input_ids`, of the chat-templated text with --chat."""
    from pipeline.bench.prompts import chat_text

    if chat and not getattr(tokenizer, "chat_template", None):
        raise UserError("--chat: this engine's tokenizer has no chat template; drop --chat")
    return tokenizer(chat_text(tokenizer, text) if chat else text).input_ids


def _load(engine_dir: Path, device: str, serving: SchedulerConfig | None = None):
    from pipeline.engine.loader import open_engine

    return open_engine(engine_dir, device=device, serving=serving)


def generate(args: argparse.Namespace) -> int:
    engine = _load(args.engine, args.device)
    ids = prompt_ids(engine.tokenizer, args.prompt, args.chat)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_words=tuple(args.stop),
    )
    start = time.perf_counter()
    try:
        result = engine.generate(ids, params)
    except RequestError as exc:
        raise UserError(str(exc)) from None
    seconds = time.perf_counter() - start
    if args.json:
        out = {
            "text": result.text,
            "prompt_token_ids": result.prompt_token_ids,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "seconds": seconds,
            "mode": engine.spec.mode,
        }
        out.update(result.stats.to_dict())
        print(json.dumps(out))
    else:
        print(result.text)
    return 0


def eval_acceptance(args: argparse.Namespace) -> int:
    """Acceptance of the engine's drafts: every step drafts with one tier (the engine's own tree unless --tier),
    no request paused for low acceptance, so the number is the draft's and not the load controller's."""
    from tqdm import tqdm

    from pipeline.bench.prompts import load_prompt_ids, load_prompts
    from pipeline.engine.adaptive import AdaptiveConfig
    from pipeline.engine.scheduler import SchedulerConfig

    if args.prompts is not None and args.prompt_ids is not None:
        raise UserError("give --prompts or --prompt-ids, not both")
    ids_given = None if args.prompt_ids is None else load_prompt_ids(args.prompt_ids, args.num_prompts)
    source = str(args.prompt_ids or args.prompts or "MT-bench first turns")
    texts = load_prompts(args.prompts, args.num_prompts) if ids_given is None else []
    serving = SchedulerConfig(speculation=args.tier, adaptive=AdaptiveConfig(request_cutoff=NEVER_PAUSE))
    engine = _load(args.engine, args.device, serving)
    if engine.spec.mode == "none":
        raise UserError(f"--engine {args.engine}: a plain engine drafts nothing; give a speculative engine")
    chat = bool(getattr(engine.tokenizer, "chat_template", None))
    prompts = ids_given or [prompt_ids(engine.tokenizer, text, chat=chat) for text in texts]
    params = SamplingParams(max_tokens=args.max_tokens, end_id=-1)
    per_prompt, generated, seconds = [], 0, 0.0
    for i, ids in enumerate(tqdm(prompts, desc=f"eval-acceptance {engine.spec.mode}", unit="prompt")):
        start = time.perf_counter()
        try:
            result = engine.generate(ids, params)
        except RequestError as exc:  # e.g. a token id outside the vocabulary, a prompt over the input limit
            raise UserError(f"prompt {i} of {source}: {exc}") from None
        seconds += time.perf_counter() - start
        generated += len(result.token_ids)
        per_prompt.append(result.stats)
    total = SpecStats.total(per_prompt)
    report = {
        "engine": str(args.engine),
        "mode": engine.spec.mode,
        "tier": args.tier,
        "prompt_source": source,
        "device": args.device,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_second": generated / seconds if seconds else 0.0,
        "tokens_per_step": generated / total.steps if total.steps else 0.0,
        "per_prompt_acceptance_length": [s.acceptance_length for s in per_prompt],
        **total.to_dict(),
    }
    print(f"mode {report['mode']}  prompts {len(prompts)}  max_tokens {args.max_tokens}  device {args.device}")
    print(f"mean acceptance length  {total.acceptance_length:.3f}  (accepted + 1 per target pass)")
    print(f"tokens per step         {report['tokens_per_step']:.3f}")
    print(f"draft acceptance rate   {total.acceptance_rate:.3f}")
    print(f"tokens/s                {report['tokens_per_second']:.1f}")
    print("per-depth acceptance    " + "  ".join(f"d{d + 1}={r:.2f}" for d, r in enumerate(total.per_depth_acceptance)))
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2))
    return 0
