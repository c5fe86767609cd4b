"""Batched speculation: every method verified for all requests in flight at once, in adaptive tiers.

fp32 on the CPU: each batched speculative request's output is plain greedy's token for token, whatever
tiers run and however they switch; oracle drafts accept at full depth in a batch; an opted-out request
inside a speculative batch is served plainly; the device's lossless sampling keeps the target's
distribution (and a broken rule is caught by the same check).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import convert_and_build

from pipeline.convert.tiny import make_random_eagle, make_random_eagle3, make_random_medusa
from pipeline.engine.adaptive import AdaptiveConfig, RequestAcceptance, TierController, Window
from pipeline.engine.kernels.routing import TORCH_TOPK
from pipeline.engine.loader import open_engine
from pipeline.engine.runner import Engine, SamplingParams
from pipeline.engine.sampling import sample_rows
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.engine.spec_step import Tier, accept_rows, tier_ladder
from pipeline.engine.step import CARRY, STATE
from pipeline.errors import UserError

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog and then",
    "hello hello hello",
    "1, 2, 3, 4,",
    "Once upon a time",
]
HIDDEN = 64


def vocab_of(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


CASES = {
    "eagle": lambda d, v: dict(eagle=make_random_eagle(d / "e", HIDDEN, v, with_embedding=False)),
    "eagle3-dynamic": lambda d, v: dict(
        eagle3=make_random_eagle3(d / "e3", HIDDEN, v),
        dynamic_tree=True,
        dynamic_top_k=4,
        dynamic_depth=3,
        max_draft_len=10,
    ),
    "medusa": lambda d, v: dict(medusa=make_random_medusa(d / "m", HIDDEN, v, with_lm_head=False)),
    "medusa-dynamic": lambda d, v: dict(
        medusa=make_random_medusa(d / "md", HIDDEN, v), dynamic_tree=True, dynamic_top_k=4, max_draft_len=12
    ),
    "ngram": lambda d, v: dict(speculative="ngram", ngram_k=3),
}


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path, tmp_path_factory) -> Engine:
    return open_engine(convert_and_build(tiny_llama_dir, tmp_path_factory.mktemp("plain")))


@pytest.fixture(scope="module")
def built(tiny_llama_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    vocab = vocab_of(tiny_llama_dir)
    return {name: convert_and_build(tiny_llama_dir, root / name, **make(root, vocab)) for name, make in CASES.items()}


def mixed_requests(engine: Engine) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of different lengths, budgets that end inside a tree, a stop word."""
    requests = []
    for i, text in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=(5, 13, 30, 21, 9)[i], end_id=-1)
        if i == 3:
            params = replace(params, stop_words=(" 7",))
        requests.append((engine.tokenizer(text).input_ids, params))
    return requests


def run_together(engine: Engine, requests) -> list[list[int]]:
    """All requests submitted at once, each stream read on its own thread."""
    streams = [engine.stream(ids, params) for ids, params in requests]
    outs: list[list[int]] = [[] for _ in streams]

    def read(i: int) -> None:
        for chunk in streams[i]:
            outs[i] += chunk.token_ids

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def test_a_cpu_engine_knows_every_buckets_tier_costs_once_loaded(built):
    """Tiers are timed at load, not inside the first steps of each batch size: on 2 cores timing SmolLM2's
    tiers at 16 rows stalled a burst of 16 requests for seconds."""
    engine = open_engine(built["eagle"])
    spec, controller = engine.scheduler.spec, engine.scheduler.controller
    assert spec is not None and controller is not None
    assert all(controller.calibrated(b) for b in spec.buckets)


def test_a_tier_the_engine_lacks_is_refused_at_load_naming_its_tiers(built):
    with pytest.raises(UserError, match="--speculation 'tree99': use adaptive, off, full, or a tier: plain, chain1"):
        open_engine(built["eagle"], serving=SchedulerConfig(speculation="tree99"))
    with pytest.raises(UserError, match="--compile-tiers tree99: not this engine's tiers; it has plain, chain1"):
        open_engine(built["eagle"], serving=SchedulerConfig(compile_tiers=("chain1", "tree99")))


def test_an_engines_own_trees_are_the_tiers_compiled_by_default(built):
    """EAGLE-2/3's dynamic tiers run most steps at low load: they are the ones compiled unless told (CUDA;
    the CPU runs every step eagerly)."""
    spec = open_engine(built["eagle3-dynamic"]).scheduler.spec
    assert spec is not None
    assert [spec.tiers[i].name for i in spec.compiled_tiers] == [t.name for t in spec.tiers if t.dynamic is not None]
    assert spec.compiled_tiers and spec.compiled_rows == SchedulerConfig().compile_tier_rows


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_method_batched_is_plain_greedy_in_every_tier(case, built, plain):
    requests = mixed_requests(plain)
    want = [plain.generate(ids, params).token_ids for ids, params in requests]
    engine = open_engine(built[case])
    controller = engine.scheduler.controller
    assert controller is not None
    for policy in ["adaptive", *controller.names]:
        controller.config = replace(controller.config, policy=policy)
        for batch in (1, 3, len(requests)):
            got = run_together(engine, requests[:batch])
            assert got == want[:batch], (case, policy, batch)
    assert engine.scheduler.usage()["used_blocks"] == 0


