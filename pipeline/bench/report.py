"""The comparison report: results.json, report.md and PNG plots, written into one folder."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

MS = 1000.0
TABLE_HEADER = (
    "| system | conc. | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | output tok/s | req/s | "
    "accept. length | exact match | mean 1st divergence (tok) |"
)


def _json_safe(x: Any) -> Any:
    """NaN is not JSON: write it as null."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def table_rows(systems: dict[str, Any]) -> list[str]:
    rows = [TABLE_HEADER, "|" + "---|" * 9]
    for name, sys in systems.items():
        for r in sys.get("runs", []):
            rows.append(
                f"| {name} | {r['concurrency']} | {_fmt(r['ttft_p50_s'] * MS, 0)} / {_fmt(r['ttft_p99_s'] * MS, 0)} | "
                f"{_fmt(r['itl_p50_s'] * MS)} / {_fmt(r['itl_p99_s'] * MS)} | {_fmt(r['output_tokens_per_s'])} | "
                f"{_fmt(r['requests_per_s'], 2)} | {_fmt(r['acceptance_length'], 2)} | "
                f"{_fmt(r['exact_match_rate'] * 100, 0)}% | {_fmt(r['mean_first_divergence'])} |"
            )
    return rows


def single_stream_ratios(systems: dict[str, Any], ours: str = "ours") -> list[str]:
    """Our tokens/s at concurrency 1 beside each vLLM mode's, with the ratio whichever way it falls."""

    def c1(name: str) -> float | None:
        runs = [r for r in systems.get(name, {}).get("runs", []) if r["concurrency"] == 1]
        return runs[0]["output_tokens_per_s"] if runs else None

    mine = c1(ours)
    lines = []
    for name in systems:
        theirs = c1(name)
        if name == ours or theirs is None or mine is None:
            continue
        lines.append(
            f"- {ours} {mine:.1f} tok/s vs {name} {theirs:.1f} tok/s at concurrency 1: "
            f"ours / {name} = {mine / theirs:.2f}×"
        )
    return lines


def status_lines(systems: dict[str, Any]) -> list[str]:
    out = []
    for name, sys in systems.items():
        detail = f" — {sys['error']}" if sys.get("error") else ""
        start = f", ready after {sys['startup_s']:.0f} s" if sys.get("startup_s") else ""
        setup = f" ({sys['setup']})" if sys.get("setup") else ""
        out.append(f"- **{name}**: {sys['status']}{start}{detail}{setup}")
    return out


def plot_throughput(systems: dict[str, Any], path: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, sys in systems.items():
        runs = sys.get("runs", [])
        if not runs:
            continue
        conc = [r["concurrency"] for r in runs]
        ax1.plot(conc, [r["output_tokens_per_s"] for r in runs], marker="o", label=name)
        ax2.plot(conc, [r["ttft_p50_s"] * MS for r in runs], marker="o", label=name)
    ax2.set_yscale("log")  # queueing makes TTFT span orders of magnitude across systems
    for ax, title in ((ax1, "output tokens/s"), (ax2, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_acceptance(systems: dict[str, Any], path: Path) -> None:
    """Per-request acceptance lengths where the server reports them (first run only: greedy requests
    repeat the same drafts at every concurrency); vLLM's run means as lines."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, sys in systems.items():
        runs = [r for r in sys.get("runs", []) if r.get("acceptance_lengths")]
        if runs:
            ax.hist(
                runs[0]["acceptance_lengths"],
                bins=20,
                alpha=0.6,
                label=f"{name} (per request, concurrency {runs[0]['concurrency']})",
            )
            continue
        means = [r["acceptance_length"] for r in sys.get("runs", []) if r.get("acceptance_length")]
        for i, m in enumerate(means):
            ax.axvline(m, linestyle="--", color="tab:red", label=f"{name} (run mean)" if i == 0 else None)
    ax.set_xlabel("acceptance length (tokens per target forward pass)")
    ax.set_ylabel("requests")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no speculative system reported acceptance", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(out: Path, results: dict[str, Any]) -> None:
    systems = results["systems"]
    (out / "results.json").write_text(json.dumps(_json_safe(results), indent=1))
    plot_throughput(systems, out / "throughput_ttft.png")
    plot_acceptance(systems, out / "acceptance_hist.png")
    cfg, machine = results["config"], results["machine"]
    lines = [
        f"# Engine vs vLLM — {results['date']}",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']:.0f} GiB; "
        f"Python {machine['python']}, torch {machine['torch']}, vLLM {machine.get('vllm', '?')}.",
        f"Prompts: {cfg['num_prompts']} from {cfg['prompts']}; max_tokens {cfg['max_tokens']}, greedy; "
        f"concurrency {', '.join(map(str, cfg['concurrency']))}; {cfg['warmup']} warm-up requests per server; "
        "one server loaded at a time; every number timed by the same client (OpenAI /v1/completions, SSE).",
        "",
        "## Systems",
        *status_lines(systems),
        "",
        "## Results",
        *table_rows(systems),
        "",
        "## Single stream",
        *(single_stream_ratios(systems) or ["- not available (a system did not run)"]),
        "",
        "![tokens/s and TTFT](throughput_ttft.png) ![acceptance](acceptance_hist.png)",
        "",
        "## How to read it",
        "- TTFT and ITL are client-side. ITL shares each gap between chunks evenly over the tokens the chunk "
        "carried, so a speculative step that returns several tokens counts as several short intervals.",
        "- Acceptance length = tokens per target forward pass, tokens / (tokens − accepted drafts), for both: "
        "accepted drafts from each response's `spec` field for ours, from the /metrics counters for vLLM. "
        "vLLM's own figure, 1 + accepted / drafts, leaves out steps that proposed nothing; it is in "
        "results.json as `vllm_acceptance_per_draft`.",
        "- Agreement compares each output with Hugging Face float32 greedy decoding of the same prompt, "
        "both re-tokenized; batched runs can diverge from batch 1 through floating-point order.",
        "- The machine's 1-minute load average before each run is in results.json (`load_avg_1min_before`): "
        "the cores are shared, so absolute numbers move with other work.",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
