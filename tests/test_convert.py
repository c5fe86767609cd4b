"""Converter: TensorRT-LLM names, shapes and config fields; TP/PP shards merge back exactly; clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.cli import main
from pipeline.convert.checkpoint import read_checkpoint
from pipeline.convert.convert import convert
from pipeline.convert.llama import fuse_qkv, llama_tensors
from pipeline.convert.shard import ShardLayout, merge_qkv, merge_vocab, padded_vocab, split_qkv, split_vocab
from pipeline.convert.source import export_hf_folder, load_target, rope_settings
from pipeline.convert.tiny import make_tiny_model
from pipeline.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def rank_shapes(ckpt: Path, rank: int) -> dict[str, list[int]]:
    with safe_open(str(ckpt / f"rank{rank}.safetensors"), "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def test_llama_checkpoint_names_shapes_and_fields(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ckpt = convert(tiny_llama_dir, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    hf = json.loads((tiny_llama_dir / "config.json").read_text())
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["dtype"] == "float32" and cfg["logits_dtype"] == "float32"
    assert cfg["vocab_size"] == hf["vocab_size"] and cfg["hidden_size"] == 64 and cfg["intermediate_size"] == 128
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]) == (4, 2, 16)
    assert cfg["norm_epsilon"] == hf["rms_norm_eps"] and cfg["position_embedding_type"] == "rope_gpt_neox"
    assert cfg["rotary_base"] == 10000.0 and cfg["rotary_scaling"] is None and cfg["tie_word_embeddings"] is False
    assert cfg["mapping"]["world_size"] == 1 and cfg["mapping"]["tp_size"] == 1 and cfg["mapping"]["pp_size"] == 1
    assert cfg["quantization"]["quant_algo"] is None and cfg["quantization"]["kv_cache_quant_algo"] is None
    assert cfg["attn_bias"] is False and cfg["use_parallel_embedding"] is False and cfg["embedding_sharding_dim"] == 0
    shapes = rank_shapes(ckpt, 0)
    v = hf["vocab_size"]
    expected = {
        "transformer.vocab_embedding.weight": [v, 64],
        "transformer.ln_f.weight": [64],
        "lm_head.weight": [v, 64],
    }
    for i in range(4):
        p = f"transformer.layers.{i}."
        expected.update(
            {
                p + "input_layernorm.weight": [64],
                p + "attention.qkv.weight": [(4 + 2 * 2) * 16, 64],
                p + "attention.dense.weight": [64, 64],
                p + "post_layernorm.weight": [64],
                p + "mlp.fc.weight": [128, 64],
                p + "mlp.gate.weight": [128, 64],
                p + "mlp.proj.weight": [64, 128],
            }
        )
    assert shapes == expected
    assert not (ckpt / "rank1.safetensors").exists()


def test_weights_follow_the_reference_mapping(tiny_llama_dir: Path, tmp_path: Path) -> None:
    source = load_target(tiny_llama_dir)
    _, t = read_checkpoint(convert(source, tmp_path / "ckpt"))
    sd = source.state_dict
    p = "model.layers.1."
    assert torch.equal(
        t["transformer.layers.1.attention.qkv.weight"],
        torch.cat(
            [sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"]]
        ),
    )
    assert torch.equal(t["transformer.layers.1.mlp.fc.weight"], sd[p + "mlp.gate_proj.weight"])
    assert torch.equal(t["transformer.layers.1.mlp.gate.weight"], sd[p + "mlp.up_proj.weight"])
    assert torch.equal(t["transformer.layers.1.mlp.proj.weight"], sd[p + "mlp.down_proj.weight"])
    assert torch.equal(t["transformer.layers.1.attention.dense.weight"], sd[p + "self_attn.o_proj.weight"])
    assert torch.equal(t["transformer.layers.1.post_layernorm.weight"], sd[p + "post_attention_layernorm.weight"])
    assert torch.equal(t["lm_head.weight"], sd["lm_head.weight"])
    assert torch.equal(t["transformer.ln_f.weight"], sd["model.norm.weight"])


def test_qwen2_checkpoint_has_qkv_bias_and_tied_head(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    source = load_target(tiny_qwen2_dir)
    cfg, t = read_checkpoint(convert(source, tmp_path / "ckpt"))
    assert cfg["architecture"] == "Qwen2ForCausalLM" and cfg["qwen_type"] == "qwen2" and cfg["attn_bias"] is True
    assert cfg["tie_word_embeddings"] is True
    assert "transformer.layers.0.attention.dense.bias" not in t
    p = "model.layers.0.self_attn."
    assert torch.equal(
        t["transformer.layers.0.attention.qkv.bias"],
        torch.cat([source.state_dict[p + f"{x}_proj.bias"] for x in "qkv"]),
    )
    assert torch.equal(t["lm_head.weight"], t["transformer.vocab_embedding.weight"])


@pytest.mark.parametrize("arch_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (2, 2), (1, 4)])
def test_tp_pp_shards_merge_back_exactly(
    arch_fixture: str, tp: int, pp: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    source = load_target(request.getfixturevalue(arch_fixture))
    ckpt = convert(source, tmp_path / "ckpt", tp=tp, pp=pp)
    cfg, merged = read_checkpoint(ckpt)
    full = llama_tensors(source, torch.float32)
    assert cfg["mapping"]["world_size"] == tp * pp and sorted(merged) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name
    per_stage = 4 // pp
    last = rank_shapes(ckpt, tp * pp - 1)
    first = rank_shapes(ckpt, 0)
    assert ("transformer.vocab_embedding.weight" in first) and (("lm_head.weight" in first) == (pp == 1))
    assert last["lm_head.weight"] == [padded_vocab(cfg["vocab_size"], tp) // tp, 64]
    assert sorted({k.split(".")[2] for k in last if k.startswith("transformer.layers.")}) == [
        str(i) for i in range(per_stage)
    ]


def test_tp_rank_layout_qkv_dense_vocab(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ckpt = convert(tiny_llama_dir, tmp_path / "ckpt", tp=2)
    s = rank_shapes(ckpt, 1)
    assert s["transformer.layers.0.attention.qkv.weight"] == [(4 + 2 * 2) * 16 // 2, 64]
    assert s["transformer.layers.0.attention.dense.weight"] == [64, 32]
    assert s["transformer.layers.0.mlp.fc.weight"] == [64, 64] and s["transformer.layers.0.mlp.proj.weight"] == [64, 64]
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    assert vocab % 2 == 1, "tiny vocab is odd so padding is exercised"
    assert s["lm_head.weight"] == [(vocab + 1) // 2, 64] and s["transformer.vocab_embedding.weight"] == [vocab, 64]


def test_split_qkv_replicates_kv_heads_when_fewer_than_ranks() -> None:
    lay = ShardLayout(tp=4, num_heads=4, num_kv_heads=2, head_size=3, vocab_size=10)
    q, k, v = torch.arange(12.0)[:, None], 100 + torch.arange(6.0)[:, None], 200 + torch.arange(6.0)[:, None]
    parts = split_qkv(fuse_qkv(q, k, v), lay, "qkv")
    assert [p.shape[0] for p in parts] == [3 + 3 + 3] * 4
    assert torch.equal(parts[1][3:6], k[0:3]) and torch.equal(parts[2][3:6], k[3:6])  # rank r holds KV head r // 2
    assert torch.equal(merge_qkv(parts, lay, "qkv"), fuse_qkv(q, k, v))


def test_split_vocab_pads_with_zero_rows() -> None:
    lay = ShardLayout(tp=4, num_heads=1, num_kv_heads=1, head_size=1, vocab_size=10)
    t = torch.randn(10, 2)
    parts = split_vocab(t, lay, "lm_head.weight")
    assert [p.shape[0] for p in parts] == [3] * 4 and torch.equal(parts[-1][1:], torch.zeros(2, 2))
    assert torch.equal(merge_vocab(parts, lay, "lm_head.weight"), t)


def test_dtype_rope_scaling_and_tokenizer(tmp_path: Path) -> None:
    scaling = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    model = make_tiny_model(tmp_path / "m", num_hidden_layers=2, rope_parameters=scaling)
    ckpt = convert(model, tmp_path / "ckpt", dtype="bfloat16")
    cfg, t = read_checkpoint(ckpt)
    assert cfg["dtype"] == "bfloat16" and all(x.dtype == torch.bfloat16 for x in t.values())
    assert cfg["rotary_base"] == 5000.0
    assert cfg["rotary_scaling"]["type"] == "linear" and cfg["rotary_scaling"]["factor"] == 2.0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt / "tokenizer")
    assert tok.chat_template and tok("Hello world").input_ids == load_target(model).tokenizer("Hello world").input_ids


def test_export_hf_folder_keeps_rope_theta(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "m", num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 12345.0}
    )
    out = export_hf_folder(model, tmp_path / "hf")
    saved = json.loads((out / "config.json").read_text())
    assert (
        "quantization_config" not in saved and (out / "model.safetensors").is_file() and saved["rope_theta"] == 12345.0
    )
    assert rope_settings(load_target(out).config)[0] == 12345.0


# ---- bad inputs: one clear line, exit code 2, no output folder ----


def _break_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _truncate(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return dst


BAD_INPUTS = {
    "missing folder": (lambda src, tmp: tmp / "nope", [], "nope: target not found"),
    "unsupported architecture": (
        lambda src, tmp: _break_config(src, tmp / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"]),
        [],
        "unsupported architecture",
    ),
    "config does not match weights": (
        lambda src, tmp: _break_config(src, tmp / "bad", intermediate_size=96),
        [],
        "mlp.gate_proj.weight has shape [128, 64] but config.json implies [96, 64]",
    ),
    "truncated safetensors": (
        lambda src, tmp: _truncate(src, tmp / "trunc"),
        [],
        "model.safetensors: cannot read safetensors",
    ),
    "unknown dtype": (lambda src, tmp: src, ["--dtype", "fp8"], "--dtype 'fp8': unknown dtype"),
    "tp does not divide heads": (
        lambda src, tmp: src,
        ["--tp-size", "3"],
        "--tp-size 3: does not divide the target's num_attention_heads 4",
    ),
    "pp does not divide layers": (
        lambda src, tmp: src,
        ["--pp-size", "3"],
        "--pp-size 3: does not divide the target's num_hidden_layers 4",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_give_one_clear_line(
    case: str, tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_target, extra, message = BAD_INPUTS[case]
    target = make_target(tiny_llama_dir, tmp_path)
    out = tmp_path / "out" / "ckpt"
    rc = main(["convert", "--target", str(target), "--output", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err
    assert not out.exists() and (not out.parent.exists() or not any(out.parent.iterdir()))


def test_cli_subprocess_exit_code(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "convert", "--target", str(tmp_path / "missing"), "--output", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert (
        proc.returncode == 2
        and proc.stderr.strip().startswith("specpipe convert: error:")
        and "target not found" in proc.stderr
    )
    assert not out.exists()


def test_read_checkpoint_errors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ckpt = convert(tiny_llama_dir, tmp_path / "ckpt", tp=2)
    rank1 = ckpt / "rank1.safetensors"
    data = rank1.read_bytes()
    rank1.write_bytes(data[: len(data) // 3])
    with pytest.raises(UserError, match="rank1.safetensors: cannot read safetensors"):
        read_checkpoint(ckpt)
    rank1.unlink()
    with pytest.raises(UserError, match="rank1.safetensors: missing"):
        read_checkpoint(ckpt)
    with pytest.raises(UserError, match="checkpoint folder not found"):
        read_checkpoint(tmp_path / "none")


@pytest.mark.slow
def test_smollm2_checkpoint_round_trip(smollm2_source, smollm2_checkpoint: Path, smollm2_hf) -> None:
    cfg, t = read_checkpoint(smollm2_checkpoint)
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["tie_word_embeddings"] is True
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (49152, 576, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rotary_base"]) == (9, 3, 100000.0)
    full = llama_tensors(smollm2_source, torch.float32)
    assert sorted(t) == sorted(full) and all(torch.equal(t[k], full[k]) for k in full)
    hf_sd = smollm2_hf.state_dict()
    assert torch.equal(hf_sd["model.layers.3.mlp.up_proj.weight"], t["transformer.layers.3.mlp.gate.weight"])
    assert (smollm2_checkpoint / "tokenizer" / "tokenizer.json").is_file()