def test_a_tier_switch_in_the_middle_of_a_request_stays_exact(built, plain):
    engine = open_engine(built["eagle"])
    controller = engine.scheduler.controller
    assert controller is not None
    ids, params = plain.tokenizer(PROMPTS[1]).input_ids, SamplingParams(max_tokens=40, end_id=-1)
    # Runs of plain steps are queued ahead of the host's read; drafting steps after them start from the text.
    policies = iter(["tree16", "chain1", "off", "chain4", "tree8", "plain", "plain", "off", "tree64"] * 20)
    out: list[int] = []
    for chunk in engine.stream(ids, params):  # one chunk a step: switch before the next step
        out += chunk.token_ids
        controller.config = replace(controller.config, policy=next(policies))
    assert out == plain.generate(ids, params).token_ids


def test_drafting_steps_are_queued_before_the_step_before_is_read(built, plain):
    """A drafting step takes its rows' roots and cached lengths from the step before on the device, so it is
    queued before the host has read that step (whose accepted counts the host does not know yet)."""
    engine = open_engine(built["eagle"], serving=SchedulerConfig(speculation="chain2"))
    spec = engine.scheduler.spec
    assert spec is not None
    speculate, steps = spec.speculate, []

    def recorded(ints, floats, drafts, tier, defer=False):
        if (ints[:, STATE] > 0).any():  # a step of requests, not of calibration's padding rows
            steps.append((tier, bool((ints[:, CARRY] >= 0).any())))
        return speculate(ints, floats, drafts, tier, defer)

    spec.speculate = recorded
    requests = mixed_requests(plain)
    assert run_together(engine, requests) == [plain.generate(ids, params).token_ids for ids, params in requests]
    assert sum(tier > 0 and carried for tier, carried in steps) > len(steps) // 2


def test_an_opted_out_request_is_served_plainly_inside_a_speculative_batch(built, plain):
    engine = open_engine(built["medusa"], serving=SchedulerConfig(speculation="tree8"))
    requests = mixed_requests(plain)[:3]
    requests[1] = (requests[1][0], replace(requests[1][1], speculative=False))
    streams = [engine.stream(ids, params) for ids, params in requests]
    results = []
    for stream in streams:
        for chunk in stream:
            if chunk.finished:
                results.append(chunk.result)
    for (ids, params), result in zip(requests, results):
        assert result.token_ids == plain.generate(ids, replace(params, speculative=True)).token_ids
    assert results[1].stats.draft_tokens == 0 and results[1].stats.accepted_tokens == 0
    assert results[0].stats.draft_tokens > 0


