"""Build an Engine from an engine directory: target weights, tokenizer, and the proposer its mode needs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from pipeline.engine.config import EngineDir, SpecConfig
from pipeline.engine.cpu_threads import on_own_thread
from pipeline.engine.draft_model import DraftModelProposer
from pipeline.engine.eagle import Eagle3Net, EagleNet, EagleProposer, EagleRows
from pipeline.engine.kv_cache import BlockPool
from pipeline.engine.medusa import MedusaHead, MedusaProposer, MedusaRows, medusa_heads
from pipeline.engine.model import ModelConfig, Transformer
from pipeline.engine.ngram import NgramProposer, NgramRows
from pipeline.engine.parallel import ParallelConfig
from pipeline.engine.runner import Engine, RowsFactory, prepare_kernels
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.engine.spec_step import BatchProposer, Tier, tier_ladder
from pipeline.engine.speculative import Proposer
from pipeline.engine.tp_loader import load_tensor_parallel, runs_as_ranks
from pipeline.engine.tree import MC_SIM_7B_63, build_tree
from pipeline.engine.weights import engine_state_dict, load_into
from pipeline.errors import UserError, read_json

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def model_config(config: dict, tensors: dict[str, torch.Tensor], positions: int = 0) -> ModelConfig:
    """The config, with RoPE tables long enough for `positions` (an engine's sequence plus its deepest draft)."""
    cfg = ModelConfig.from_pretrained_config(config, set(tensors))
    return replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, positions))


def build_transformer(config: dict, tensors: dict[str, torch.Tensor], what: str, positions: int = 0) -> Transformer:
    model = Transformer(model_config(config, tensors, positions))
    state = engine_state_dict(tensors, "transformer.", "")
    state["lm_head.weight"] = tensors.get("lm_head.weight", tensors["transformer.vocab_embedding.weight"])
    load_into(model, state, what)
    return model


def open_engine(
    engine_dir: str | Path,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    serving: SchedulerConfig | None = None,
) -> Engine:
    """The portable engine of an engine directory on `device` (dtype: the engine's unless given), warmed up."""
    loaded, target = EngineDir.load(engine_dir), torch.device(device)
    if target.type != "cpu":
        return load_engine(loaded, target, dtype, serving)
    # The caller's thread may not be the one that decodes (the scheduler's): see cpu_threads.
    return on_own_thread(load_engine, loaded, target, dtype, serving)


