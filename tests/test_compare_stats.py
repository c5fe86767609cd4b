"""The comparison harness's statistics and report on recorded timings (no servers)."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.bench import stats
from pipeline.bench.prompts import load_prompts
from pipeline.bench.report import single_stream_ratios, table_rows, write_report
from pipeline.bench.vllm_server import parse_spec_counters
from pipeline.errors import UserError

# Recorded: a request sent at t=10.0 whose chunks arrived at these times carrying these token counts
# (a speculative server sends several tokens in one chunk).
RECORDED = stats.RequestTiming(start=10.0, chunk_times=(10.25, 10.35, 10.65, 10.70), chunk_tokens=(1, 1, 3, 1))
PLAIN = stats.RequestTiming(start=10.1, chunk_times=(10.3, 10.4, 10.5), chunk_tokens=(1, 1, 1))


def test_ttft_is_first_chunk_minus_send():
    assert stats.time_to_first_token(RECORDED) == pytest.approx(0.25)
    assert math.isnan(stats.time_to_first_token(stats.RequestTiming(1.0, (), ())))


def test_itl_shares_a_gap_over_the_tokens_of_the_chunk():
    assert stats.inter_token_latencies(RECORDED) == pytest.approx([0.10, 0.10, 0.10, 0.10, 0.05])
    assert stats.inter_token_latencies(stats.RequestTiming(0.0, (1.0,), (1,))) == []


def test_percentile_interpolates_and_handles_empty():
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([5.0], 99) == 5.0
    assert stats.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert math.isnan(stats.percentile([], 50))


def test_summarize_two_overlapping_requests():
    s = stats.summarize([RECORDED, PLAIN])
    assert s.requests == 2 and s.output_tokens == 9
    assert s.wall_s == pytest.approx(0.70)  # first send 10.0 to last chunk 10.70
    assert s.output_tokens_per_s == pytest.approx(9 / 0.70)
    assert s.requests_per_s == pytest.approx(2 / 0.70)
    assert s.ttft_p50_s == pytest.approx((0.25 + 0.20) / 2)
    itls = [0.10, 0.10, 0.10, 0.10, 0.05, 0.10, 0.10]
    assert s.itl_p50_s == pytest.approx(stats.percentile(itls, 50))
    with pytest.raises(ValueError):
        stats.summarize([])


def test_first_divergence_and_agreement():
    assert stats.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert stats.first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert stats.first_divergence([1, 2], [1, 2, 3]) == 2  # an early stop diverges where it stopped
    a = stats.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]])
    assert a == stats.Agreement(exact_match_rate=0.5, mean_first_divergence=2.0, count=2)
    with pytest.raises(ValueError):
        stats.agreement([[1]], [])


def test_acceptance_lengths_both_definitions():
    # 12 tokens with 8 accepted drafts took 4 target passes.
    assert stats.acceptance_length_from_counts(12, 8) == pytest.approx(3.0)
    assert stats.acceptance_length_from_counts(5, 0) == pytest.approx(1.0)
    assert math.isnan(stats.acceptance_length_from_counts(0, 0))
    assert stats.acceptance_length_from_drafts(10, 15) == pytest.approx(2.5)
    assert math.isnan(stats.acceptance_length_from_drafts(0, 0))


def test_parse_vllm_spec_counters_sums_label_sets():
    text = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 40.0',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 160.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 50.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="t"} 10.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 30.0',
            'vllm:num_requests_running{engine="0"} 0.0',
        ]
    )
    assert parse_spec_counters(text) == {"drafts": 40.0, "draft_tokens": 160.0, "accepted_tokens": 60.0}
    assert parse_spec_counters("") == {}


def _run(c: int, tps: float, accept: float | None) -> dict:
    return {
        "concurrency": c,
        "ttft_p50_s": 0.1,
        "ttft_p99_s": 0.2,
        "itl_p50_s": 0.03,
        "itl_p99_s": 0.05,
        "output_tokens_per_s": tps,
        "requests_per_s": 1.0,
        "acceptance_length": accept,
        "acceptance_lengths": [accept] * 3 if accept else [],
        "exact_match_rate": 1.0,
        "mean_first_divergence": 256.0,
        "outputs": [],
    }


def test_report_table_ratio_and_files(tmp_path):
    systems = {
        "ours": {"status": "ran", "startup_s": 5.0, "runs": [_run(1, 20.0, 2.0), _run(4, 25.0, 2.0)]},
        "vllm": {"status": "ran", "runs": [_run(1, 40.0, None), _run(4, 100.0, None)]},
        "vllm-eagle": {"status": "skipped: no draft", "runs": []},
    }
    rows = table_rows(systems)
    assert len(rows) == 2 + 4 and rows[2].startswith("| ours | 1 | 100 / 200 | 30.0 / 50.0 | 20.0 |")
    assert single_stream_ratios(systems) == [
        "- ours 20.0 tok/s vs vllm 40.0 tok/s at concurrency 1: ours / vllm = 0.50×"
    ]
    results = {
        "date": "2026-11-30",
        "systems": systems,
        "references": [],
        "machine": {"cpu": "x", "cores": 2, "memory_gib": 8.0, "python": "3.11", "torch": "2.13"},
        "config": {"prompts": "p", "num_prompts": 2, "max_tokens": 8, "concurrency": [1, 4], "warmup": 1},
    }
    systems["vllm"]["runs"][0]["ttft_p99_s"] = math.nan
    write_report(tmp_path, results)
    assert {p.name for p in tmp_path.iterdir()} == {
        "report.md",
        "results.json",
        "throughput_ttft.png",
        "acceptance_hist.png",
    }
    assert json.loads((tmp_path / "results.json").read_text())["systems"]["vllm"]["runs"][0]["ttft_p99_s"] is None
    assert "skipped: no draft" in (tmp_path / "report.md").read_text()


def test_prompts_from_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"turns": ["b", "c"]}\n{"prompt": "d"}\n')
    assert load_prompts(f, 2) == ["a", "b"]
    assert len(load_prompts(None, 80)) == 80  # MT-bench from the installed package
    f.write_text('{"text": "x"}\n')
    with pytest.raises(UserError, match="p.jsonl:1"):
        load_prompts(f, 1)


def test_reconcile_counts_matches_the_final_total():
    assert stats.reconcile_counts((1, 1, 3), 5) == (1, 1, 3)
    assert stats.reconcile_counts((1, 2, 3), 8) == (1, 2, 5)
    assert stats.reconcile_counts((2, 2, 3), 5) == (2, 2, 1)
    assert stats.reconcile_counts((2, 2, 3), 4) == (2, 1, 1)  # corrections walk back, each chunk keeps 1
    assert stats.reconcile_counts((1, 1), 1) == (1, 1)  # cannot go below one token a chunk
    assert stats.reconcile_counts((), 0) == ()
