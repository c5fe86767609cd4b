"""`specpipe bench` on the CPU: the roofline suite on the tiny shape and the SmolLM2 suite on one short
prompt, both with a profiled request, through the same code the H200 runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.bench.speed import VERIFY_TREE_SIZES, BenchConfig, run_bench
from pipeline.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_roofline_suite_reports_the_floor_the_trees_and_a_profile(tmp_path, capsys):
    path = run_bench(
        BenchConfig(
            device="cpu",
            suites=("roofline",),
            output=tmp_path,
            shape="tiny",
            bandwidth_bytes=2**24,
            decode_tokens=8,
            repeats=1,
            profile_tokens=4,
        )
    )
    roof = json.loads(path.read_text())["roofline"]
    assert roof["decode_tokens_per_s"] > 0 and roof["floor_tokens_per_s"] > 0
    assert min(roof["decode_tokens_per_s_runs"]) <= roof["decode_tokens_per_s"] <= max(roof["decode_tokens_per_s_runs"])
    assert roof["decode_fraction_of_floor"] == pytest.approx(roof["decode_tokens_per_s"] / roof["floor_tokens_per_s"])
    assert set(roof["verify_cost_vs_1"]) == {str(n) for n in (1, *VERIFY_TREE_SIZES)}
    assert roof["kernel_layers"] == {
        "gemv_layers": 0,
        "fused_layers": 0,
        "attention_layers": 0,
        "draft_topk": 0,
    }  # CPU: the library kernels everywhere
    assert roof["profile"]["steps"] == 3 and roof["profile"]["wall_ms_per_step"] > 0  # 4 tokens: prefill + 3 steps
    assert "aten::" in roof["profile"]["top_host_ops"]
    assert "plain decode profiled:" in capsys.readouterr().out


# The CPU's default (one method after another) with a drafted method; CUDA's interleaving with the n-gram
# method alone, which needs no draft converted (the suite runs whole each time).
@pytest.mark.parametrize("interleave,methods", [(None, ("plain", "eagle3-deep", "ngram")), (True, ("plain", "ngram"))])
def test_smollm2_suite_matches_plain_for_every_method(tmp_path, interleave, methods):
    cfg = BenchConfig(
        device="cpu",
        suites=("smollm2",),
        output=tmp_path / "out",
        drafts=ROOT / "drafts",
        work_dir=tmp_path / "work",
        methods=methods,
        num_prompts=2,
        hf_prompts=1,
        max_tokens=8,
        profile_tokens=4,
        interleave=interleave,
    )
    results = json.loads(run_bench(cfg).read_text())["smollm2"]["methods"]
    assert set(results) == {*methods, "hf-generate", "hf-prompt-lookup"}
    plain = results["plain"]["outputs"]
    assert len(plain) == 2 and all(len(o) == 8 for o in plain)
    assert results["ngram"]["interleaved_with"] == (list(methods[:-1]) if interleave else [])
    for name, r in results.items():
        assert r["exact_match_rate"] == 1.0, name  # greedy speculation and the HF peers: the same 8 tokens
    timed = results["ngram"]["request_s"]  # per prompt, so that runs compare on the same prompts
    assert len(timed) == 2 and min(timed) > 0 and sum(timed) == pytest.approx(results["ngram"]["seconds"])
    if "eagle3-deep" in results:
        assert results["eagle3-deep"]["acceptance_length"] >= 1.0
        assert results["eagle3-deep"]["profile"]["tokens"] == 4


def test_unknown_method_is_one_clear_error():
    with pytest.raises(UserError, match="--methods eagle4"):
        BenchConfig(methods=("eagle4",))


def test_unknown_engine_dtype_names_the_choices():
    with pytest.raises(UserError, match="--dtype int8: choose one of float32, bfloat16, float16"):
        BenchConfig(dtype="int8")