def load_engine(
    engine: EngineDir,
    device: torch.device,
    dtype: torch.dtype | None,
    serving: SchedulerConfig | None = None,
    parallel: ParallelConfig | None = None,
) -> Engine:
    from transformers import AutoTokenizer

    from pipeline.convert.checkpoint import read_checkpoint
    from pipeline.convert.eagle import not_a_later_copy

    if engine.backend != "portable":
        raise UserError(
            f"{engine.path}: a {engine.backend!r} engine runs in TensorRT-LLM, not the portable engine; "
            "build with --backend portable"
        )
    if runs_as_ranks(engine, serving):  # one process a rank, each loading its own shard
        dtype = dtype or DTYPES[engine.pretrained_config.get("dtype", "float32")]
        return load_tensor_parallel(engine, device, dtype, max_positions(engine), serving, parallel or ParallelConfig())
    config, tensors = read_checkpoint(engine.path, keep=not_a_later_copy)
    dtype = dtype or DTYPES[config.get("dtype", "float32")]
    target = build_transformer(config, tensors, str(engine.path), max_positions(engine)).to(device, dtype).eval()
    limits = engine.limits
    proposer = make_proposer(engine, config, tensors, target, device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(engine.tokenizer_dir)
    rows = batched_proposer(engine.spec, proposer, device, dtype)
    runtime = Engine(target, tokenizer, limits, engine.spec, proposer, serving, rows)
    runtime.warm_up()
    return runtime


def make_proposer(
    engine: EngineDir,
    config: dict,
    tensors: dict[str, torch.Tensor],
    target: Transformer,
    device: torch.device,
    dtype: torch.dtype,
) -> Proposer | None:
    spec: SpecConfig = engine.spec
    slots = engine.limits.max_seq_len
    if spec.mode == "none":
        return None
    if spec.mode == "ngram":
        assert spec.ngram is not None  # SpecConfig sets it for ngram
        return NgramProposer(spec.ngram, device)
    if spec.mode == "medusa":
        heads = medusa_heads(
            config["num_medusa_heads"],
            config.get("num_medusa_layers", 1),
            target.cfg.hidden_size,
            target.cfg.vocab_size,
            config.get("hidden_act", "silu"),
        )
        load_into(heads, engine_state_dict(tensors, "medusa_heads.", ""), f"{engine.path} medusa heads")
        # Heads trained on the frozen LM head carry copies of the target's (the checkpoint format wants one
        # a head): equal in the engine's dtype, they share the target's module and its one product a step.
        target_head = target.lm_head.weight
        own_heads = [h for h in heads if isinstance(h, MedusaHead)]
        shared = all(
            h.lm_head is not None and torch.equal(h.lm_head.weight.to(target_head), target_head) for h in own_heads
        )
        if shared:
            for head in own_heads:
                head.lm_head = None
        tree = None if spec.dynamic_tree else build_tree(_choices(spec)).to(device)
        return MedusaProposer(
            _ready(heads, device, dtype),
            tree,
            target.lm_head if shared else None,
            spec.dynamic_tree,
            spec.max_draft_len,
        )
    if spec.mode == "eagle":
        net = EagleNet(
            model_config(config["eagle_net_config"], tensors, max_positions(engine)),
            fc_bias="eagle_nets.0.drafter.fc.bias" in tensors,
        )
        state = engine_state_dict(tensors, "eagle_nets.0.", "drafter.")
        load_into(net, state, f"{engine.path} eagle draft")
        return _eagle(net, spec, slots, device, dtype)
    if spec.mode == "eagle3":
        return _eagle(load_eagle3(engine.draft_dir, target), spec, slots, device, dtype)
    if spec.mode == "draft_model":
        from pipeline.convert.checkpoint import read_checkpoint

        draft_config, draft_tensors = read_checkpoint(engine.draft_dir)
        draft = build_transformer(draft_config, draft_tensors, str(engine.draft_dir), max_positions(engine))
        return DraftModelProposer(_ready(draft, device, dtype), spec.max_draft_len, slots)
    raise UserError(f"{engine.path}: speculative mode {spec.mode!r} has no portable runtime")


def batched_proposer(
    spec: SpecConfig, proposer: Proposer | None, device: torch.device, dtype: torch.dtype
) -> RowsFactory | None:
    """The batched form of a speculative engine's proposer (None: it has none, or the engine is plain).
    Its tiers: chains up to the proposer's depth, then trees of the engine's choices as deep as that. A
    dynamic tree's engine cuts them from the static tree it was built with (`build --choices`: as deep as
    that tree), else from the default tree at the dynamic depth; its dynamic trees are the largest tier."""
    choices = spec.choices or MC_SIM_7B_63
    if spec.acceptance == "typical":  # Medusa's typical acceptance (not lossless) runs in the serial loop only
        return None
    if isinstance(proposer, EagleProposer):
        net, dynamic, draft_len = proposer.net, proposer.dynamic, proposer.max_draft_len
        depth = max(len(p) for p in spec.choices) if spec.choices else proposer.depth

        def eagle_rows(blocks: int, block_size: int, states: int, max_nodes: int) -> BatchProposer:
            cfg = net.cfg
            pool = BlockPool(net.num_cache_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_size, dtype, device)
            tiers = tier_ladder(choices, max_nodes, depth, device)
            if dynamic is not None:  # EAGLE-2's trees as the largest tier
                tiers.append(Tier.build_dynamic(min(max_nodes, draft_len + 1), dynamic, device))
            return EagleRows(net, tiers, states, pool)

        return eagle_rows
    if isinstance(proposer, MedusaProposer):
        medusa = proposer
        heads = len(medusa.heads)
        medusa_dynamic = (
            None if medusa.dynamic is None else replace(medusa.dynamic, depth=min(medusa.dynamic.depth, heads))
        )

        def medusa_rows(blocks: int, block_size: int, states: int, max_nodes: int) -> BatchProposer:
            tiers = tier_ladder(choices, max_nodes, heads, device)
            if medusa_dynamic is not None:  # its dynamic trees as the largest tier
                tiers.append(Tier.build_dynamic(min(max_nodes, medusa.max_draft_len + 1), medusa_dynamic, device))
            return MedusaRows(medusa.heads, medusa.lm_head, tiers, states)

        return medusa_rows
    if isinstance(proposer, NgramProposer):
        cfg = proposer.cfg

        def ngram_rows(blocks: int, block_size: int, states: int, max_nodes: int) -> BatchProposer:
            return NgramRows(cfg, tier_ladder([], max_nodes, cfg.k, device))

        return ngram_rows
    return None


def max_positions(engine: EngineDir) -> int:
    """Positions a request can reach: the sequence, plus a draft tree's depth past it."""
    return engine.limits.max_seq_len + engine.limits.max_draft_len + 1


def _choices(spec: SpecConfig) -> list[list[int]]:
    assert spec.choices is not None  # SpecConfig sets a static tree's choices
    return spec.choices


M = TypeVar("M", bound=nn.Module)


def _ready(module: M, device: torch.device, dtype: torch.dtype) -> M:
    module = module.to(device, dtype).eval()
    prepare_kernels(module)
    return module


def _eagle(
    net: EagleNet | Eagle3Net, spec: SpecConfig, slots: int, device: torch.device, dtype: torch.dtype
) -> EagleProposer:
    tree = None if spec.dynamic_tree else build_tree(_choices(spec)).to(device)
    return EagleProposer(_ready(net, device, dtype), slots, tree, spec.dynamic_tree, spec.max_draft_len)


# EAGLE-3 drafts stay in the EAGLE reference layout (Hugging Face names) inside draft/.
EAGLE3_RENAMES = {
    "midlayer.self_attn.o_proj.weight": "midlayer.attention.dense.weight",
    "midlayer.mlp.down_proj.weight": "midlayer.mlp.proj.weight",
    "midlayer.post_attention_layernorm.weight": "midlayer.post_layernorm.weight",
    "embed_tokens.weight": "vocab_embedding.weight",
}


def eagle3_capture_layers(num_layers: int) -> tuple[int, ...]:
    """TensorRT-LLM's default Eagle3 capture: the outputs of layers 1, L/2 - 1 and L - 4."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def load_eagle3(draft_dir: Path, target: Transformer) -> Eagle3Net:
    from safetensors.torch import load_file

    hf = read_json(draft_dir / "config.json", "EAGLE-3 draft config", "reconvert with --eagle3")
    tensors = load_file(str(draft_dir / "model.safetensors"))
    t = target.cfg
    cfg = ModelConfig(
        vocab_size=t.vocab_size,
        hidden_size=hf.get("hidden_size", t.hidden_size),
        num_layers=1,
        num_heads=hf.get("num_attention_heads", t.num_heads),
        num_kv_heads=hf.get("num_key_value_heads", t.num_kv_heads),
        head_size=hf.get("head_dim")
        or hf.get("hidden_size", t.hidden_size) // hf.get("num_attention_heads", t.num_heads),
        intermediate_size=hf.get("intermediate_size", t.intermediate_size),
        norm_epsilon=hf.get("rms_norm_eps", t.norm_epsilon),
        rope_theta=t.rope_theta,
        rope_scaling=t.rope_scaling,
        max_position_embeddings=t.max_position_embeddings,
    )
    draft_vocab = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else t.vocab_size
    # TensorRT-LLM's option name, or the name our trainer records; else TensorRT-LLM's default.
    layers = tuple(
        hf.get("eagle3_layers_to_capture")
        or hf.get("fused_target_layer_outputs")
        or eagle3_capture_layers(t.num_layers)
    )
    net = Eagle3Net(cfg, layers, draft_vocab, fc_bias="fc.bias" in tensors)
    state = {}
    qkv = [tensors.pop(f"midlayer.self_attn.{x}_proj.weight") for x in "qkv"]
    state["midlayer.attention.qkv.weight"] = torch.cat(qkv)
    fc, gate = tensors.pop("midlayer.mlp.gate_proj.weight"), tensors.pop("midlayer.mlp.up_proj.weight")
    state["midlayer.mlp.fc_gate.weight"] = torch.cat([fc, gate])
    tensors.pop("t2d", None)  # the inverse map; only d2t is needed to emit target ids
    for name, tensor in tensors.items():
        state[EAGLE3_RENAMES.get(name, name)] = tensor
    state.setdefault("vocab_embedding.weight", target.vocab_embedding.weight.detach())
    state.setdefault("lm_head.weight", target.lm_head.weight.detach())
    state.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.long))
    load_into(net, state, f"{draft_dir} eagle3 draft")
    net.set_d2t(state["d2t"])
    return net
