"""The serving benchmark end to end on a tiny engine: the real tritonserver, identical ids, the JSON's fields."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import convert_and_build

from pipeline.bench.serving import MODES, ServingConfig, main
from pipeline.errors import UserError

MAX_TOKENS = 8
PROMPTS = ("The quick brown fox", "Once upon a time there was", "def add(a, b):")


def test_serving_bench_through_real_triton(tiny_llama_dir, tmp_path, capsys):
    engine = convert_and_build(tiny_llama_dir, tmp_path / "build", max_input_len=48, max_seq_len=96, max_batch_size=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out"
    assert (
        main(
            [
                "--engine",
                str(engine),
                "--device",
                "cpu",
                "--prompts",
                str(prompts),
                "--num-prompts",
                str(len(PROMPTS)),
                "--max-tokens",
                str(MAX_TOKENS),
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert "triton grpc-stream" in capsys.readouterr().out
    results = json.loads((out / "serving-cpu.json").read_text())
    base = results["in_process"]
    assert len(base["outputs"]) == len(PROMPTS) and all(len(o) == MAX_TOKENS for o in base["outputs"])
    assert base["tokens"] == len(PROMPTS) * MAX_TOKENS and base["tokens_per_s"] > 0
    assert set(results["triton"]) == set(MODES)
    for r in results["triton"].values():
        assert r["ids_identical"] is True
        assert r["tokens"] == base["tokens"] and len(r["request_s"]) == len(PROMPTS)
        assert r["ratio_vs_in_process"] == r["tokens_per_s"] / base["tokens_per_s"]
        assert {"median_overhead_ms", "median_request_ms", "within_bar"} <= set(r)
    assert (out / "tritonserver.log").stat().st_size > 0


def test_missing_engine_is_one_clear_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.bench.serving", "--engine", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"serving: error: --engine {tmp_path / 'nope'}: no config.json; build one with `specpipe build`"
    ]


def test_config_rejects_zero_tokens(tmp_path):
    engine = tmp_path / "e"
    engine.mkdir()
    (engine / "config.json").write_text("{}")
    with pytest.raises(UserError, match="--max-tokens"):
        ServingConfig(engine=engine, max_tokens=0)
