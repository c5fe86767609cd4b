"""Tiny random models and drafts in every input format, so tests never need the network.

`make_tiny_model` writes a Hugging Face Llama or Qwen2 folder with a small deterministic byte-level
BPE tokenizer; the `make_random_*` helpers write Medusa heads, EAGLE-1/2 and EAGLE-3 drafts in the
layouts their reference repositories publish.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipeline.convert.eagle3 import reduce_vocab

BOS, EOS, IM_START, IM_END = (
    "<|bos|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
)  # Qwen2 tokenizers expect <|endoftext|>
TOKENIZER_VOCAB = 509  # odd on purpose: TP 2 must pad the vocabulary
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A fixed corpus so BPE training is deterministic; its words are what tests prompt with.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts tokens and the target verifies them.
Once upon a time there was a small model that wanted to be fast. It read the same story again and again.
def add(a, b):\n    return a + b\nprint(add(2, 3))
Tensor parallel shards split the heads across ranks; pipeline stages split the layers.
Medusa heads, EAGLE drafts and n-gram lookup all propose tokens for one verification pass.
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20. Hello world! How are you today? I am fine, thank you.
"""
INIT_STD = 0.05  # larger than transformers' 0.02 so logits are not nearly flat
NORM_JITTER = 0.1  # norms away from 1.0 so a swapped norm shows up in round-trip tests

TINY_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
)


def make_tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines() * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS, chat_template=CHAT_TEMPLATE
    )


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Fill every parameter from a seeded generator: matrices ~ N(0, INIT_STD), norms ~ 1 + jitter, biases small."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(noise * INIT_STD)
            elif "norm" in name:
                p.copy_(1.0 + noise * NORM_JITTER)
            else:
                p.copy_(noise * INIT_STD)


def make_tiny_model(
    out_dir: str | Path, arch: str = "llama", seed: int = 0, tie_word_embeddings: bool = False, **overrides: Any
) -> Path:
    """Write a random Hugging Face Llama or Qwen2 folder (safetensors, config, tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out_dir = Path(out_dir)
    tokenizer = make_tiny_tokenizer()
    fields = {
        **TINY_SHAPES,
        "vocab_size": len(tokenizer),
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **overrides,
    }
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = config_cls(**fields)
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    if tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * INIT_STD


def make_random_medusa(
    out_dir: str | Path,
    hidden: int,
    vocab: int,
    heads: int = 4,
    layers: int = 1,
    fmt: str = "reference",
    seed: int = 0,
    with_lm_head: bool = True,
    config_heads: int | None = None,
) -> Path:
    """Random Medusa heads in one of the published layouts.

    fmt: "reference" (FasterDecoding medusa_lm_head.safetensors), "reference_pt" (medusa_lm_head.pt),
    "modelopt" (`medusa_heads.` prefix), "vllm" (`blocks.{h}.layers.{l}`, `lm_heads.{h}`).
    `config_heads` writes a config that understates the head count, as some published configs do.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for h in range(heads):
        for layer in range(layers):
            w, b = _randn(gen, hidden, hidden), _randn(gen, hidden)
            if fmt == "vllm":
                tensors[f"blocks.{h}.layers.{layer}.weight"], tensors[f"blocks.{h}.layers.{layer}.bias"] = w, b
            else:
                tensors[f"{h}.{layer}.linear.weight"], tensors[f"{h}.{layer}.linear.bias"] = w, b
        if with_lm_head:
            lm = _randn(gen, vocab, hidden)
            tensors[f"lm_heads.{h}.weight" if fmt == "vllm" else f"{h}.{layers}.weight"] = lm
    if fmt == "modelopt":
        tensors = {f"medusa_heads.{k}": v for k, v in tensors.items()}
    n_cfg = config_heads or heads
    if fmt == "vllm":
        config = {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "hidden_size": hidden,
            "vocab_size": vocab,
            "num_heads": n_cfg,
            "num_hidden_layers": layers,
            "medusa_fc_bias": True,
        }
    else:
        config = {"medusa_num_heads": n_cfg, "medusa_num_layers": layers, "hidden_size": hidden, "vocab_size": vocab}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "reference_pt":
        torch.save(tensors, out_dir / "medusa_lm_head.pt")
    else:
        name = {"vllm": "model.safetensors", "modelopt": "model.safetensors"}.get(fmt, "medusa_lm_head.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / name))
    return out_dir


def _decoder_layer(
    gen: torch.Generator, prefix: str, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, attn_in: int
) -> dict[str, torch.Tensor]:
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        f"{prefix}self_attn.q_proj.weight": _randn(gen, q, attn_in),
        f"{prefix}self_attn.k_proj.weight": _randn(gen, kv, attn_in),
        f"{prefix}self_attn.v_proj.weight": _randn(gen, kv, attn_in),
        f"{prefix}self_attn.o_proj.weight": _randn(gen, hidden, q),
        f"{prefix}mlp.gate_proj.weight": _randn(gen, inter, hidden),
        f"{prefix}mlp.up_proj.weight": _randn(gen, inter, hidden),
        f"{prefix}mlp.down_proj.weight": _randn(gen, hidden, inter),
        f"{prefix}post_attention_layernorm.weight": 1.0 + torch.randn(hidden, generator=gen) * NORM_JITTER,
    }