def test_plain_steps_in_a_row_keep_the_eagle_draft_in_sync(built, plain):
    """Plain steps in a row keep their pairs pending and catch the draft up on a run of them in one pass
    (defer): the draft's cache then holds what a catch-up at every step writes (its pairs at every position
    of the text the deferring run has caught up on)."""
    ids, params = plain.tokenizer(PROMPTS[2]).input_ids, SamplingParams(max_tokens=24, end_id=-1)
    caches, flags = [], []
    for allow in (True, False):
        engine = open_engine(built["eagle"], serving=SchedulerConfig(speculation="off"))
        spec = engine.scheduler.spec
        assert spec is not None
        decode = spec.decode

        def recorded(ints, floats, defer=False, allow=allow, decode=decode):
            if (ints[:, STATE] > 0).any():
                flags.append(defer)
            return decode(ints, floats, defer and allow)

        spec.decode = recorded
        engine.generate(ids, params)
        pool = spec.proposer.pool
        # The deferring run's last pairs may still be pending: compare what both have cached.
        positions = torch.arange(len(ids) + params.max_tokens - 2 - (spec.max_depth + 1))
        table = torch.arange(1, pool.blocks_for(len(positions)) + 1)  # a fresh pool's first request: blocks 1, 2, ..
        slots = pool.slots(table, positions)
        caches.append((pool.k[:, slots].clone(), pool.v[:, slots].clone()))
        assert caches[-1][0].abs().amin(dim=-1).amin(dim=-1).gt(0).all()  # every position was written
    deferred = flags[: len(flags) // 2]
    assert sum(deferred) >= len(deferred) * spec.max_depth // (spec.max_depth + 1) - 1  # most plain steps deferred
    torch.testing.assert_close(caches[0], caches[1], rtol=1e-4, atol=1e-5)


class OracleNet(torch.nn.Module):
    """Stands in for an EAGLE draft in batched form: the pair at position j guesses ref[j + 2]."""

    def __init__(self, real: torch.nn.Module, ref: list[int]):
        super().__init__()
        self.real, self.ref = real, torch.tensor(ref)
        self.cfg, self.rotary, self.lm_head = real.cfg, real.rotary, real.lm_head
        self.drafter = TORCH_TOPK

    def forward(self, tokens, features, ctx):
        guess = self.ref[(ctx.positions + 2).clamp(max=len(self.ref) - 1)]
        return guess.float()[..., None].expand(*guess.shape, self.cfg.hidden_size).clone()

    def logits(self, hidden):
        out = torch.full((hidden.shape[0], self.cfg.vocab_size), -1.0)
        out[torch.arange(hidden.shape[0]), hidden[:, 0].long()] = 10.0
        return out

    def top_logp(self, hidden, k):
        return torch.log_softmax(self.logits(hidden), dim=-1).topk(k, dim=-1)


@pytest.mark.parametrize("case,tier", [("eagle", "chain4"), ("eagle", "tree16"), ("eagle3-dynamic", "dynamic11")])
def test_oracle_eagle_accepts_full_depth_for_every_request_of_a_batch(case, tier, built, plain):
    """Each row's tree holds the oracle's path to full depth (a dynamic tier's: each row's own, picked by its
    draft scores), so every step accepts depth + 1 tokens for every request of the batch."""
    engine = open_engine(built[case], serving=SchedulerConfig(speculation=tier))
    spec = engine.scheduler.spec
    assert spec is not None
    depth = spec.tiers[engine.scheduler.controller.names.index(tier)].depth
    ids = plain.tokenizer(PROMPTS[0]).input_ids
    n = 4 * (depth + 1) * 3
    ref = ids + plain.generate(ids, SamplingParams(max_tokens=n + depth + 2, end_id=-1)).token_ids
    spec.proposer.net = OracleNet(spec.proposer.net, ref)
    requests = [(ids, SamplingParams(max_tokens=n, end_id=-1)) for _ in range(3)]
    streams = [engine.stream(i, p) for i, p in requests]
    results = [next(c.result for c in s if c.finished) for s in streams]
    for result in results:
        assert result.token_ids == ref[len(ids) : len(ids) + n]
        assert result.stats.acceptance_length == depth + 1
        assert result.stats.per_depth_acceptance == [1.0] * depth


# ---------------------------------------------------------------------------------------------
# Sampling: a node's draft is accepted when it is the target's own seeded draw at that position.

VOCAB = 6
ROWS = 40_000
TEMPERATURE = 0.9


def first_token_frequencies(broken: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """ROWS rows (seeds) of one tree: a root with two children, the first with one child. The first token
    a row emits is its first accepted draft, or the target's draw at the root. `broken`: drafts accepted by
    a coin of probability p(x) of their own, not coupled to the draw (what a careless rule does)."""
    tier = Tier.build("t", [[0], [1], [0, 0]], torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(tier.num_nodes, VOCAB, generator=gen) * 1.5
    tokens = torch.tensor([0, 2, 4, 1])[None].expand(ROWS, -1)  # root, child (rank 0), child (rank 1), grandchild
    seeds = torch.arange(ROWS).repeat_interleave(tier.num_nodes)
    positions = (10 + tier.tree.depths).repeat(ROWS) + 1
    flat = logits.repeat(ROWS, 1)
    temperature = torch.full((flat.shape[0],), TEMPERATURE)
    drawn = sample_rows(flat, temperature, torch.zeros_like(seeds), torch.ones(flat.shape[0]), seeds, positions, False)
    nxt = drawn.view(ROWS, tier.num_nodes)
    valid = torch.ones(ROWS, tier.num_nodes, dtype=torch.bool)
    if broken:
        probs = torch.softmax(logits / TEMPERATURE, -1)
        coin = torch.rand(ROWS, tier.num_nodes, generator=gen) < probs[0, tokens[0]][None]
        nxt = torch.where(coin, tokens, nxt)  # the root's children accepted by their own coins
    _, _, out = accept_rows(tier, tokens, nxt, valid, tier.trees)
    want = torch.softmax(logits[0].double() / TEMPERATURE, -1)
    return torch.bincount(out[:, 0], minlength=VOCAB).double() / ROWS, want


def within_sampling_error(freq: torch.Tensor, want: torch.Tensor) -> bool:
    sigma = (want * (1 - want) / ROWS).sqrt()
    return bool(((freq - want).abs() <= 5 * sigma + 1e-3).all())


def test_speculative_sampling_keeps_the_target_distribution():
    freq, want = first_token_frequencies()
    assert within_sampling_error(freq, want), (freq, want)
    broken, want = first_token_frequencies(broken=True)
    assert not within_sampling_error(broken, want), "the check must catch a rule that is not lossless"


@pytest.mark.parametrize(
    "case,policies", [("eagle", ["adaptive", "chain2", "tree16", "off"]), ("eagle3-dynamic", ["dynamic11"])]
)
def test_sampled_output_is_plain_samplings_in_every_tier_and_batch(case, policies, built, plain):
    """The same seed gives plain sampling's tokens, whatever the tier (each row's own trees included), the
    batch and the other rows."""
    ids = plain.tokenizer(PROMPTS[1]).input_ids
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=11, end_id=-1)
    requests = [
        (ids, params),
        (ids, replace(params, seed=12, top_k=0, top_p=0.9)),
        (ids, replace(params, temperature=0.0)),
        (plain.tokenizer(PROMPTS[0]).input_ids, replace(params, seed=5)),
    ]
    want = [plain.generate(i, p).token_ids for i, p in requests]
    assert want[0] != want[1]
    engine = open_engine(built[case])
    controller = engine.scheduler.controller
    assert controller is not None
    for policy in policies:
        controller.config = AdaptiveConfig(policy=policy)
        assert run_together(engine, requests) == want, policy
        assert run_together(engine, requests[:1]) == want[:1], policy


def test_the_plain_step_after_a_drafting_step_is_charged_to_the_drafting_tier():
    """That step runs unpipelined and catches the drafter up: counted as plain decoding's cost, it would make
    drafting tiers look cheaper the more often they run."""
    tiers = tier_ladder([[0], [1], [0, 0]], 4, 2, torch.device("cpu"))
    controller = TierController(tiers)
    controller.plain_cost[4], controller.ratio[4] = 1.0, [1.0] * len(tiers)  # as calibrated: a second a step
    for _ in range(50):
        controller.timed_drafting(4, 1, 1.0)
        controller.timed_plain(4, 1.5)  # half a plain step more than a plain step in a row
        controller.timed_plain(4, 1.0)
    plain, chain = controller.costs(4)[:2]
    assert plain == pytest.approx(1.0) and chain == pytest.approx(1.5, rel=0.02)
    controller.timed_drafting(4, 1, 3.0)
    controller.timed_drafting(4, 1, 3.0)  # drafting after drafting: the first counts as it was
    assert controller.costs(4)[1] == pytest.approx(1.5 + 0.1 * (3.0 - 1.5), rel=0.02)


def rows_accepting(mean: float, rows: int = 10) -> list[int]:
    """`rows` rows' accepted tokens whose mean is `mean`, to a tenth."""
    total = round(mean * rows)
    return [total // rows + (r < total % rows) for r in range(rows)]


def test_a_tier_left_in_a_hard_passage_is_valued_again_when_the_text_turns_easy():
    """Acceptance follows the text. In a hard passage the cheap chain leads and runs alone; once the text
    turns easy the tree leads again, although it has not run since: the chain's acceptance tells the
    controller that the text got easier, and the tree's strength was learned apart from the passage it
    last ran in."""
    tiers = tier_ladder([[0], [1], [0, 0]], 4, 2, torch.device("cpu"))
    controller = TierController(tiers, AdaptiveConfig(explore_every=10**6, window_warmup=0))
    controller.plain_cost[4], controller.ratio[4] = 1.0, [1.0, 1.2, 1.4, 1.5]
    tree = controller.names.index("tree4")
    strength = {1: 0.5, 2: 0.8, tree: 1.2}  # accepted tokens a row at the easy passage's difficulty

    def run(steps: int, difficulty: float) -> list[int]:
        chosen = []
        for _ in range(steps):
            index = controller.choose(4, 10, 10)
            chosen.append(index)
            controller.observe(index, rows_accepting(strength[index] * difficulty))
        return chosen

    run(60, 1.0)  # the probes, then the tree
    assert run(20, 1.0)[-1] == tree
    assert set(run(200, 0.3)[-50:]) == {1}  # hard: 10 + 10 * 0.15 a row in 1.2 s beats 10 + 10 * 0.36 in 1.5
    assert run(200, 1.0)[-1] == tree
    assert controller.expected(tree) == pytest.approx(1.2, rel=0.1)


def test_every_tier_runs_on_a_few_rows_before_the_tiers_are_ranked():
    """A tree accepts more than a chain's acceptance would suggest: no tier is ranked before each has run on
    probe_rows drafting rows, and a window with probing steps in it is not measured (the probes' one-time
    cost is not drafting's); then the tier that accepted most for its cost leads."""
    tiers = tier_ladder([[0], [1], [0, 0]], 4, 2, torch.device("cpu"))
    controller = TierController(tiers, AdaptiveConfig(explore_every=10**6, window_warmup=0))
    controller.plain_cost[4], controller.ratio[4] = 1.0, [1.0, 1.5, 1.7, 1.8]
    tree = controller.names.index("tree4")
    gain = {1: 0, 2: 0, tree: 2}  # accepted tokens a row
    probed = []
    while controller.probing() is not None:
        index = controller.choose(4, 4, 4)
        probed.append(index)
        controller.observe(index, [gain[index]] * 4)
    assert probed == [1, 2, tree] * 2  # in turn, 4 rows a step, until each has run on 8
    assert controller.window is not None and controller.window.drafting and not controller.window.measured
    assert controller.choose(4, 4, 4) == tree


def test_a_request_accepting_little_pauses_and_is_judged_afresh_on_new_steps():
    """Below the cutoff over request_min_steps drafting steps, a request drafts nothing for request_pause
    steps; after the pause one rejected step alone does not pause it again."""
    cfg = AdaptiveConfig()
    request, step = RequestAcceptance(), 0
    for _ in range(cfg.request_min_steps - 1):
        request.update(0, step, cfg)
        step += 1
        assert request.drafts(step)
    request.update(0, step, cfg)
    assert not request.drafts(step + cfg.request_pause - 1) and request.drafts(step + cfg.request_pause)
    step += cfg.request_pause
    request.update(0, step, cfg)
    for accepted in [2] * (cfg.request_min_steps - 1):
        request.update(accepted, step, cfg)
        step += 1
    assert request.drafts(step) and request.mean > cfg.request_cutoff


def test_idle_time_ends_a_window_unmeasured_and_plain_steps_say_why():
    """A window open when the last request leaves ends without a rate (the wait for the next request is
    neither mode's), and the controller counts its plain steps by why."""
    tiers = tier_ladder([[0], [1], [0, 0]], 4, 2, torch.device("cpu"))
    now = [0.0]
    controller = TierController(tiers, AdaptiveConfig(explore_every=10**6, probe_rows=0), clock=lambda: now[0])
    controller.plain_cost[4], controller.ratio[4] = 1.0, [1.0, 1.5] + [10.0] * (len(tiers) - 2)
    steps = controller.config.window_steps
    for _ in range(steps):  # the bucket's warm-up window: plain, unmeasured
        assert controller.choose(4, 4, 4) == 0
        now[0] += 1.0
        controller.emitted(4, 4)
    assert controller.choose(4, 4, 4) == 1  # the first measured window drafts
    controller.emitted(4, 8)
    controller.idle()
    now[0] += 1000.0  # no request for a while
    for _ in range(steps):
        assert controller.choose(4, 4, 4) == 1  # a new window, drafting still (no window has closed)
        now[0] += 1.0
        controller.emitted(4, 6)
    assert controller.delivered == {(4, True): 6.0}  # 6 tokens a second: the idle 1,000 s are not in it
    assert controller.choose(4, 4, 0) == 0  # no row drafts
    assert controller.choose(4, 4, 4) == 0  # plain's first measured window
    assert controller.plain_why == {"warm-up window": steps, "no row drafts": 1, "plain window": 1}


def test_a_bucket_runs_the_mode_whose_windows_delivered_more():
    """Plain or drafting is what the windows measured (wall time, everything inside them counted), whatever
    the tiers' estimates say: the losing mode runs every other window while within the loss allowed, fewer
    while far behind or while its windows take longer, so that exploring costs at most window_loss of the
    bucket's tokens; drafting windows draft in every step."""
    tiers = tier_ladder([[0], [1], [0, 0]], 4, 2, torch.device("cpu"))
    now = [0.0]
    config = AdaptiveConfig(explore_every=10**6, window_margin=0.0, probe_rows=0)
    controller = TierController(tiers, config, clock=lambda: now[0])
    controller.plain_cost[4], controller.ratio[4] = 1.0, [1.0, 3.0] + [10.0] * (len(tiers) - 2)
    controller.accepted[1] = 0.5  # the estimate says plain wins: 1.5 tokens a row in 3 s against 1 in 1 s
    steps, loss = controller.config.window_steps, controller.config.window_loss

    def window(tokens_a_step: dict[bool, int], seconds_a_step: dict[bool, float]) -> tuple[bool, float, int]:
        """One window's steps: (whether it drafted, its seconds, its tokens)."""
        chosen = [controller.choose(4, 4, 4) for _ in range(steps)]
        drafting = controller.window is not None and controller.window.drafting
        assert all(c == 1 for c in chosen) if drafting else all(c == 0 for c in chosen)
        for _ in range(steps):
            now[0] += seconds_a_step[drafting]
            controller.emitted(4, tokens_a_step[drafting])
        return drafting, steps * seconds_a_step[drafting], steps * tokens_a_step[drafting]

    def lost(runs: list[tuple[bool, float, int]], best: float) -> float:
        """The share of the tokens the best mode alone would have emitted in the same time."""
        return 1.0 - sum(t for _, _, t in runs) / (best * sum(s for _, s, _ in runs))

    same = {True: 1.0, False: 1.0}
    modes = [window({True: 41, False: 40}, same)[0] for _ in range(21)]
    # A plain warm-up window, then the modes take turns until each is measured window_samples times.
    samples = controller.config.window_samples
    assert modes[: 1 + 2 * samples] == [False] + [True, False] * samples
    assert modes[1 + 2 * samples :].count(False) == 5  # then plain, 2.4 % behind, one window in 1 + ceil(1.4) = 3
    assert controller.measured == {(4, True): 20 - 5 - samples, (4, False): 5 + samples}
    close = [window({True: 40, False: 40}, same)[0] for _ in range(20)]
    assert 9 <= close.count(True) <= 11  # equal: every other window
    # Far behind: once the means have settled, one window in 1 + 74.
    runs = [window({True: 10, False: 40}, same) for _ in range(1000)]
    assert 2 <= [d for d, _, _ in runs[-300:]].count(True) <= 5
    assert lost(runs[-300:], 40.0) <= loss * 1.05
    # Drafting windows taking 3 plain windows' time at the same rate: one in 1 + 3 * 74.
    runs = [window({True: 30, False: 40}, {True: 3.0, False: 1.0}) for _ in range(3000)]
    assert 3 <= [d for d, _, _ in runs[-900:]].count(True) <= 5
    assert lost(runs[-900:], 40.0) <= loss * 1.05


def recent_windows(bucket: int, drafting: bool, windows: list[tuple[int, float, int]]) -> deque[Window]:
    """Closed windows of (tokens, seconds, prompt chunks)."""
    return deque(Window(bucket, drafting, 0.0, tokens=t, seconds=s, prefills=p) for t, s, p in windows)


def test_drafting_leads_a_bucket_only_past_the_margin():
    """Drafting windows delivering 5 % more than plain ones lose to a 10 % margin: plain leads, drafting is
    explored one window in 1 + ceil(3.5) = 5 (4.5 % short after the margin); 20 % more leads."""
    tiers = tier_ladder([[0], [1], [0, 0]], 4, 2, torch.device("cpu"))
    controller = TierController(tiers, AdaptiveConfig(window_margin=0.1))
    controller.recent[(4, True)] = recent_windows(4, True, [(105, 1.0, 0)])
    controller.recent[(4, False)] = recent_windows(4, False, [(100, 1.0, 0)])
    assert controller.rate(4, True) < controller.rate(4, False)
    assert controller.explore_interval(4, False) == 5
    controller.recent[(4, True)] = recent_windows(4, True, [(120, 1.0, 0)])
    assert controller.rate(4, True) > controller.rate(4, False)


def test_prompt_chunks_are_charged_apart_from_the_modes():
    """A burst of prompts in a plain window does not hand the bucket to drafting: one slope for both modes
    (0.5 s a chunk here) takes the chunks out, and plain's 40 tokens a second between prompts beat
    drafting's 38, though as they ran the windows delivered 24 and 32.6."""
    tiers = tier_ladder([[0], [1], [0, 0]], 4, 2, torch.device("cpu"))
    controller = TierController(tiers, AdaptiveConfig(window_margin=0.0))
    controller.recent[(4, False)] = recent_windows(4, False, [(40, 1.0, 0), (40, 3.0, 4), (40, 1.0, 0)])
    controller.recent[(4, True)] = recent_windows(4, True, [(38, 1.0, 0), (38, 1.0, 0), (38, 1.5, 1)])
    assert controller.delivered[(4, False)] == pytest.approx(24.0)
    assert controller.delivered[(4, True)] == pytest.approx(114 / 3.5)
    assert controller.chunk_seconds(4) == pytest.approx(0.5)
    assert controller.rate(4, False) == pytest.approx(40.0)
    assert controller.rate(4, True) == pytest.approx(38.0)
    # Chunks that never vary, or a slope that would leave a window no time, charge nothing apart.
    controller.recent[(4, False)] = recent_windows(4, False, [(40, 1.0, 2), (40, 1.0, 2)])
    controller.recent[(4, True)] = recent_windows(4, True, [(38, 1.0, 2)])
    assert controller.chunk_seconds(4) == 0.0
    controller.recent[(4, True)] = recent_windows(4, True, [(38, 0.1, 0), (38, 5.0, 1)])
    assert controller.chunk_seconds(4) == 0.0


def test_replayed_windows_keep_their_choice_through_bursts_of_prompts():
    """Windows as a load run records them, plain 40 and drafting 38 tokens a window-second between prompts,
    a burst of 4 chunks (0.5 s each) in every third plain window: charged apart, every choice is plain; the
    former running means of the windows as they ran choose drafting."""
    from pipeline.bench.probes.window_replay import former_choice, replay

    windows = []
    for i in range(24):
        drafting = i % 2 == 0
        chunks = 4 if i % 6 == 3 else 0
        tokens = 38 if drafting else 40
        windows.append(Window(64, drafting, 0.0, tokens=tokens, seconds=1.0 + 0.5 * chunks, prefills=chunks))
    config = AdaptiveConfig(window_margin=0.0)
    made, fitted, _, fit_drafts = replay(windows, config)
    assert made > 0 and fitted == made and not fit_drafts
    assert former_choice(windows, config)


def test_a_modes_rate_weighs_its_windows_by_their_time():
    """A window a burst of prefills stretched counts for its time, as in a run: 64 tokens in 1 s and 64 in
    3 s are 32 tokens a second (128 in 4 s), not the 42.7 their rates average to; every closed window is kept
    with the prompt chunks prefilled in it."""
    tiers = tier_ladder([[0], [1], [0, 0]], 4, 2, torch.device("cpu"))
    now = [0.0]
    config = AdaptiveConfig(explore_every=10**6, window_warmup=0, window_steps=2, probe_rows=0)
    controller = TierController(tiers, config, clock=lambda: now[0])
    controller.plain_cost[4], controller.ratio[4] = 1.0, [1.0] * len(tiers)
    for seconds, prefills in [(1.0, 0), (0.5, 0), (3.0, 2), (0.5, 0)]:  # drafting, plain, drafting, plain
        controller.choose(4, 4, 4)
        controller.prefilled(prefills)
        for _ in range(2):
            now[0] += seconds / 2
            controller.emitted(4, 32)
    assert controller.delivered[(4, True)] == pytest.approx(32.0)
    assert controller.delivered[(4, False)] == pytest.approx(128.0)
    assert [(w.drafting, w.seconds, w.prefills) for w in controller.history] == [
        (True, 1.0, 0),
        (False, 0.5, 0),
        (True, 3.0, 2),
        (False, 0.5, 0),
    ]


def test_the_load_bench_interleaves_controller_variants_over_spread_lengths(built, tmp_path):
    """`load --adaptive A --adaptive B` runs each level under both controllers in turn, with each level's
    windows in its rows; `--length-spread` gives request i the seeded length its LevelSize names, so that
    requests started together do not all end together."""
    from pipeline.bench import load

    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]))
    out = tmp_path / "out"
    argv = ["--engine", str(built["eagle"]), "--prompt-ids", str(ids), "--concurrency", "1,2", "--max-tokens", "12"]
    argv += ["--requests-per-client", "2", "--length-spread", "0.5", "--label", "variants", "--output", str(out)]
    assert load.main([*argv, "--adaptive", "base", "--adaptive", "window_margin=0"]) == 0
    results = json.loads(next(out.glob("*.json")).read_text())["results"]
    size = load.LevelSize(2, load.MIN_REQUESTS, 0.5)
    lengths = [size.max_tokens(i, 12) for i in range(size.total(2))]
    assert len(set(lengths)) > 1 and all(6 <= n <= 18 for n in lengths)
    assert sorted(results) == ["in-process T=0 base", "in-process T=0 window_margin=0"]
    for rows in results.values():
        assert [r["concurrency"] for r in rows] == [1, 2]
        for r in rows:
            n = size.total(r["concurrency"])
            assert r["requests"] == n and not r["errors"]
            assert r["output_tokens"] == sum(lengths[:n])
            assert "windows" in r["controller"]


