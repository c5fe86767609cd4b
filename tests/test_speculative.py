"""Speculative decoding is lossless under greedy: every method, tree and length gives plain greedy's tokens.

Random drafts exercise the rejection path; oracle drafts (which know the target's own greedy
continuation) exercise full-depth acceptance end to end.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import convert_and_build, stream_by_run_ahead
from torch import nn

from pipeline.convert.tiny import make_random_eagle, make_random_eagle3, make_random_medusa, make_tiny_model
from pipeline.engine.config import DynamicTreeConfig, SpecConfig
from pipeline.engine.eagle import EagleNet, EagleProposer
from pipeline.engine.graphs import GraphedTarget
from pipeline.engine.kernels.routing import TORCH_TOPK
from pipeline.engine.loader import open_engine
from pipeline.engine.medusa import MedusaProposer, medusa_heads
from pipeline.engine.runner import Engine, SamplingParams
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.engine.speculative import StepInput
from pipeline.engine.tree import build_tree, parse_choices

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog and then", "hello hello hello"]
MAX_TOKENS = (7, 13, 30)  # 7 and 13 end in the middle of a tree
HIDDEN = 64
# The tests of the one-request-at-a-time decode loop (oracle proposers swapped in, run-ahead groups).
SERIAL = SchedulerConfig(batched=False)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path, tmp_path_factory) -> Engine:
    return open_engine(convert_and_build(tiny_llama_dir, tmp_path_factory.mktemp("plain")))


def vocab_of(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def greedy(engine: Engine, text: str, max_tokens: int):
    return engine.generate(engine.tokenizer(text).input_ids, SamplingParams(max_tokens=max_tokens, end_id=-1))


def assert_lossless(engine: Engine, plain: Engine) -> list[float]:
    lengths = []
    for text in PROMPTS:
        for n in MAX_TOKENS:
            got = greedy(engine, text, n)
            assert got.token_ids == greedy(plain, text, n).token_ids, (engine.spec.mode, text, n)
            assert got.stats.acceptance_length >= 1.0
            lengths.append(got.stats.acceptance_length)
    return lengths


SPEC_CASES = {
    "medusa-chain4": lambda d, v: dict(
        medusa=make_random_medusa(d / "m", HIDDEN, v, with_lm_head=False), choices="chain4"
    ),
    "medusa-mc_sim_7b_63": lambda d, v: dict(medusa=make_random_medusa(d / "m", HIDDEN, v, with_lm_head=False)),
    "medusa-wide": lambda d, v: dict(
        medusa=make_random_medusa(d / "m", HIDDEN, v, heads=2, with_lm_head=False), choices="wide8x2", max_draft_len=16
    ),
    "medusa-dynamic": lambda d, v: dict(
        medusa=make_random_medusa(d / "m", HIDDEN, v, with_lm_head=False),
        dynamic_tree=True,
        dynamic_top_k=4,
        max_draft_len=12,
    ),
    "medusa-random-lm-head": lambda d, v: dict(medusa=make_random_medusa(d / "m", HIDDEN, v), choices="top16"),
    "eagle-static": lambda d, v: dict(eagle=make_random_eagle(d / "e", HIDDEN, v, with_embedding=False)),
    "eagle-dynamic": lambda d, v: dict(
        eagle=make_random_eagle(d / "e", HIDDEN, v),
        dynamic_tree=True,
        dynamic_top_k=4,
        dynamic_depth=4,
        max_draft_len=12,
    ),
    "eagle-two-layers": lambda d, v: dict(
        eagle=make_random_eagle(d / "e", HIDDEN, v, layers=2), dynamic_tree=True, dynamic_top_k=4, max_draft_len=12
    ),
    "eagle3-dynamic": lambda d, v: dict(
        eagle3=make_random_eagle3(d / "e3", HIDDEN, v),
        dynamic_tree=True,
        dynamic_top_k=4,
        dynamic_depth=3,
        max_draft_len=10,
    ),
    "eagle3-static-small-vocab": lambda d, v: dict(
        eagle3=make_random_eagle3(d / "e3", HIDDEN, v, draft_vocab=128), choices="top16", max_draft_len=16
    ),
    "draft-model": lambda d, v: dict(
        draft_model=make_tiny_model(d / "draft", seed=5, num_hidden_layers=1), max_draft_len=3
    ),
    "ngram": lambda d, v: dict(speculative="ngram", ngram_k=3),
}


@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_greedy_speculation_is_lossless(case, tiny_llama_dir, plain, tmp_path):
    engine = open_engine(
        convert_and_build(tiny_llama_dir, tmp_path / "engine", **SPEC_CASES[case](tmp_path, vocab_of(tiny_llama_dir)))
    )
    assert engine.spec.mode != "none"
    assert_lossless(engine, plain)


def test_draft_model_oracle_accepts_every_token(tiny_llama_dir, plain, tmp_path):
    """The target as its own draft: every step accepts all k tokens."""
    k = 4
    engine = open_engine(convert_and_build(tiny_llama_dir, tmp_path, draft_model=tiny_llama_dir, max_draft_len=k))
    got = greedy(engine, PROMPTS[0], 31)
    assert got.token_ids == greedy(plain, PROMPTS[0], 31).token_ids
    assert got.stats.acceptance_length == k + 1 and got.stats.per_depth_acceptance == [1.0] * k


# ---------------------------------------------------------------------------------------------
# Oracles: drafts that know the target's greedy continuation `ref` (prompt + output), by position.


class OracleMedusa(MedusaProposer):
    def __init__(self, base: MedusaProposer, ref: list[int]):
        super().__init__(base.heads, base.tree, base.lm_head, base.dynamic, base.max_draft_len)
        self.ref = ref

    def prepare(self, step: StepInput) -> None:
        super().prepare(step)
        self.length = step.length  # a host int on the CPU

    def logits(self) -> torch.Tensor:
        """Head d is sure of the right token and has no preference among the others."""
        depth = len(self.heads)
        right = torch.tensor([self.ref[self.length + d] for d in range(1, depth + 1)])
        out = torch.full((depth, self.vocab_size), -1.0)
        out[torch.arange(depth), right] = 10.0
        return out


class OracleNet(nn.Module):
    """Stands in for an EAGLE draft: the pair at position j guesses ref[j + 2], whatever its inputs."""

    def __init__(self, real: nn.Module, ref: list[int]):
        super().__init__()
        self.real, self.ref = real, torch.tensor(ref)
        self.cfg, self.rotary = real.cfg, real.rotary
        self.capture_layers = getattr(real, "capture_layers", ())
        self.num_cache_layers = real.num_cache_layers
        self.lm_head = real.lm_head
        self.drafter = TORCH_TOPK  # the tree's candidates through torch.topk

    def target_features(self, target):
        return self.real.target_features(target)

    def forward(self, tokens, features, ctx):
        guess = self.ref[(ctx.positions[0] + 2).clamp(max=len(self.ref) - 1)]
        return guess.float()[None, :, None].expand(1, -1, self.cfg.hidden_size).clone()

    def logits(self, hidden):
        out = torch.full((hidden.shape[0], self.cfg.vocab_size), -1.0)
        out[torch.arange(hidden.shape[0]), hidden[:, 0].long()] = 10.0
        return out

    def top_logp(self, hidden, k):
        return torch.log_softmax(self.logits(hidden), dim=-1).topk(k, dim=-1)


def reference(plain: Engine, text: str, max_tokens: int) -> list[int]:
    ids = plain.tokenizer(text).input_ids
    return ids + greedy(plain, text, max_tokens).token_ids


def test_medusa_heads_share_the_targets_lm_head(tiny_llama_dir, tmp_path):
    """Heads whose LM heads are the target's (filled at conversion) run it once for all depths, and
    guess what separate copies would; heads with LM heads of their own keep them."""
    from pipeline.engine.model import Linear

    vocab = vocab_of(tiny_llama_dir)
    engine = open_engine(
        convert_and_build(
            tiny_llama_dir, tmp_path / "a", medusa=make_random_medusa(tmp_path / "m", HIDDEN, vocab, with_lm_head=False)
        )
    )
    shared = engine.proposer
    assert shared.lm_head is engine.target.lm_head and all(h.lm_head is None for h in shared.heads)
    for head in shared.heads:  # a copy of the target's each, as the checkpoint holds them
        head.lm_head = Linear(HIDDEN, vocab, bias=False)
        head.lm_head.weight.data.copy_(engine.target.lm_head.weight)
    separate = MedusaProposer(shared.heads, shared.tree)
    for seed in range(3):
        hidden = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(seed))
        shared.hidden.copy_(hidden)
        separate.hidden.copy_(hidden)
        assert torch.equal(shared.guesses(), separate.guesses())
    own = open_engine(
        convert_and_build(tiny_llama_dir, tmp_path / "b", medusa=make_random_medusa(tmp_path / "m2", HIDDEN, vocab))
    )
    assert own.proposer.lm_head is None and all(h.lm_head is not None for h in own.proposer.heads)


def test_a_new_proposer_gets_a_graph_step_of_its_own(tiny_llama_dir, plain, tmp_path):
    """The greedy step objects capture a proposer's draft with its buffers: after a swap, replaying the
    old capture would draft from the old proposer's buffers (wrong roots, wrong tokens)."""
    engine = open_engine(
        convert_and_build(
            tiny_llama_dir,
            tmp_path,
            medusa=make_random_medusa(tmp_path / "m", HIDDEN, vocab_of(tiny_llama_dir), with_lm_head=False),
        ),
        serving=SERIAL,
    )
    engine.graphs = GraphedTarget(engine.target, engine.cache, engine.proposer.capture_layers, compile=False)
    free = greedy(plain, PROMPTS[0], 24).token_ids
    assert greedy(engine, PROMPTS[0], 24).token_ids == free  # the random heads' step, captured
    engine.proposer = OracleMedusa(engine.proposer, reference(plain, PROMPTS[0], 40))
    got = greedy(engine, PROMPTS[0], 24)
    assert got.token_ids == free and got.stats.acceptance_length > 2


@pytest.mark.parametrize("case", ["medusa-mc_sim_7b_63", "medusa-dynamic"])
def test_medusa_oracle_accepts_full_depth(case, tiny_llama_dir, plain, tmp_path):
    engine = open_engine(
        convert_and_build(tiny_llama_dir, tmp_path / "engine", **SPEC_CASES[case](tmp_path, vocab_of(tiny_llama_dir))),
        serving=SERIAL,
    )
    n, depth = 30, len(engine.proposer.heads)
    ref = reference(plain, PROMPTS[1], n + depth + 1)
    engine.proposer = OracleMedusa(engine.proposer, ref)
    got = greedy(engine, PROMPTS[1], n)
    assert got.token_ids == ref[len(ref) - (n + depth + 1) :][:n]
    assert got.stats.acceptance_length == depth + 1
    assert got.stats.per_depth_acceptance == [1.0] * depth


@pytest.mark.parametrize("case", ["eagle-static", "eagle-dynamic", "eagle3-dynamic"])
def test_eagle_oracle_accepts_full_depth(case, tiny_llama_dir, plain, tmp_path):
    engine = open_engine(
        convert_and_build(tiny_llama_dir, tmp_path / "engine", **SPEC_CASES[case](tmp_path, vocab_of(tiny_llama_dir))),
        serving=SERIAL,
    )
    proposer: EagleProposer = engine.proposer
    depth = proposer.tree.max_depth if proposer.tree is not None else proposer.dynamic.depth
    n = 24
    ref = reference(plain, PROMPTS[0], n + depth + 2)
    proposer.net = OracleNet(proposer.net, ref)
    got = greedy(engine, PROMPTS[0], n)
    assert got.token_ids == greedy(plain, PROMPTS[0], n).token_ids
    assert got.stats.acceptance_length == depth + 1


# ---------------------------------------------------------------------------------------------
# SmolLM2: random drafts on the real target, in-process (same engine, proposer swapped in).


@pytest.mark.slow
def test_smollm2_random_medusa_and_eagle_are_lossless(smollm2_engine_dir):
    plain_engine = open_engine(smollm2_engine_dir)
    target = plain_engine.target
    torch.manual_seed(0)
    heads = medusa_heads(4, 1, target.cfg.hidden_size, target.cfg.vocab_size, "silu").eval()
    for head in heads:
        head.lm_head.weight.data.copy_(target.lm_head.weight)
    net = EagleNet(replace(target.cfg, num_layers=1)).eval()
    net.vocab_embedding.weight.data.copy_(target.vocab_embedding.weight)
    net.lm_head.weight.data.copy_(target.lm_head.weight)
    proposers = {
        "medusa": MedusaProposer(heads, build_tree(parse_choices("mc_sim_7b_63"))),
        "eagle-dynamic": EagleProposer(
            net, 2048, None, DynamicTreeConfig(top_k=6, depth=4, max_non_leaves_per_layer=6), 16
        ),
    }
    # One prompt each: a 64-node verification on 2 CPU cores is the slow part of the suite.
    cases = {"medusa": ("The capital of France is", 12), "eagle-dynamic": ("Write a short poem about the sea.", 16)}
    for name, proposer in proposers.items():
        text, n = cases[name]
        engine = Engine(target, plain_engine.tokenizer, plain_engine.limits, SpecConfig(mode="medusa"), proposer)
        assert greedy(engine, text, n).token_ids == greedy(plain_engine, text, n).token_ids, name


# The committed drafts (drafts/smollm2-<kind>), converted as `make build-engines` does, with the CPU's small
# EAGLE trees, verified in the engine's full tree every step (the adaptive controller may pick smaller tiers
# on a slow host). A random draft accepts almost nothing on the real target; a converter that misplaced a
# trained tensor would fall to that.
CPU_TREE = dict(dynamic_tree=True, dynamic_top_k=4, dynamic_depth=2, max_draft_len=5)
SHIPPED_DRAFTS = {"medusa": {}, "eagle": CPU_TREE, "eagle3": CPU_TREE}
TRAINED_ACCEPTANCE_AT_LEAST = 1.5
SHIPPED_PROMPT, SHIPPED_TOKENS = "Write a short poem about the sea.", 24


@pytest.fixture(scope="module")
def smollm2_plain_tokens(smollm2_engine_dir) -> list[int]:
    return greedy(open_engine(smollm2_engine_dir), SHIPPED_PROMPT, SHIPPED_TOKENS).token_ids


@pytest.mark.slow
@pytest.mark.parametrize("kind", SHIPPED_DRAFTS)
def test_shipped_drafts_are_lossless_and_accept(kind, smollm2_source, smollm2_plain_tokens, tmp_path):
    folder = Path(__file__).resolve().parents[1] / "drafts" / f"smollm2-{kind}"
    built = convert_and_build(smollm2_source, tmp_path, **{kind: folder}, **SHIPPED_DRAFTS[kind])
    engine = open_engine(built, serving=SchedulerConfig(speculation="full"))
    got = greedy(engine, SHIPPED_PROMPT, SHIPPED_TOKENS)
    assert got.token_ids == smollm2_plain_tokens
    assert got.stats.acceptance_length >= TRAINED_ACCEPTANCE_AT_LEAST, got.stats


def test_sampling_modes_run_and_are_seeded(tiny_llama_dir, plain, tmp_path):
    """Lossless sampling (EAGLE, draft model) and Medusa typical acceptance: reproducible per seed, greedy still
    exact."""
    vocab = vocab_of(tiny_llama_dir)
    cases = {
        "typical": dict(
            medusa=make_random_medusa(tmp_path / "m", HIDDEN, vocab, with_lm_head=False), acceptance="typical"
        ),
        "eagle": SPEC_CASES["eagle-dynamic"](tmp_path, vocab),
        "draft": SPEC_CASES["draft-model"](tmp_path, vocab),
    }
    hot = SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=11, end_id=-1)
    for name, flags in cases.items():
        engine = open_engine(convert_and_build(tiny_llama_dir, tmp_path / name, **flags))
        ids = engine.tokenizer(PROMPTS[1]).input_ids
        first = engine.generate(ids, hot)
        assert len(first.token_ids) == 20 and all(0 <= t < vocab for t in first.token_ids)
        assert engine.generate(ids, hot).token_ids == first.token_ids, name
        assert greedy(engine, PROMPTS[1], 13).token_ids == greedy(plain, PROMPTS[1], 13).token_ids, name