def _draft_config(
    hidden: int, vocab: int, inter: int, heads: int, kv_heads: int, head_dim: int, layers: int, **extra: Any
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        **extra,
    }


def make_random_eagle(
    out_dir: str | Path,
    hidden: int,
    vocab: int,
    inter: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    layers: int = 1,
    seed: int = 0,
    with_embedding: bool = True,
    fmt: str = "safetensors",
) -> Path:
    """A random SafeAILab EAGLE-1/2 draft: fc over concat(embedding, feature), decoder layers (layer 0 has
    no input_layernorm), optional embed_tokens; fmt "safetensors" or "bin" (pytorch_model.bin)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _randn(gen, hidden, 2 * hidden), "fc.bias": _randn(gen, hidden)}
    for layer in range(layers):
        tensors.update(_decoder_layer(gen, f"layers.{layer}.", hidden, inter, heads, kv_heads, head_dim, hidden))
        if layer > 0:
            tensors[f"layers.{layer}.input_layernorm.weight"] = 1.0 + torch.randn(hidden, generator=gen) * NORM_JITTER
    if with_embedding:
        tensors["embed_tokens.weight"] = _randn(gen, vocab, hidden)
    config = _draft_config(hidden, vocab, inter, heads, kv_heads, head_dim, layers, bias=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "bin":
        torch.save(tensors, out_dir / "pytorch_model.bin")
    else:
        save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def make_random_eagle3(
    out_dir: str | Path,
    hidden: int,
    vocab: int,
    draft_vocab: int | None = None,
    inter: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    seed: int = 0,
    with_lm_head: bool = True,
) -> Path:
    """A random EAGLE-3 draft: fc [H, 3H], one midlayer whose attention reads 2H, its own norm;
    `d2t`/`t2d` when the draft vocabulary is smaller than the target's."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    draft_vocab = draft_vocab or vocab
    tensors = {
        "fc.weight": _randn(gen, hidden, 3 * hidden),
        "norm.weight": 1.0 + torch.randn(hidden, generator=gen) * NORM_JITTER,
    }
    tensors.update(_decoder_layer(gen, "midlayer.", hidden, inter, heads, kv_heads, head_dim, 2 * hidden))
    for norm in ("input_layernorm", "hidden_norm"):
        tensors[f"midlayer.{norm}.weight"] = 1.0 + torch.randn(hidden, generator=gen) * NORM_JITTER
    if with_lm_head:
        tensors["lm_head.weight"] = _randn(gen, vocab, hidden)
    if draft_vocab != vocab:  # the draft keeps a random subset of target ids
        kept = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values
        reduce_vocab(tensors, kept, vocab)
    config = _draft_config(
        hidden,
        vocab,
        inter,
        heads,
        kv_heads,
        head_dim,
        1,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=draft_vocab,
        bias=False,
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir
