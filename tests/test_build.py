"""Engine builder: portable engine directories, trtllm-build command lines, atomic failures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import convert_and_build

from pipeline.builder.build import BuildOptions, build_engine
from pipeline.cli import main
from pipeline.convert.checkpoint import read_checkpoint
from pipeline.convert.convert import convert
from pipeline.convert.tiny import make_random_medusa
from pipeline.engine.config import TRTLLM_SPEC_MODE_FLAGS, EngineDir
from pipeline.engine.tree import MC_SIM_7B_63, validate_choices
from pipeline.errors import USER_ERROR_EXIT_CODE, UserError


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(tiny_llama_dir, tmp_path_factory.mktemp("build") / "ckpt", tp=2)


def test_portable_engine_directory(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = build_engine(
        tiny_ckpt, tmp_path / "engine", "portable", BuildOptions(max_batch_size=4, max_input_len=100, max_seq_len=300)
    )
    engine = EngineDir.load(out)
    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg) == {"version", "pretrained_config", "build_config"}
    assert cfg["pretrained_config"] == json.loads((tiny_ckpt / "config.json").read_text())
    b = cfg["build_config"]
    assert (b["max_batch_size"], b["max_input_len"], b["max_seq_len"], b["max_draft_len"]) == (4, 100, 300, 0)
    assert b["speculative_decoding_mode"] == TRTLLM_SPEC_MODE_FLAGS["none"] and b["kv_cache_type"] == "PAGED"
    assert b["plugin_config"]["gemm_plugin"] == "float32" and b["max_num_tokens"] == 8192
    assert engine.backend == "portable" and engine.spec.mode == "none"
    assert (out / "rank0.safetensors").stat().st_size == (tiny_ckpt / "rank0.safetensors").stat().st_size
    assert (out / "rank1.safetensors").is_file() and (engine.tokenizer_dir / "tokenizer.json").is_file()
    engine_cfg, engine_tensors = read_checkpoint(out)
    ckpt_cfg, ckpt_tensors = read_checkpoint(tiny_ckpt)
    assert engine_cfg == ckpt_cfg and all(torch.equal(engine_tensors[k], v) for k, v in ckpt_tensors.items())


def test_ngram_engine_records_spec(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = build_engine(tiny_ckpt, tmp_path / "engine", opts=BuildOptions(speculative="ngram", ngram_k=3, ngram_max_n=2))
    engine = EngineDir.load(out)
    assert engine.spec.mode == "ngram" and engine.spec.ngram.k == 3 and engine.spec.ngram.max_n == 2
    assert engine.spec.choices == [[0], [0, 0], [0, 0, 0]] and engine.limits.max_draft_len == 3
    assert engine.build_config["speculative_decoding_mode"] == TRTLLM_SPEC_MODE_FLAGS["draft_tokens_external"]
    assert engine.limits.max_seq_len == BuildOptions.max_seq_len + 3


def test_trtllm_dry_run_prints_exact_command(
    tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine"
    rc = main(
        [
            "build",
            "--checkpoint",
            str(tiny_ckpt),
            "--output",
            str(out),
            "--backend",
            "trtllm",
            "--dry-run",
            "--max-batch-size",
            "4",
            "--max-seq-len",
            "512",
            "--max-input-len",
            "256",
        ]
    )
    assert rc == 0 and not out.exists()
    assert capsys.readouterr().out.strip() == (
        f"trtllm-build --checkpoint_dir {tiny_ckpt} --output_dir {out} --max_batch_size 4 --max_input_len 256 "
        "--max_seq_len 512 --gemm_plugin auto"
    )


@pytest.mark.skipif(shutil.which("trtllm-build") is not None, reason="TensorRT-LLM is installed here")
def test_trtllm_without_tensorrt_llm_exits_2_and_leaves_nothing(
    tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engines" / "tiny-trtllm"
    rc = main(["build", "--checkpoint", str(tiny_ckpt), "--output", str(out), "--backend", "trtllm"])
    err = capsys.readouterr().err.strip()
    assert (
        rc == 2
        and "TensorRT-LLM is not installed" in err
        and "--backend portable" in err
        and len(err.splitlines()) == 1
    )
    assert not out.exists() and (not out.parent.exists() or not any(out.parent.iterdir()))


def test_failed_build_leaves_nothing(tiny_ckpt: Path, tmp_path: Path) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, broken)
    (broken / "rank1.safetensors").unlink()
    with pytest.raises(UserError, match="rank1.safetensors: missing"):
        build_engine(broken, tmp_path / "engines" / "e")
    assert not any((tmp_path / "engines").iterdir())


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--dynamic-tree"], "--dynamic-tree: only Medusa and EAGLE"),
        (["--choices", "top16"], "--choices: only Medusa and EAGLE"),
        (["--max-input-len", "4096"], "--max-input-len 4096 exceeds --max-seq-len 2048"),
        (["--speculative", "medusa"], "--speculative 'medusa'"),
        (["--backend", "tensorrt"], "--backend 'tensorrt'"),
    ],
)
def test_build_flag_errors(
    flags: list[str], message: str, tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine"
    rc = main(["build", "--checkpoint", str(tiny_ckpt), "--output", str(out), *flags])
    assert rc == 2 and message in capsys.readouterr().err and not out.exists()


def test_three_head_medusa_builds_with_the_default_tree_trimmed(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default tree is 4 deep: a 3-head checkpoint gets its paths up to depth 3, and the build says so."""
    heads_count = 3
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    heads = make_random_medusa(tmp_path / "heads", cfg["hidden_size"], cfg["vocab_size"], heads=heads_count)
    ckpt, out = tmp_path / "ckpt", tmp_path / "engine"
    assert main(["convert", "--target", str(tiny_llama_dir), "--medusa", str(heads), "--output", str(ckpt)]) == 0
    capsys.readouterr()
    assert main(["build", "--checkpoint", str(ckpt), "--output", str(out)]) == 0
    expected = [p for p in MC_SIM_7B_63 if len(p) <= heads_count]
    spec = EngineDir.load(out).spec
    assert spec.mode == "medusa" and spec.num_medusa_heads == heads_count and spec.choices == expected
    validate_choices(spec.choices, max_depth=heads_count)
    assert (
        f"tree: mc_sim_7b_63 trimmed to the checkpoint's {heads_count} heads, depth {heads_count}, "
        f"{len(expected)} nodes"
    ) in capsys.readouterr().out.splitlines()
    # A tree asked for by name is taken as given: too deep for the heads is still an error.
    with pytest.raises(UserError, match=f"depth 4 exceeds {heads_count}"):
        build_engine(ckpt, tmp_path / "explicit", opts=BuildOptions(choices="mc_sim_7b_63"))


