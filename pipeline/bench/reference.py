"""Hugging Face greedy reference outputs, cached on disk by a hash of (target, prompt, max_tokens)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

# Greedy decoding of a small model is a chain of tiny matrix products: one thread avoids OpenMP
# barrier stalls, which on shared cores made two threads ~6x slower than one (11 vs 1.9 tok/s).
REFERENCE_THREADS = 1


def cache_key(target: str, prompt: str, max_tokens: int) -> str:
    return hashlib.sha256(json.dumps([target, prompt, max_tokens]).encode()).hexdigest()[:32]


def greedy_references(target: str, prompts: Sequence[str], max_tokens: int, cache_dir: Path) -> list[str]:
    """Float32 greedy completions of `prompts` (already chat-formatted); the model loads only on a cache miss."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    files = [cache_dir / f"{cache_key(target, p, max_tokens)}.json" for p in prompts]
    missing = [i for i, f in enumerate(files) if not f.is_file()]
    if missing:
        model, tokenizer = _load(target)
        threads = torch.get_num_threads()
        torch.set_num_threads(REFERENCE_THREADS)
        try:
            for i in tqdm(missing, desc="HF greedy reference", unit="prompt"):
                text = _generate(model, tokenizer, prompts[i], max_tokens)
                tmp = files[i].with_suffix(".tmp")
                tmp.write_text(json.dumps({"prompt": prompts[i], "max_tokens": max_tokens, "text": text}))
                tmp.rename(files[i])
        finally:
            torch.set_num_threads(threads)
    return [json.loads(f.read_text())["text"] for f in files]


def _load(target: str) -> tuple[Any, Any]:
    from pipeline.convert.source import load_hf_model, load_target

    source = load_target(target)
    return load_hf_model(source, dtype=torch.float32), source.tokenizer


@torch.inference_mode()
def _generate(model: Any, tokenizer: Any, prompt: str, max_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
