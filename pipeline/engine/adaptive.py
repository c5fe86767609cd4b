"""Which tier each speculative step runs: plain or drafting by what each delivered, and which drafting tier
by the tiers' expected tokens per second.

Plain or drafting, a bucket at a time: steps run in windows of a batch bucket, each window plain or drafting
throughout; a window counts the tokens emitted over its wall time, whatever ran inside it (the host's work a
row, a catch-up, prompt chunks; not the wait for a request when none is left: that window ends unmeasured).
Prompt chunks are charged apart: each mode's recent windows give its seconds a window as a line in the chunks
prefilled inside it, one slope for both modes (a chunk costs what it costs whichever mode queued it), and a
mode's rate is its tokens a window over its window's seconds without chunks. Every request is prefilled once
whatever the mode, so the mode that emits faster between prompts serves faster; without the slope, a burst
of prompts falling in a few windows decided the comparison (BENCHMARKS §4). A bucket's first windows run
plain, unmeasured (the ramp into a bucket). Then the modes take turns until each has been measured a few
times; from there a bucket runs the mode whose windows delivered more (drafting's rate taken a margin lower:
part of drafting's cost falls outside its windows, since requests it ends out of step bring their
successors' prompts one at a time), and the other one window in so many: every other window while the two
are within the loss allowed, rarely while the loser is far behind or its windows take longer (a drafting
window at a large batch can take several plain ones' time), so that exploring costs at most a set share of
the bucket's speed.

Which drafting tier: for a step of B drafting rows in batch bucket b, tier t is worth (B + sum of the rows'
expected accepted tokens under t) / cost[b][t]. A bucket's cost is its plain step's time, kept current from
every plain step, times each tier's ratio to it: measured when the bucket is first used (the graphs are
captured then anyway) and kept current from the steps that run. A tier's expected acceptance is its strength
times the text's current difficulty. Acceptance follows the text (a list is easy, a poem hard), and most
steps run one tier: a running mean kept per tier would hold the incumbent's last few steps against the other
tiers' estimates from whenever they last ran, so a tier that stopped in a hard passage stayed valued at that
passage. So the difficulty, one for all tiers, is a fast running mean of each step's acceptance over its
tier's strength, and a tier's strength a slow mean of its acceptance over the difficulty of the moment. No
tier is ranked before every tier has run on a few rows: the first drafting windows probe them in turn (a
tree's acceptance is not predictable from a chain's), and a window with a probing step in it is not
measured, so that the probes' one-time cost does not count against drafting. Every tier within reach is
re-run now and then so that its strength stays current. The plain step right after a drafting step is
queued behind no other and catches the drafter up on every accepted token: what it costs past a plain step
counts as the drafting step's.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.engine.spec_step import Tier
from pipeline.errors import UserError

POLICIES = ("adaptive", "off", "full")
TIER_NAME = re.compile(r"plain|(chain|tree|dynamic)[1-9][0-9]*")  # the names spec_step's tiers take


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values)


def moved(mean: float | None, value: float, weight: float) -> float:
    """A running mean moved toward a new value by `weight` (the value itself when there is no mean yet)."""
    return value if mean is None else mean + weight * (value - mean)


@dataclass(frozen=True)
class AdaptiveConfig:
    """How tiers are chosen (serve option --speculation)."""

    # "adaptive"; "off": plain steps only; "full": the largest tier always (a static engine's tree); or a
    # tier's name: always that tier.
    policy: str = "adaptive"
    # Weights of a step's acceptance in the difficulty (fast: the text changes within a reply) and, at the
    # least, in its tier's strength (slow; a tier's first rows weigh 1 / rows, so that rarely run tiers
    # average every run they had).
    acceptance_weight: float = 0.05
    strength_weight: float = 0.01
    # Drafting rows each tier runs before tiers are ranked (its first rows' plain mean is its estimate, so
    # that one unlucky step does not rule a tier out for good).
    probe_rows: int = 8
    cost_weight: float = 0.1  # weight of a step's measured time in the cost table
    explore_every: int = 64  # steps between re-runs of a tier that is not the best
    explore_within: float = 0.7  # ... that is expected to reach at least this share of the best's speed
    calibration_runs: int = 3  # timed runs per (bucket, tier) when a bucket is first used
    # A request whose running mean of accepted tokens a drafting step falls below request_cutoff (over at
    # least request_min_steps drafting steps since it was last judged) drafts nothing for request_pause
    # steps; its mean moves by request_weight.
    request_cutoff: float = 0.25
    request_min_steps: int = 16
    request_pause: int = 64
    request_weight: float = 0.2
    # Windows of window_steps steps of one bucket, plain or drafting. A bucket's first window_warmup windows
    # run plain, unmeasured; then the modes alternate until each has window_samples measured windows; a
    # mode's rate is judged on its last window_recent measured windows. The mode that delivered less runs
    # one window in as few as window_explore while that costs the bucket at most window_loss of its tokens
    # (its shortfall over its share of the time).
    window_steps: int = 32
    window_warmup: int = 1
    window_samples: int = 3
    window_explore: int = 2
    window_recent: int = 16
    window_loss: float = 0.01
    # Drafting windows' rates are compared after division by 1 + window_margin: part of drafting's cost falls
    # outside its windows (BENCHMARKS §4).
    window_margin: float = 0.1


@dataclass
class RequestAcceptance:
    """One request's running acceptance: below the cutoff it drafts nothing for a while, then is judged
    afresh over request_min_steps new drafting steps."""

    mean: float = 0.0  # accepted tokens a drafting step, over the steps since it was last judged
    steps: int = 0  # ... that many
    paused_until: int = 0  # the controller step before which the request drafts nothing

    def drafts(self, step: int) -> bool:
        return step >= self.paused_until

    def update(self, accepted: int, step: int, cfg: AdaptiveConfig) -> None:
        """A drafting step at controller step `step` accepted `accepted` of its drafts."""
        self.mean = accepted if self.steps == 0 else moved(self.mean, accepted, cfg.request_weight)
        self.steps += 1
        if self.steps >= cfg.request_min_steps and self.mean < cfg.request_cutoff:
            self.paused_until, self.steps = step + cfg.request_pause, 0


# The difficulty's floor: a run of rejected drafts must not make the next accepted token count without bound
# toward a tier's strength.
MIN_DIFFICULTY = 0.05
HISTORY_WINDOWS = 1024  # closed windows kept for observability (TierController.history)


@dataclass
class Window:
    """Steps of one bucket, plain or drafting: the tokens they emitted and since when."""

    bucket: int
    drafting: bool
    start: float
    measured: bool = True  # False: a warm-up window
    steps: int = 0
    tokens: int = 0
    prefills: int = 0  # prompt chunks prefilled while it was open
    seconds: float = 0.0  # its wall time, once closed


@dataclass
class TierController:
    tiers: list[Tier]
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    plain_cost: dict[int, float] = field(default_factory=dict)  # bucket -> seconds a plain step
    ratio: dict[int, list[float]] = field(default_factory=dict)  # bucket -> each tier's cost / plain's
    # Per tier: accepted tokens a drafting row at difficulty 1 (None before it has run).
    accepted: list[float | None] = field(default_factory=list)
    difficulty: float = 1.0  # the current text's acceptance over the tiers' strengths
    steps: int = 0
    last_run: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, tier) -> step it last ran
    chosen: dict[int, int] = field(default_factory=dict)  # tier index -> steps it ran (observability)
    rows_seen: dict[int, int] = field(default_factory=dict)  # tier index -> drafting rows it has run
    current: int = 0  # the tier of the last step
    held: tuple[int, int, float] | None = None  # the last drafting step's (bucket, tier, seconds), not counted yet
    window: Window | None = None  # the window the steps run in
    opened: dict[int, int] = field(default_factory=dict)  # bucket -> windows opened
    # (bucket, drafting) -> that mode's last window_recent measured windows there
    recent: dict[tuple[int, bool], deque[Window]] = field(default_factory=dict)
    measured: dict[tuple[int, bool], int] = field(default_factory=dict)  # (bucket, drafting) -> windows closed
    history: deque[Window] = field(default_factory=lambda: deque(maxlen=HISTORY_WINDOWS))  # the last closed
    closed: int = 0  # windows closed in all
    # Plain steps of the adaptive policy by why (observability): "no row drafts" (every row opted out or is
    # paused for low acceptance), "warm-up window", "plain window".
    plain_why: dict[str, int] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        self.accepted = [0.0] + [None] * (len(self.tiers) - 1)
        if self.config.policy not in POLICIES and self.config.policy not in self.names:
            raise UserError(
                f"--speculation {self.config.policy!r}: use {', '.join(POLICIES)}, or a tier: {', '.join(self.names)}"
            )

    @property
    def delivered(self) -> dict[tuple[int, bool], float]:
        """(bucket, drafting) -> tokens a second as the mode's recent windows ran, prompt chunks and all
        (observability; `rate` is what the modes are compared by)."""
        return {key: sum(w.tokens for w in ws) / sum(w.seconds for w in ws) for key, ws in self.recent.items()}

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def calibrated(self, bucket: int) -> bool:
        return bucket in self.ratio

    def calibrate(self, bucket: int, run: Callable[[int], None]) -> None:
        """Time each tier on a bucket of padding rows (run(tier) runs one step and waits for it)."""
        costs = []
        for index in range(len(self.tiers)):
            run(index)  # the first run captures (CUDA) or warms up
            times = []
            for _ in range(self.config.calibration_runs):
                start = time.perf_counter()
                run(index)
                times.append(time.perf_counter() - start)
            costs.append(sorted(times)[len(times) // 2])
        self.plain_cost[bucket] = costs[0]
        self.ratio[bucket] = [c / costs[0] for c in costs]

    def costs(self, bucket: int) -> list[float]:
        """Seconds a step of each tier in `bucket` is expected to take now."""
        return [self.plain_cost[bucket] * r for r in self.ratio[bucket]]

    def expected(self, index: int) -> float:
        """Accepted tokens a drafting row is expected to gain from tier `index` now (0 before it has run)."""
        return (self.accepted[index] or 0.0) * self.difficulty

    def probing(self) -> int | None:
        """The tier to probe next: the one that has run on fewest rows, if that is under probe_rows."""
        least = min(range(1, len(self.tiers)), key=lambda i: self.rows_seen.get(i, 0))
        return least if self.rows_seen.get(least, 0) < self.config.probe_rows else None

    def choose(self, bucket: int, rows: int, drafting: int) -> int:
        """The tier for a step of `rows` rows (in `bucket`), `drafting` of which may accept drafts."""
        self.steps += 1
        policy = self.config.policy
        if policy == "off":
            return 0
        if drafting == 0:
            return self._plain("no row drafts")
        if policy == "full":
            return len(self.tiers) - 1
        if policy != "adaptive":
            return self.names.index(policy)
        window = self._window(bucket)
        if not window.drafting:
            return self._plain("plain window" if window.measured else "warm-up window")
        probe = self.probing()
        if probe is not None:
            window.measured = False
            self.last_run[(bucket, probe)] = self.steps
            return probe
        costs = self.costs(bucket)
        speed = [(rows + drafting * self.expected(i)) / costs[i] for i in range(len(self.tiers))]
        best = max(range(1, len(speed)), key=speed.__getitem__)  # the windows judge plain
        for i in range(1, len(speed)):  # re-run a close tier whose estimate has not been refreshed lately
            stale = self.steps - self.last_run.get((bucket, i), -self.config.explore_every)
            if (
                i != best
                and stale >= self.config.explore_every
                and speed[i] >= self.config.explore_within * speed[best]
            ):
                best = i
                break
        self.last_run[(bucket, best)] = self.steps
        return best

    def _plain(self, why: str) -> int:
        self.plain_why[why] = self.plain_why.get(why, 0) + 1
        return 0

    def idle(self) -> None:
        """No request is left: the open window ends unmeasured (idle time is neither mode's)."""
        self.window = None

    def _window(self, bucket: int) -> Window:
        """The window a step of `bucket` runs in: the open one, or a new one (load moved to another bucket:
        the open window is dropped, its rate would mix two)."""
        if self.window is not None and self.window.bucket == bucket:
            return self.window
        opened = self.opened[bucket] = self.opened.get(bucket, 0) + 1
        cfg = self.config
        if opened <= cfg.window_warmup:
            self.window = Window(bucket, False, self.clock(), measured=False)
            return self.window
        with_drafting, without = self.measured.get((bucket, True), 0), self.measured.get((bucket, False), 0)
        if min(with_drafting, without) < cfg.window_samples:
            drafting = with_drafting <= without  # taking turns, drafting first
        else:
            better = self.rate(bucket, True) >= self.rate(bucket, False)
            drafting = better if opened % self.explore_interval(bucket, better) else not better
        self.window = Window(bucket, drafting, self.clock())
        return self.window

    def chunk_seconds(self, bucket: int) -> float:
        """Seconds a prompt chunk adds to a window of `bucket`: the least-squares slope of the recent windows'
        seconds on their chunks, each mode's windows about that mode's means; 0 if the chunks never vary, or
        if the fit would leave a mode's window without chunks no time."""
        moments = []
        for ws in self.recent.values():
            if ws[0].bucket != bucket:
                continue
            chunks, seconds = _mean([w.prefills for w in ws]), _mean([w.seconds for w in ws])
            moments.append((chunks, seconds, ws))
        spread = sum((w.prefills - c) ** 2 for c, _, ws in moments for w in ws)
        if spread == 0.0:
            return 0.0
        slope = sum((w.prefills - c) * (w.seconds - s) for c, s, ws in moments for w in ws) / spread
        if slope <= 0.0 or any(s - slope * c <= 0.0 for c, s, _ in moments):
            return 0.0
        return slope

    def window_seconds(self, bucket: int, drafting: bool) -> float:
        """A mode's mean window seconds in `bucket` without prompt chunks."""
        ws = self.recent[(bucket, drafting)]
        return _mean([w.seconds for w in ws]) - self.chunk_seconds(bucket) * _mean([w.prefills for w in ws])

    def rate(self, bucket: int, drafting: bool) -> float:
        """A mode's tokens a second in `bucket` between prompts, as compared (drafting's less the margin)."""
        rate = _mean([w.tokens for w in self.recent[(bucket, drafting)]]) / self.window_seconds(bucket, drafting)
        return rate / (1.0 + self.config.window_margin) if drafting else rate

    def explore_interval(self, bucket: int, better: bool) -> int:
        """Windows of `bucket` per window of the mode that delivered less (`not better`): one losing window
        and n - 1 winning ones lose shortfall * D_lose / (D_lose + (n - 1) * D_win) of the tokens, at most
        window_loss for n >= 1 + (D_lose / D_win) * (shortfall - window_loss) / window_loss."""
        cfg = self.config
        win, lose = self.rate(bucket, better), self.rate(bucket, not better)
        shortfall = 1.0 - lose / max(win, 1e-9)
        stretch = self.window_seconds(bucket, not better) / max(self.window_seconds(bucket, better), 1e-9)
        needed = 1 + math.ceil(stretch * (shortfall - cfg.window_loss) / cfg.window_loss)
        return max(cfg.window_explore, needed)

    def prefilled(self, chunks: int) -> None:
        """`chunks` prompt chunks were queued while the open window runs (charged apart: chunk_seconds)."""
        if self.window is not None:
            self.window.prefills += chunks

    def emitted(self, bucket: int, tokens: int) -> None:
        """A step of `bucket` was read with `tokens` new tokens: counted in its window, which closes after
        window_steps steps with its tokens and wall time since it opened, into its mode's recent windows."""
        window = self.window
        if window is None or window.bucket != bucket:
            return
        window.steps += 1
        window.tokens += tokens
        if window.steps < self.config.window_steps:
            return
        self.window = None
        window.seconds = max(self.clock() - window.start, 1e-9)
        self.history.append(window)
        self.closed += 1
        if not window.measured:
            return
        key = (bucket, window.drafting)
        self.measured[key] = self.measured.get(key, 0) + 1
        self.recent.setdefault(key, deque(maxlen=self.config.window_recent)).append(window)

    def timed_plain(self, bucket: int, seconds: float | None) -> None:
        """A plain step of `bucket` was read `seconds` after the step before it (None: not measured). Right
        after a drafting step, what it took past a plain step's cost is the drafting step's."""
        held, self.held = self.held, None
        if held is not None:
            excess = 0.0
            if seconds is not None and bucket in self.ratio:
                excess = max(0.0, seconds - self.plain_cost[bucket])
            drafted_bucket, index, drafted = held
            self._timed(drafted_bucket, index, drafted + excess)
        elif seconds is not None:
            self._timed(bucket, 0, seconds)

    def timed_drafting(self, bucket: int, index: int, seconds: float) -> None:
        """A drafting step of tier `index` took `seconds`: held until the step after it is read."""
        held, self.held = self.held, (bucket, index, seconds)
        if held is not None:  # drafting after drafting: nothing to add
            self._timed(*held)

    def _timed(self, bucket: int, index: int, seconds: float) -> None:
        """A step of tier `index` in `bucket` took `seconds`: the cost table moves toward it."""
        if bucket not in self.ratio:
            return
        w, plain = self.config.cost_weight, self.plain_cost[bucket]
        if index == 0:
            self.plain_cost[bucket] = moved(plain, seconds, w)
        else:
            ratio = self.ratio[bucket]
            ratio[index] = moved(ratio[index], seconds / plain, w)

    def observe(self, index: int, accepted: list[int]) -> None:
        """A step of tier `index` ran and its drafting rows accepted `accepted` tokens: the difficulty moves
        toward the step's acceptance over the tier's strength (once the tier is past its probe), then the
        strength toward the acceptance over the difficulty."""
        self.chosen[index] = self.chosen.get(index, 0) + 1
        self.current = index
        if not accepted or index == 0:
            return
        cfg, mean = self.config, sum(accepted) / len(accepted)
        seen = self.rows_seen.get(index, 0)
        strength = self.accepted[index]
        if seen >= cfg.probe_rows and strength:
            ratio = moved(self.difficulty, mean / strength, cfg.acceptance_weight)
            self.difficulty = max(ratio, MIN_DIFFICULTY)
        rows = self.rows_seen[index] = seen + len(accepted)
        w = max(cfg.strength_weight, len(accepted) / rows)
        self.accepted[index] = moved(strength, mean / self.difficulty, w)
