"""Speculation's speed-up over plain decoding against concurrency, from concurrency sweeps (load.py).

    python -m pipeline.bench.speedup --plain PLAIN.json --method eagle=EAGLE.json [--method medusa=M.json ...]
        [--method "eagle, off=EAGLE.json#in-process T=0 policy=off"] --output bench/speedup.png

Prints one row per concurrency (each method's tok/s over plain's, its tokens a step and the tiers its
controller chose) and draws one line per method, with the published points of other systems marked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# (label, concurrency, speed-up over no speculation), as published (issue 35 cites them):
ANCHORS = (
    ("vLLM, static 3-token draft (PR #48944)", 256, 0.79),
    ("SGLang 21-token trees, below 1x (SpecDecode-Bench)", 64, 1.0),
    ("EAGLE-3 paper, chain of 3", 64, 1.38),
)


def greedy_rows(path: Path, key: str = "") -> dict[int, dict[str, Any]]:
    """A sweep's rows by concurrency: results[key], else the in-process greedy ones, else the first."""
    results = json.loads(path.read_text())["results"]
    if key and key not in results:
        raise SystemExit(f"{path}: no results {key!r}; it has {', '.join(map(repr, results))}")
    rows = results[key] if key else results.get("in-process T=0") or next(iter(results.values()))
    return {r["concurrency"]: r for r in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", type=Path, required=True)
    p.add_argument(
        "--method",
        action="append",
        default=[],
        help="NAME=JSON[#RESULTS]: that engine's load JSON (RESULTS: one of its result sets, as several "
        "--adaptive variants write them); a NAME given twice joins the files' levels",
    )
    p.add_argument("--output", type=Path, required=True, help="the plot (PNG)")
    args = p.parse_args(argv)
    methods: dict[str, dict[int, dict[str, Any]]] = {}
    for m in args.method:
        name, _, spec = m.partition("=")
        path, _, key = spec.partition("#")
        methods.setdefault(name, {}).update(greedy_rows(Path(path), key))
    plot_speedups(greedy_rows(args.plain), methods, args.output)
    return 0


def plot_speedups(
    plain: dict[int, dict[str, Any]], methods: dict[str, dict[int, dict[str, Any]]], output: Path
) -> None:
    """Each method's rows (by concurrency) over plain's: printed, and drawn into `output`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in methods.items():
        levels = sorted(c for c in rows if c in plain)
        ups = [rows[c]["output_tokens_per_s"] / plain[c]["output_tokens_per_s"] for c in levels]
        ax.plot(levels, ups, marker="o", label=name)
        for c, up in zip(levels, ups):
            tiers = rows[c].get("tiers", {})
            top = max(tiers, key=tiers.get) if tiers else "-"
            per_step = rows[c].get("tokens_per_step", 1.0)
            print(f"{name:>8} C={c:>3}  {up:5.2f}x  tokens/step {per_step:.2f}  most chosen {top}")
    for label, c, up in ANCHORS:
        ax.scatter([c], [up], marker="x", s=60, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tok/s over plain decoding")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")


if __name__ == "__main__":
    raise SystemExit(main())