def test_the_load_bench_sweeps_each_engine_and_plots_the_speedup_over_the_first(
    built, tiny_llama_dir, tmp_path, capsys
):
    """`load --engine PLAIN --engine M ...` (make bench-serving's every method) sweeps each engine in turn into
    its own JSON and prints and plots each method's speed-up over the first at every level."""
    from pipeline.bench import load

    engines = [shutil.copytree(convert_and_build(tiny_llama_dir, tmp_path / "p"), tmp_path / "plain")]
    engines += [shutil.copytree(built[name], tmp_path / name) for name in ("ngram", "eagle")]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[1, 2, 3, 4], [5, 6, 7]]))
    out = tmp_path / "out"
    argv = [a for e in engines for a in ("--engine", str(e))]
    argv += ["--prompt-ids", str(ids), "--concurrency", "1,2", "--max-tokens", "6", "--min-requests", "2"]
    assert load.main([*argv, "--requests-per-client", "1", "--output", str(out)]) == 0
    sweeps = [json.loads(p.read_text()) for p in out.glob("load-*.json")]
    assert sorted(s["label"] for s in sweeps) == ["eagle", "ngram", "plain"]
    for sweep in sweeps:
        assert [r["concurrency"] for r in sweep["results"]["in-process T=0"]] == [1, 2]
    printed = capsys.readouterr().out.splitlines()
    for name in ("ngram", "eagle"):
        assert sum(line.split()[:2] == [name, "C="] for line in printed) == 2  # a row a level
    assert len(list(out.glob("speedup-*.png"))) == 1
    with pytest.raises(SystemExit, match="take one --engine"):
        load.main([*argv, "--label", "x"])
    with pytest.raises(SystemExit, match="same name"):
        load.main(["--engine", str(engines[0]), "--engine", str(built["eagle"]), "--engine", str(built["ngram"])])


