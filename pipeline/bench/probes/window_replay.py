"""How steady is the plain-or-drafting choice? Replays the windows a load run recorded (`load --adaptive`
JSON, each level's `controller.windows`) through the tier controller's comparison and through the former one
(running means of the windows' seconds and tokens, weight 0.3, prompt chunks left in), and reports how often
each rule's choice after a window agrees with what the same rule concludes from all of the level's windows.

    python -m pipeline.bench.probes.window_replay bench/load-smollm2-eagle-controller-*.json
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from dataclasses import replace
from pathlib import Path

from pipeline.engine.adaptive import AdaptiveConfig, TierController, Window, moved

FORMER_WEIGHT = 0.3  # the former rule's weight of a window in its mode's running means
ALL_WINDOWS = 10**9


def fitted_choice(windows: list[Window], config: AdaptiveConfig, recent: int) -> bool:
    """Whether the controller's comparison picks drafting over its last `recent` windows of each mode."""
    controller = TierController([], replace(config, window_recent=recent))
    for w in windows:
        controller.recent.setdefault((w.bucket, w.drafting), deque(maxlen=recent)).append(w)
    bucket = windows[0].bucket
    return controller.rate(bucket, True) >= controller.rate(bucket, False)


def former_choice(windows: list[Window], config: AdaptiveConfig) -> bool:
    """Whether running means of each mode's window seconds and tokens pick drafting."""
    seconds: dict[bool, float] = {}
    tokens: dict[bool, float] = {}
    counts: dict[bool, int] = {}
    for w in windows:
        n = counts[w.drafting] = counts.get(w.drafting, 0) + 1
        weight = max(FORMER_WEIGHT, 1.0 / n)
        seconds[w.drafting] = moved(seconds.get(w.drafting), w.seconds, weight)
        tokens[w.drafting] = moved(tokens.get(w.drafting), w.tokens, weight)
    drafting = tokens[True] / seconds[True] / (1.0 + config.window_margin)
    return drafting >= tokens[False] / seconds[False]


def replay(windows: list[Window], config: AdaptiveConfig) -> tuple[int, int, int, bool]:
    """(choices made, agreeing with the fit on all windows, the former rule's agreeing with itself on all,
    the fit on all windows: drafting)."""
    fitted_final = fitted_choice(windows, config, ALL_WINDOWS)
    former_final = former_choice(windows, config)
    made = fitted = former = 0
    for i in range(len(windows)):
        seen = windows[: i + 1]
        if min(sum(w.drafting == d for w in seen) for d in (True, False)) < config.window_samples:
            continue
        made += 1
        fitted += fitted_choice(seen, config, config.window_recent) == fitted_final
        former += former_choice(seen, config) == former_final
    return made, fitted, former, fitted_final


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="load bench JSON files with controller windows")
    args = p.parse_args(argv)
    config = AdaptiveConfig()
    totals: dict[int, list[int]] = {}
    for path in args.runs:
        for rows in json.loads(path.read_text())["results"].values():
            for row in rows:
                recorded = (row.get("controller") or {}).get("windows", [])
                for bucket in sorted({w[0] for w in recorded}):
                    windows = [
                        Window(b, mode == "drafting", 0.0, steps=n, tokens=t, seconds=s, prefills=c)
                        for b, mode, n, t, s, c in recorded
                        if b == bucket and mode in ("plain", "drafting")
                    ]
                    if min(sum(w.drafting == d for w in windows) for d in (True, False)) <= config.window_samples:
                        continue
                    made, fitted, former, fit_drafts = replay(windows, config)
                    total = totals.setdefault(row["concurrency"], [0, 0, 0, 0, 0])
                    for k, v in enumerate((1, made, fitted, former, int(fit_drafts))):
                        total[k] += v
    print("requests  levels  choices  agree: chunks charged apart  running means  levels the fit gives drafting")
    for c, (levels, made, fitted, former, drafts) in sorted(totals.items()):
        print(f"{c:8}  {levels:6}  {made:7}  {fitted / made:27.0%}  {former / made:13.0%}  {drafts:29}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