def test_tree_from_ranks_keeps_the_most_accepted_paths():
    """The fitted tree is prefix-closed, its expected acceptance is what expected_acceptance measures,
    and no other tree of the same size does better (brute force over every tree on a small case)."""
    import itertools

    from pipeline.engine.tree import expected_acceptance, tree_from_ranks, validate_choices

    gen = torch.Generator().manual_seed(3)
    ranks = torch.minimum(torch.randint(0, 4, (500, 3), generator=gen), torch.randint(0, 4, (500, 3), generator=gen))
    choices, expected = tree_from_ranks(ranks, 5, 3)
    validate_choices(choices)
    assert len(choices) == 5 and expected == pytest.approx(expected_acceptance(ranks, choices))
    paths = [list(p) for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    closed = [t for t in itertools.combinations(paths, 5) if all(p[:-1] in t or len(p) == 1 for p in t)]
    assert expected == pytest.approx(max(expected_acceptance(ranks, list(t)) for t in closed))
    # One non-leaf a depth (TensorRT-LLM's max_non_leaves_per_layer): the best such tree, a single spine.
    bounded, bounded_expected = tree_from_ranks(ranks, 5, 3, max_non_leaves=1)
    validate_choices(bounded)
    assert len(bounded) == 5 and len({tuple(p[:-1]) for p in bounded if len(p) == 2}) <= 1
    spines = [t for t in closed if len({tuple(p[:-1]) for p in t if len(p) == 2}) <= 1]
    assert bounded_expected == pytest.approx(max(expected_acceptance(ranks, list(t)) for t in spines))
    assert bounded_expected < expected


@pytest.mark.parametrize("case", ["eagle-dynamic", "eagle3-dynamic", "medusa-mc_sim_7b_63", "medusa-dynamic"])
def test_running_ahead_changes_only_how_tokens_are_grouped(case, tiny_llama_dir, plain, tmp_path):
    """CUDA engines queue 8 greedy steps per host read (the length stays on the device); on the CPU
    4 give the tokens, stop reasons and step counts of one step at a time, with the random draft and
    with an oracle (several tokens a step), and a stop inside a group drops the steps after it."""
    engine = open_engine(
        convert_and_build(tiny_llama_dir, tmp_path / "engine", **SPEC_CASES[case](tmp_path, vocab_of(tiny_llama_dir))),
        serving=SERIAL,
    )
    assert engine.proposer.runs_ahead
    n = 24
    free = greedy(plain, PROMPTS[0], n).token_ids
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    requests = [
        SamplingParams(max_tokens=n, end_id=-1),
        SamplingParams(max_tokens=n, end_id=free[9]),
        SamplingParams(max_tokens=1, end_id=-1),
    ]
    ref = reference(plain, PROMPTS[0], n + 16)
    by_draft = {}
    for name in ("random", "oracle", "oracle, graph steps"):
        if name == "oracle" and isinstance(engine.proposer, MedusaProposer):
            engine.proposer = OracleMedusa(engine.proposer, ref)
        elif name == "oracle":
            engine.proposer.net = OracleNet(engine.proposer.net, ref)
        elif name == "oracle, graph steps":  # CUDA's step objects run directly here: static buffers, greedy
            # acceptance and compaction in one step
            engine.graphs = GraphedTarget(engine.target, engine.cache, engine.proposer.capture_layers, compile=False)
        seen, biggest = by_draft[name] = stream_by_run_ahead(engine, ids, requests, (1, 4))
        assert all(seen[1, i] == seen[4, i] for i in range(len(requests))), (name, seen)
        assert biggest[4] > biggest[1]  # the groups did run ahead
        assert seen[4, 0][0] == free and seen[4, 1][1] == "end_id" and seen[4, 2][0] == free[:1], name
    assert by_draft["oracle"][0][4, 0][2] < n // 2  # the oracle's steps carried several tokens each
    assert by_draft["oracle, graph steps"] == by_draft["oracle"]
    # the drafting and the verification went through the greedy step objects, in one step
    assert engine.graphs.drafted and not engine.graphs.trees


def test_groups_queued_behind_each_other_stay_inside_the_cache(tiny_llama_dir, plain, tmp_path):
    """A group is queued before the one ahead of it is read, so its size rests on that group's worst
    case. An oracle accepting whole paths through a request that fills max_seq_len: the same tokens
    as plain decoding, and no slot past the cache (the CPU would raise on one)."""
    engine = open_engine(
        convert_and_build(
            tiny_llama_dir,
            tmp_path / "engine",
            max_input_len=16,
            max_seq_len=96,
            **SPEC_CASES["eagle3-dynamic"](tmp_path, vocab_of(tiny_llama_dir)),
        ),
        serving=SERIAL,
    )
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    n = engine.limits.max_seq_len - len(ids)
    ref = reference(plain, PROMPTS[0], n)
    engine.proposer.net = OracleNet(engine.proposer.net, ref)
    engine.run_ahead = 8
    got = greedy(engine, PROMPTS[0], n)
    assert got.token_ids == ref[len(ids) :] and got.stats.acceptance_length > 2


def test_queued_groups_end_near_the_request_end(tiny_llama_dir, plain, tmp_path):
    """Queued steps cover half of those the request is expected to need at the tokens a step has
    emitted so far: an oracle emitting 4 tokens a step queues at most a step or two past its last
    token, not groups sized for one token a step (which ran 8 or more steps past it)."""
    engine = open_engine(
        convert_and_build(
            tiny_llama_dir, tmp_path / "engine", **SPEC_CASES["eagle3-dynamic"](tmp_path, vocab_of(tiny_llama_dir))
        ),
        serving=SERIAL,
    )
    n = 120
    ref = reference(plain, PROMPTS[0], n)
    engine.proposer.net = OracleNet(engine.proposer.net, ref)
    engine.run_ahead = 8
    sizes, queue = [], engine._queue
    engine._queue = lambda steps, *args: sizes.append(steps) or queue(steps, *args)
    got = greedy(engine, PROMPTS[0], n)
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    assert got.token_ids == ref[len(ids) :] and got.stats.acceptance_length == 4
    assert sum(sizes) - got.stats.steps <= 2, (sizes, got.stats.steps)