def test_the_load_bench_refuses_a_bad_prompt_file_before_loading_the_engine(built, tmp_path, capsys, monkeypatch):
    """A prompt file that is not there is one clear line and exit 2, before the engine's minute of loading."""
    from pipeline.bench import load

    monkeypatch.setattr(load, "load_engine", lambda args: pytest.fail("the engine loaded before the prompts"))
    missing = tmp_path / "nope.jsonl"
    assert load.main(["--engine", str(built["ngram"]), "--prompts", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"load: error: --prompts {missing}: file not found"


def test_the_load_bench_sends_poisson_arrivals_with_at_most_c_in_flight():
    """With a request rate, requests arrive at seeded exponential gaps (the level lasts at least their sum)
    and no more than the level's concurrency run at once, later arrivals waiting for a slot."""
    from pipeline.bench import load

    flight, most, lock = [0], [0], threading.Lock()

    def client(ids: list[int], params: SamplingParams) -> load.Timing:
        with lock:
            flight[0] += 1
            most[0] = max(most[0], flight[0])
        time.sleep(0.05)
        with lock:
            flight[0] -= 1
        return load.Timing(0.0, [0.0] * (params.max_tokens - 1), 0.05, params.max_tokens)

    for rate in (1000.0, 20.0):  # arrivals faster than requests end, then about as fast
        size = load.LevelSize(per_client=4, minimum=8, request_rate=rate)
        most[0] = 0
        row = load.run_level(client, [[1, 2]], 2, SamplingParams(max_tokens=4, end_id=-1), size)
        assert row["requests"] == 8 and row["request_rate"] == rate and not row["errors"]
        assert row["seconds"] >= sum(size.gaps(8))
        assert most[0] == 2 if rate == 1000.0 else most[0] <= 2  # the slots fill and are never passed


def test_a_dynamic_tier_is_as_large_as_its_candidates_and_nodes_allow():
    """EAGLE-2's tier keeps at most its candidates (top-k, then width x top-k a depth) and max_nodes nodes, and
    is no deeper than those nodes reach."""
    from pipeline.engine.config import DynamicTreeConfig

    cfg = DynamicTreeConfig(top_k=4, depth=4, max_non_leaves_per_layer=2)
    sizes = {n: Tier.build_dynamic(n, cfg, torch.device("cpu")) for n in (3, 6, 64)}
    assert [(t.name, t.num_nodes, t.depth) for t in sizes.values()] == [
        ("dynamic3", 3, 2),
        ("dynamic6", 6, 4),
        ("dynamic29", 29, 4),  # 4 + 3 depths x 2 x 4 candidates, and the root
    ]


def test_tier_turns_record_each_tiers_first_and_later_steps(built, plain):
    """The tier_mix probe's controller runs the tiers in blocks and keeps each drafting step's acceptance
    by tier and by whether the step followed another tier; outputs stay plain greedy's."""
    from pipeline.bench.probes.tier_mix import run

    engine = open_engine(built["eagle"])
    names = engine.scheduler.controller.names
    order = [names.index("chain1"), names.index("chain2")]
    ids, params = mixed_requests(plain)[2]
    turns = run(engine, [ids], order, 3, params.max_tokens)
    assert {index for index, _ in turns.records} == set(order)
    assert turns.records[(order[0], True)] and turns.records[(order[0], False)]
    assert engine.generate(ids, params).token_ids == plain.generate(ids, params).token_ids


def test_eval_acceptance_measures_the_engines_own_tree_in_every_step(built, tmp_path, capsys):
    """The draft's acceptance, not the load controller's choices: every decode step drafts with the engine's
    largest tier (a request's last step may have nothing left to draft), on prompts given as token ids."""
    from pipeline.cli import main

    ids, report = tmp_path / "ids.json", tmp_path / "report.json"
    ids.write_text(json.dumps([[1, 5, 9, 5, 9, 5], [3, 4, 5, 6, 7, 8, 9, 10, 11]]))
    argv = ["eval-acceptance", "--engine", str(built["eagle"]), "--prompt-ids", str(ids), "--max-tokens", "12"]
    assert main([*argv, "--report", str(report)]) == 0
    got = json.loads(report.read_text())
    assert got["prompts"] == 2 and got["tier"] == "full" and got["generated_tokens"] == 24
    assert got["drafted_per_depth"][0] >= got["steps"] - got["prompts"] > 0
    assert len(got["per_depth_acceptance"]) >= 2  # a tree deeper than one token
    ids.write_text(json.dumps([[1, 2], []]))
    assert main(argv) == 2
    assert "--prompt-ids" in capsys.readouterr().err
    ids.write_text(json.dumps([[1, 2], [10**9]]))  # a token outside the vocabulary: one message, no traceback
    assert main(argv) == 2
    assert "prompt 1 of" in capsys.readouterr().err
