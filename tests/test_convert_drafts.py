"""Draft inputs: Medusa heads, EAGLE-1/2, EAGLE-3 and draft models convert per the reference, round-trip
exactly through TP shards, and mismatched drafts are refused with a clear error and no output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipeline.builder.build import BuildOptions, build_engine
from pipeline.cli import main
from pipeline.convert.checkpoint import read_checkpoint
from pipeline.convert.convert import DraftInputs, convert
from pipeline.convert.eagle import not_a_later_copy
from pipeline.convert.llama import fuse_qkv, llama_tensors
from pipeline.convert.medusa import load_medusa_tensors, medusa_file
from pipeline.convert.source import load_target
from pipeline.convert.tiny import make_random_eagle, make_random_eagle3, make_random_medusa, make_tiny_model
from pipeline.engine.config import TRTLLM_SPEC_MODE_FLAGS, EngineDir
from pipeline.engine.loader import open_engine
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.engine.tree import MC_SIM_7B_63
from pipeline.errors import UserError

HIDDEN = 64


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path):
    return load_target(tiny_llama_dir)


def rank_shapes(ckpt: Path, rank: int) -> dict[str, list[int]]:
    with safe_open(str(ckpt / f"rank{rank}.safetensors"), "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def assert_no_output(out: Path) -> None:
    assert not out.exists() and not any(out.parent.glob(f".{out.name}.tmp-*"))


# ---- Medusa ----


def _medusa_source_names(fmt: str, h: int, layer: int, layers: int) -> tuple[str, str, str]:
    if fmt == "vllm":
        return f"blocks.{h}.layers.{layer}.weight", f"blocks.{h}.layers.{layer}.bias", f"lm_heads.{h}.weight"
    prefix = "medusa_heads." if fmt == "modelopt" else ""
    return f"{prefix}{h}.{layer}.linear.weight", f"{prefix}{h}.{layer}.linear.bias", f"{prefix}{h}.{layers}.weight"


@pytest.mark.parametrize("fmt", ["reference", "reference_pt", "modelopt", "vllm"])
def test_medusa_formats_convert_per_reference(fmt: str, target, tmp_path: Path) -> None:
    vocab = target.config.vocab_size
    heads_dir = make_random_medusa(tmp_path / "heads", HIDDEN, vocab, heads=5, layers=2, fmt=fmt, config_heads=4)
    ckpt = convert(target, tmp_path / "ckpt", tp=2, drafts=DraftInputs(medusa=str(heads_dir)))
    cfg, t = read_checkpoint(ckpt)
    assert cfg["architecture"] == "MedusaForCausalLM" and cfg["model_type"] == "llama"
    assert (cfg["num_medusa_heads"], cfg["num_medusa_layers"], cfg["max_draft_len"]) == (
        5,
        2,
        63,
    )  # tensors win over config
    src = load_medusa_tensors(medusa_file(heads_dir))
    for h in range(5):
        for layer in range(2):
            w, b, _ = _medusa_source_names(fmt, h, layer, 2)
            assert torch.equal(t[f"medusa_heads.{h}.medusa_layers.{layer}.linear.weight"], src[w])
            assert torch.equal(t[f"medusa_heads.{h}.medusa_layers.{layer}.linear.bias"], src[b])
        assert torch.equal(t[f"medusa_heads.{h}.lm_head.weight"], src[_medusa_source_names(fmt, h, 0, 2)[2]])
    base = llama_tensors(target, torch.float32)
    assert all(torch.equal(t[k], v) for k, v in base.items())
    s = rank_shapes(ckpt, 1)
    assert s["medusa_heads.0.medusa_layers.1.linear.weight"] == [HIDDEN // 2, HIDDEN]
    assert s["medusa_heads.0.medusa_layers.1.linear.bias"] == [HIDDEN // 2]
    assert s["medusa_heads.4.lm_head.weight"] == [(vocab + 1) // 2, HIDDEN]


def test_medusa_without_lm_head_uses_targets(target, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    heads_dir = make_random_medusa(tmp_path / "heads", HIDDEN, target.config.vocab_size, heads=4, with_lm_head=False)
    _, t = read_checkpoint(
        convert(target, tmp_path / "ckpt", drafts=DraftInputs(medusa=str(heads_dir), num_medusa_heads=3))
    )
    assert "using the target's lm_head" in capsys.readouterr().out
    assert sorted({k.split(".")[1] for k in t if k.startswith("medusa_heads.")}) == ["0", "1", "2"]
    assert torch.equal(t["medusa_heads.2.lm_head.weight"], target.lm_head)


def test_medusa_rotary_scaling_is_reduced_to_type(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "m", num_hidden_layers=2, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    )
    source = load_target(model)
    heads = make_random_medusa(tmp_path / "heads", HIDDEN, source.config.vocab_size, heads=2)
    cfg, _ = read_checkpoint(convert(source, tmp_path / "ckpt", drafts=DraftInputs(medusa=str(heads))))
    assert cfg["rotary_scaling"] == {"type": "linear"}


@pytest.mark.parametrize(
    "hidden,vocab_delta,message",
    [
        (32, 0, "head 0 layer 0 weight has shape [32, 32] but the target needs [64, 64]"),
        (HIDDEN, 7, "head 0 lm_head has shape"),
    ],
)
def test_medusa_mismatched_heads_are_refused(
    hidden: int,
    vocab_delta: int,
    message: str,
    target,
    tiny_llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    heads = make_random_medusa(tmp_path / "heads", hidden, target.config.vocab_size + vocab_delta, heads=2)
    out = tmp_path / "out" / "ckpt"
    rc = main(["convert", "--target", str(tiny_llama_dir), "--medusa", str(heads), "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert_no_output(out)


def test_medusa_engine_and_trtllm_command(target, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    heads = make_random_medusa(tmp_path / "heads", HIDDEN, target.config.vocab_size, heads=4)
    ckpt = convert(target, tmp_path / "ckpt", drafts=DraftInputs(medusa=str(heads)))
    engine = EngineDir.load(build_engine(ckpt, tmp_path / "engine"))
    assert engine.spec.mode == "medusa" and engine.spec.num_medusa_heads == 4 and engine.spec.choices == MC_SIM_7B_63
    assert engine.build_config["speculative_decoding_mode"] == TRTLLM_SPEC_MODE_FLAGS["medusa"]
    assert engine.limits.max_draft_len == 63 and engine.limits.max_seq_len == 2048 + 63
    assert (
        main(["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "t"), "--backend", "trtllm", "--dry-run"])
        == 0
    )
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith("--gemm_plugin auto --speculative_decoding_mode medusa --max_draft_len 63")
    )
    with pytest.raises(UserError, match="63 nodes exceed max_draft_len 8"):
        build_engine(ckpt, tmp_path / "e2", opts=BuildOptions(max_draft_len=8))
    assert_no_output(tmp_path / "e2")
    dynamic = EngineDir.load(
        build_engine(ckpt, tmp_path / "dyn", opts=BuildOptions(dynamic_tree=True, dynamic_top_k=16))
    )
    assert (
        dynamic.spec.choices is None and dynamic.spec.dynamic_tree.depth == 4 and dynamic.spec.dynamic_tree.top_k == 16
    )
    with pytest.raises(UserError, match="Medusa runs in the portable engine only"):  # TensorRT-LLM's Medusa is static
        build_engine(ckpt, tmp_path / "t2", "trtllm", BuildOptions(dynamic_tree=True), dry_run=True)
    with pytest.raises(UserError, match="exceeds num_medusa_heads 4"):
        build_engine(ckpt, tmp_path / "e3", opts=BuildOptions(dynamic_tree=True, dynamic_depth=5))
    assert_no_output(tmp_path / "e3")


# ---- EAGLE-1/2 ----


@pytest.mark.parametrize("fmt,with_embedding", [("safetensors", True), ("bin", False)])
def test_eagle_converts_per_reference(fmt: str, with_embedding: bool, target, tmp_path: Path) -> None:
    draft_dir = make_random_eagle(
        tmp_path / "eagle", HIDDEN, target.config.vocab_size, layers=2, fmt=fmt, with_embedding=with_embedding
    )
    ckpt = convert(
        target, tmp_path / "ckpt", tp=2, drafts=DraftInputs(eagle=str(draft_dir), max_non_leaves_per_layer=12)
    )
    cfg, t = read_checkpoint(ckpt)
    assert cfg["architecture"] == "EagleForCausalLM"
    assert (cfg["num_eagle_layers"], cfg["max_draft_len"], cfg["max_non_leaves_per_layer"]) == (4, 63, 12)
    net = cfg["eagle_net_config"]
    assert net["architecture"] == "LlamaForCausalLM" and net["num_hidden_layers"] == 2 and net["hidden_size"] == HIDDEN
    assert net["vocab_size"] == cfg["vocab_size"] and net["rotary_base"] == cfg["rotary_base"]
    src = (
        load_file(str(draft_dir / "model.safetensors"))
        if fmt == "safetensors"
        else torch.load(draft_dir / "pytorch_model.bin")
    )
    emb = src["embed_tokens.weight"] if with_embedding else target.state_dict["model.embed_tokens.weight"]
    for i in range(4):
        p = f"eagle_nets.{i}.drafter."
        assert torch.equal(t[p + "fc.weight"], src["fc.weight"]) and torch.equal(t[p + "fc.bias"], src["fc.bias"])
        assert torch.equal(t[p + "vocab_embedding.weight"], emb)
        assert torch.equal(
            t[p + "layers.1.attention.qkv.weight"],
            fuse_qkv(*(src[f"layers.1.self_attn.{x}_proj.weight"] for x in "qkv")),
        )
        assert torch.equal(t[p + "layers.0.mlp.fc.weight"], src["layers.0.mlp.gate_proj.weight"])
        assert p + "layers.0.input_layernorm.weight" not in t and p + "layers.1.input_layernorm.weight" in t
        assert torch.equal(t[f"eagle_nets.{i}.lm_head.weight"], target.lm_head)
    s = rank_shapes(ckpt, 0)
    assert s["eagle_nets.3.drafter.fc.weight"] == [HIDDEN // 2, 2 * HIDDEN]
    assert s["eagle_nets.3.lm_head.weight"] == [(cfg["vocab_size"] + 1) // 2, HIDDEN]
    # The portable engine reads the first copy only (the others cost memory at load, never used).
    _, first = read_checkpoint(ckpt, keep=not_a_later_copy)
    assert {k for k in t if not k.startswith("eagle_nets.") or k.startswith("eagle_nets.0.")} == set(first)


def test_eagle_refusals(target, tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = make_random_eagle(tmp_path / "wrong", 32, target.config.vocab_size, inter=64, heads=2, kv_heads=1)
    out = tmp_path / "out" / "ckpt"
    assert main(["convert", "--target", str(tiny_llama_dir), "--eagle", str(wrong), "--output", str(out)]) == 2
    assert "hidden_size 32 does not match the target's 64" in capsys.readouterr().err
    good = make_random_eagle(tmp_path / "good", HIDDEN, target.config.vocab_size)
    assert (
        main(["convert", "--target", str(tiny_llama_dir), "--eagle", str(good), "--pp-size", "2", "--output", str(out)])
        == 2
    )
    assert "EAGLE checkpoints need pp_size 1" in capsys.readouterr().err
    assert_no_output(out)


def test_eagle_engines_static_and_dynamic(target, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft_dir = make_random_eagle(tmp_path / "eagle", HIDDEN, target.config.vocab_size)
    ckpt = convert(target, tmp_path / "ckpt", drafts=DraftInputs(eagle=str(draft_dir)))
    static = EngineDir.load(build_engine(ckpt, tmp_path / "static"))
    assert static.spec.mode == "eagle" and static.spec.choices == MC_SIM_7B_63
    assert static.build_config["speculative_decoding_mode"] == TRTLLM_SPEC_MODE_FLAGS["eagle"]
    assert static.limits.max_seq_len == 2048 + 63 + 4
    dynamic = EngineDir.load(
        build_engine(ckpt, tmp_path / "dyn", opts=BuildOptions(dynamic_tree=True, dynamic_top_k=4))
    )
    assert (
        dynamic.spec.choices is None and dynamic.spec.dynamic_tree.top_k == 4 and dynamic.spec.dynamic_tree.depth == 4
    )
    assert dynamic.spec.dynamic_tree.max_non_leaves_per_layer == 10
    # --choices beside --dynamic-tree: the tree batched steps cut their static tiers from, as deep as it (else
    # mc_sim_7b_63's at the dynamic depth, 4); EAGLE-2's own trees stay the largest tier.
    capsys.readouterr()
    fitted = [[1], [0], [1, 0], [0, 0], [2]]
    argv = ["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "fit"), "--dynamic-tree"]
    assert main([*argv, "--choices", json.dumps(fitted)]) == 0
    assert "; batched steps' --choices list, depth 2, 5 nodes" in capsys.readouterr().out
    both = open_engine(tmp_path / "fit", serving=SchedulerConfig())
    assert both.spec.dynamic_tree is not None and both.spec.choices == fitted
    assert both.scheduler.controller.names == ["plain", "chain1", "chain2", "tree6", "dynamic64"]
    with pytest.raises(UserError, match="exceeds num_eagle_layers 4"):
        build_engine(ckpt, tmp_path / "bad", opts=BuildOptions(dynamic_tree=True, dynamic_depth=6))
    with pytest.raises(UserError, match="non-leaf nodes at depth 1 exceed max_non_leaves_per_layer 3"):
        build_engine(ckpt, tmp_path / "bad", opts=BuildOptions(choices="wide8x2", max_non_leaves_per_layer=3))
    assert (
        main(
            [
                "build",
                "--checkpoint",
                str(ckpt),
                "--output",
                str(tmp_path / "t"),
                "--backend",
                "trtllm",
                "--dry-run",
                "--max-draft-len",
                "16",
                "--choices",
                "top16",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip().endswith("--speculative_decoding_mode eagle --max_draft_len 16")


# ---- EAGLE-3 ----


def test_eagle3_draft_is_kept_beside_a_plain_target(target, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft_dir = make_random_eagle3(tmp_path / "e3", HIDDEN, target.config.vocab_size, draft_vocab=100)
    ckpt = convert(target, tmp_path / "ckpt", dtype="float16", drafts=DraftInputs(eagle3=str(draft_dir)))
    cfg, t = read_checkpoint(ckpt)
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["dtype"] == "float16"
    draft_cfg = json.loads((ckpt / "draft" / "config.json").read_text())
    assert draft_cfg["architectures"] == ["LlamaForCausalLMEagle3"] and draft_cfg["draft_vocab_size"] == 100
    src, out = load_file(str(draft_dir / "model.safetensors")), load_file(str(ckpt / "draft" / "model.safetensors"))
    assert sorted(src) == sorted(out) and out["d2t"].dtype == torch.int64 and out["t2d"].dtype == torch.bool
    assert torch.equal(out["d2t"], src["d2t"]) and torch.equal(out["fc.weight"], src["fc.weight"].half())
    engine = EngineDir.load(build_engine(ckpt, tmp_path / "engine", opts=BuildOptions(dynamic_tree=True)))
    assert engine.spec.mode == "eagle3" and (engine.draft_dir / "model.safetensors").is_file()
    assert (
        main(["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "t"), "--backend", "trtllm", "--dry-run"])
        == 2
    )
    assert "Eagle3DecodingConfig" in capsys.readouterr().err


def test_eagle3_draft_vocab_keeps_the_most_frequent_response_tokens(
    target, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    vocab = target.config.vocab_size
    draft_dir = make_random_eagle3(tmp_path / "e3", HIDDEN, vocab, with_lm_head=False)  # as SmolLM2's: the target's
    # Two rows as DistillSet.save_tokens writes them: prompts of 2 and 1 tokens (4 4 | 4: not counted), responses
    # 5 5 5 7 7 9 | 3 3 3 3 1 1 9. Counts 3: 4, 5: 3, then 1, 7 and 9 tie on 2, where the lower ids win.
    rows = [[4, 4, 5, 5, 5, 7, 7, 9], [4, 3, 3, 3, 3, 1, 1, 9]]
    tokens = tmp_path / "tokens.npz"
    np.savez(
        tokens, tokens=np.array(sum(rows, []), dtype=np.uint16), lengths=np.array([8, 8]), prompt_lens=np.array([2, 1])
    )
    ckpt = convert(
        target, tmp_path / "ckpt", drafts=DraftInputs(eagle3=str(draft_dir), draft_vocab=4, vocab_tokens=str(tokens))
    )
    draft_cfg = json.loads((ckpt / "draft" / "config.json").read_text())
    out = load_file(str(ckpt / "draft" / "model.safetensors"))
    kept = torch.tensor([1, 3, 5, 7])
    assert draft_cfg["draft_vocab_size"] == 4 and torch.equal(out["d2t"] + torch.arange(4), kept)
    assert torch.equal(out["lm_head.weight"], target.lm_head[kept]) and out["t2d"].sum() == 4 and out["t2d"][kept].all()
    assert (
        main(
            [
                "convert",
                "--target",
                str(tiny_llama_dir),
                "--output",
                str(tmp_path / "cli"),
                "--eagle3",
                str(draft_dir),
                "--draft-vocab",
                "4",
                "--vocab-tokens",
                str(tokens),
            ]
        )
        == 0
    )
    assert torch.equal(load_file(str(tmp_path / "cli" / "draft" / "model.safetensors"))["d2t"], out["d2t"])
    # (Such drafts' greedy speculation is lossless: tests/test_speculative.py's small-vocab case, whose tiny draft
    # make_random_eagle3 reduces through the same reduce_vocab.)
    for drafts, message in [
        (DraftInputs(eagle3=str(draft_dir), draft_vocab=4), "go together"),
        (DraftInputs(eagle3=str(draft_dir), draft_vocab=vocab, vocab_tokens=str(tokens)), f"between 1 and {vocab - 1}"),
        (
            DraftInputs(eagle3=str(draft_dir), draft_vocab=4, vocab_tokens=str(tmp_path / "no.npz")),
            "token file not found",
        ),
        (
            DraftInputs(
                eagle=str(make_random_eagle(tmp_path / "e2", HIDDEN, vocab)), draft_vocab=4, vocab_tokens=str(tokens)
            ),
            "only EAGLE-3 drafts",
        ),
    ]:
        with pytest.raises(UserError, match=message):
            convert(target, tmp_path / "bad", drafts=drafts)
        assert_no_output(tmp_path / "bad")
    np.savez(tokens, tokens=np.array([vocab + 1], dtype=np.int64))
    with pytest.raises(UserError, match=f"outside the target's vocabulary of {vocab}"):
        convert(
            target, tmp_path / "bad", drafts=DraftInputs(eagle3=str(draft_dir), draft_vocab=4, vocab_tokens=str(tokens))
        )


def test_eagle3_mismatch_is_refused(target, tmp_path: Path) -> None:
    draft_dir = make_random_eagle3(tmp_path / "e3", 32, target.config.vocab_size, inter=64, heads=2, kv_heads=1)
    with pytest.raises(UserError, match=r"tensor fc.weight has shape \[32, 96\] but the target needs \[32, 192\]"):
        convert(target, tmp_path / "ckpt", drafts=DraftInputs(eagle3=str(draft_dir)))
    assert_no_output(tmp_path / "ckpt")


# ---- draft model ----


def test_draft_model_without_embeddings_borrows_targets(
    target, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    draft_dir = make_tiny_model(tmp_path / "draft", num_hidden_layers=1, seed=7)
    weights = load_file(str(draft_dir / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights.pop(name)
    save_file(weights, str(draft_dir / "model.safetensors"))
    ckpt = convert(target, tmp_path / "ckpt", tp=2, drafts=DraftInputs(draft_model=str(draft_dir)))
    assert "using the target's" in capsys.readouterr().out
    draft_cfg, d = read_checkpoint(ckpt / "draft")
    assert draft_cfg["num_hidden_layers"] == 1 and draft_cfg["mapping"]["tp_size"] == 2
    assert torch.equal(d["lm_head.weight"], target.lm_head)
    assert torch.equal(d["transformer.layers.0.mlp.proj.weight"], weights["model.layers.0.mlp.down_proj.weight"])
    engine = EngineDir.load(build_engine(ckpt, tmp_path / "engine", opts=BuildOptions(max_draft_len=3)))
    assert engine.spec.mode == "draft_model" and engine.spec.choices == [[0], [0, 0], [0, 0, 0]]
    assert EngineDir.load(engine.draft_dir).spec.mode == "none"
    assert (
        main(
            [
                "build",
                "--checkpoint",
                str(ckpt),
                "--output",
                str(tmp_path / "t"),
                "--backend",
                "trtllm",
                "--dry-run",
                "--max-draft-len",
                "3",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "--speculative_decoding_mode draft_tokens_external --max_draft_len 3" in lines[0]
    assert f"--checkpoint_dir {ckpt / 'draft'} --output_dir {tmp_path / 't' / 'draft'}" in lines[1]


def test_draft_model_with_other_vocabulary_is_refused(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = make_tiny_model(tmp_path / "other", num_hidden_layers=1, vocab_size=600)
    out = tmp_path / "out" / "ckpt"
    assert main(["convert", "--target", str(tiny_llama_dir), "--draft-model", str(other), "--output", str(out)]) == 2
    assert "draft vocab_size 600 differs from the target's" in capsys.readouterr().err
    assert_no_output(out)


def test_only_one_draft_input(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "convert",
                "--target",
                str(tiny_llama_dir),
                "--medusa",
                "a",
                "--eagle",
                "b",
                "--output",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "give at most one draft input" in capsys.readouterr().err
