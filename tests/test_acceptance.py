"""Tree buffers against hand-drawn trees, choice validation, and the acceptance rules' statistics."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine import acceptance
from pipeline.engine.acceptance import accept_greedy, accept_sampling
from pipeline.engine.sampling import SamplingParams, argmax_rows, target_probs
from pipeline.engine.tree import (
    MC_SIM_7B_63,
    DraftTree,
    build_tree,
    chain_buffers,
    choices_to_triton,
    parse_choices,
    validate_choices,
)
from pipeline.errors import UserError


def test_tree_buffers_of_a_hand_drawn_tree():
    #        root(0)
    #       /      \
    #    [0](1)   [1](2)
    #     |
    #  [0,0](3)
    tree = build_tree([[1], [0, 0], [0]])
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.depths.tolist() == [0, 1, 1, 2]
    assert tree.ranks.tolist() == [0, 0, 1, 0]
    assert tree.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree.retrieve_paths.tolist() == [[0, 2, -1], [0, 1, 3]]


def test_default_tree_shape_and_triton_form():
    tree = build_tree(MC_SIM_7B_63)
    assert tree.num_nodes == 64 and tree.max_depth == 4
    assert tree.retrieve_paths.shape == (42, 5)  # 42 leaves, root + 4 levels
    assert choices_to_triton([[0], [0, 1]]) == "{0}, {0, 1}"
    assert parse_choices("{0}, {0, 1}") == [[0], [0, 1]]
    assert parse_choices("chain:3") == [[0], [0, 0], [0, 0, 0]]
    # A literal longer than a file name may be (the whole default tree) is read as a literal.
    assert parse_choices(str(MC_SIM_7B_63)) == MC_SIM_7B_63
    assert parse_choices(choices_to_triton(MC_SIM_7B_63)) == MC_SIM_7B_63


@pytest.mark.parametrize(
    "choices,kwargs,match",
    [
        ([[0], [1, 0, 0]], {}, "no parent"),
        ([[0], [0]], {}, "duplicate"),
        ([], {}, "empty"),
        ([[0], [0, 0], [0, 0, 0]], {"max_depth": 2}, "depth 3 exceeds 2"),
        (MC_SIM_7B_63, {"max_draft_len": 32}, "63 nodes exceed max_draft_len 32"),
        ([[0], [-1]], {}, "negative"),
    ],
)
def test_bad_choices_are_refused(choices, kwargs, match):
    with pytest.raises(UserError, match=match):
        validate_choices(choices, **kwargs)


def test_unparseable_choices_are_refused():
    with pytest.raises(UserError, match="not a preset"):
        parse_choices("[[0], [0")


def test_greedy_acceptance_takes_the_deepest_matching_path():
    tree = build_tree([[0], [1], [0, 0], [1, 0]])  # nodes: 1=[0] 2=[1] 3=[0,0] 4=[1,0]
    tokens = torch.tensor([9, 5, 6, 7, 8])
    logits = torch.full((5, 10), -5.0)
    logits[0, 6] = 5  # root -> 6: node 2 (rank 1) is right, node 1 wrong
    logits[2, 8] = 5  # node 2 -> 8: node 4 right
    logits[4, 3] = 5  # bonus after node 4
    acc = accept_greedy(DraftTree.from_buffers(tokens, tree), logits.argmax(-1))
    assert acc.num_accepted.item() == 2
    assert acc.path.tolist() == [0, 2, 4]
    assert acc.tokens.tolist() == [6, 8, 3]


# ---------------------------------------------------------------------------------------------
# Lossless speculative sampling: the first emitted token must follow the target's distribution.

SAMPLES = 4000
TV_BOUND = 0.04  # sampling noise at this size is about 0.01; the broken rule measures 0.1 to 0.25


def first_token_histogram(tree: DraftTree, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Emitted-first-token frequencies; sampled drafts are redrawn from their q every trial."""
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(SAMPLES):
        if tree.draft_probs is not None:
            drawn = torch.multinomial(tree.draft_probs[1:], 1, generator=gen).squeeze(-1)
            tree = DraftTree(
                torch.cat([tree.tokens[:1], drawn]),
                tree.parents,
                tree.depths,
                tree.mask,
                tree.max_depth,
                tree.draft_probs,
            )
        counts[accept_sampling(tree, logits, params, gen).tokens[0]] += 1
    return counts / SAMPLES


def small_vocab_case(kind: str) -> tuple[DraftTree, torch.Tensor, SamplingParams]:
    """A fixed 8-token vocabulary: target logits per node and a tree of deterministic or sampled drafts."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    if kind == "tree":  # a top-k tree (deterministic children, as Medusa/EAGLE propose)
        buffers = build_tree([[0], [1], [2], [0, 0], [1, 0]])
        tokens = torch.tensor([0, 3, 1, 6, 2, 4])
        logits = torch.randn(buffers.num_nodes, 8) * 1.5
        return DraftTree.from_buffers(tokens, buffers), logits, params
    # a chain drawn from a draft distribution q (draft-model mode)
    buffers = chain_buffers(2)
    logits = torch.randn(3, 8) * 1.5
    q = target_probs(torch.randn(3, 8) * 2.0, params)
    tokens = torch.tensor([0, 2, 5])
    return DraftTree.from_buffers(tokens, buffers, draft_probs=q), logits, params


@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_speculative_sampling_keeps_the_target_distribution(kind):
    tree, logits, params = small_vocab_case(kind)
    expected = target_probs(logits[:1], params)[0]
    got = first_token_histogram(tree, logits, params)
    assert 0.5 * (got - expected).abs().sum() < TV_BOUND


@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_the_same_check_catches_a_broken_rule(kind, monkeypatch):
    """Resampling from p instead of the residual after a rejection (a classic bug) must fail the check."""
    monkeypatch.setattr(acceptance, "rejection_residual", lambda p, q, fallback: fallback)
    tree, logits, params = small_vocab_case(kind)
    expected = target_probs(logits[:1], params)[0]
    got = first_token_histogram(tree, logits, params)
    assert 0.5 * (got - expected).abs().sum() > TV_BOUND


@pytest.mark.parametrize("vocab", [5, 256, 257, 49152, 128256])
def test_two_stage_argmax_picks_the_first_maximum_like_torch(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen)
    logits[1] = logits[1].round()  # many ties
    logits[2] = 1.0  # all tied: index 0
    for x in (logits, logits.bfloat16()):
        assert torch.equal(argmax_rows(x), x.argmax(-1))