def test_convert_and_build_helper(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    engine = EngineDir.load(convert_and_build(tiny_qwen2_dir, tmp_path, tp=2, pp=2, max_seq_len=256, max_input_len=128))
    assert engine.pretrained_config["mapping"]["world_size"] == 4 and engine.limits.max_seq_len == 256
    assert sorted(p.name for p in engine.path.glob("rank*.safetensors")) == [f"rank{r}.safetensors" for r in range(4)]


@pytest.mark.slow
def test_smollm2_engine_dir(smollm2_engine_dir: Path) -> None:
    engine = EngineDir.load(smollm2_engine_dir)
    assert engine.pretrained_config["vocab_size"] == 49152 and engine.spec.mode == "none"
    assert (engine.tokenizer_dir / "tokenizer.json").is_file()


def test_cli_runs_without_an_optional_package(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Where tritonclient is missing (the GPU image), the engine commands still run and the Triton ones
    say what is missing."""
    code = "import sys; sys.modules['tritonclient'] = None; from pipeline.cli import main; sys.exit(main(sys.argv[1:]))"
    run = [sys.executable, "-c", code]
    built = subprocess.run(
        run + ["build", "--checkpoint", str(tiny_ckpt), "--output", str(tmp_path / "e")], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "e" / "config.json").is_file()
    assert "(needs tritonclient)" in subprocess.run(run + ["--help"], capture_output=True, text=True).stdout
    served = subprocess.run(run + ["serve"], capture_output=True, text=True)
    assert served.returncode == USER_ERROR_EXIT_CODE
    assert "needs the Python package tritonclient" in served.stderr and "make setup" in served.stderr
