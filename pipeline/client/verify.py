"""Output verification: greedy tokens from the Triton server against Hugging Face `generate` on the same target.

The server side asks the engine model (`tensorrt_llm`) for token ids directly, so the comparison is
exact: no detokenize/retokenize round trip. Prompts go through the tokenizer's chat template when it
has one, tokenized like the preprocessing model does (`tokenizer(text).input_ids`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.prompts import chat_text
from pipeline.client.client import Sampling, generate_ids

GREEDY = 0.0
PROMPT_PREVIEW_CHARS = 48


@dataclass(frozen=True)
class PromptResult:
    prompt: str
    prompt_tokens: int
    server_tokens: list[int]
    reference_tokens: list[int]
    match: bool
    divergence: int | None  # first index where the two differ (or where one ends), None on a match
    server_token: str | None
    reference_token: str | None
    reference_margin: float | None  # top-1 minus top-2 logit of the reference at the divergence
    acceptance_length: float
    acceptance_rate: float


def reference_generate(
    model: Any, prompt_ids: list[int], max_tokens: int, end_id: int | None
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits [n, vocab] from Hugging Face generate."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=end_id,
            pad_token_id=end_id,
            output_logits=True,
            return_dict_in_generate=True,
            top_k=None,
            top_p=None,
            temperature=None,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return tokens, torch.cat(out.logits, dim=0).float()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(logits: torch.Tensor, position: int) -> float | None:
    if position >= logits.shape[0]:
        return None
    top = torch.topk(logits[position], 2).values
    return float(top[0] - top[1])


def verify_prompt(url: str, model: Any, tokenizer: Any, prompt: str, max_tokens: int) -> PromptResult:
    prompt_ids = tokenizer(chat_text(tokenizer, prompt)).input_ids
    reply = generate_ids(url, prompt_ids, Sampling(max_tokens=max_tokens, temperature=GREEDY))
    reference, logits = reference_generate(model, prompt_ids, max_tokens, tokenizer.eos_token_id)
    at = first_divergence(reply.output_ids, reference)

    def token_text(tokens: list[int]) -> str | None:
        return None if at is None or at >= len(tokens) else tokenizer.decode([tokens[at]])

    return PromptResult(
        prompt,
        len(prompt_ids),
        reply.output_ids,
        reference,
        at is None,
        at,
        token_text(reply.output_ids),
        token_text(reference),
        None if at is None else top2_margin(logits, at),
        reply.acceptance_length,
        reply.acceptance_rate,
    )


def verify(url: str, target: Any, prompts: list[str], max_tokens: int) -> list[PromptResult]:
    """`target` is a target spec (`load_hf_model` argument): a name, folder, .gguf file or TargetSource."""
    from pipeline.convert.source import load_hf_model, load_target

    source = load_target(target) if isinstance(target, (str, Path)) else target
    model = load_hf_model(source, dtype=torch.float32)
    return [
        verify_prompt(url, model, source.tokenizer, p, max_tokens) for p in tqdm(prompts, desc="verify", unit="prompt")
    ]


def format_table(results: list[PromptResult]) -> str:
    header = f"{'prompt':<{PROMPT_PREVIEW_CHARS}}  match  divergence (server | reference, margin)      accept.len"
    lines = [header, "-" * len(header)]
    for r in results:
        preview = r.prompt.replace("\n", " ")[:PROMPT_PREVIEW_CHARS]
        if r.match:
            where = f"- ({len(r.server_tokens)} tokens equal)"
        else:
            margin = "n/a" if r.reference_margin is None else f"{r.reference_margin:.3f}"
            where = f"@{r.divergence}: {r.server_token!r} | {r.reference_token!r}, margin {margin}"
        lines.append(
            f"{preview:<{PROMPT_PREVIEW_CHARS}}  {'yes' if r.match else 'NO':<5}  {where:<42}  "
            f"{r.acceptance_length:.2f}"
        )
    mismatches = sum(not r.match for r in results)
    lines.append(f"{len(results)} prompts, {mismatches} mismatches")
    return "\n".join(lines)


def write_report(results: list[PromptResult], path: str | Path, meta: dict[str, Any]) -> Path:
    path = Path(path)
    report = {
        **meta,
        "prompts": len(results),
        "mismatches": sum(not r.match for r in results),
        "results": [asdict(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True))
    tmp.replace(path)  # atomic: a reader never sees half a report
    return path
