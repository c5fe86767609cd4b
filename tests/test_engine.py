"""Portable engine, plain decoding: token parity with Hugging Face, sampling, stops, request errors, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import convert_and_build, stream_by_run_ahead

from pipeline.convert.source import load_hf_model
from pipeline.engine import parallel
from pipeline.engine.loader import open_engine
from pipeline.engine.runner import Engine, RequestError, SamplingParams
from pipeline.engine.scheduler import SchedulerConfig

PROMPTS = ["def add(a, b):", "The quick brown fox", "hello hello hello hello world, print it"]


def hf_greedy(model, ids: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def tiny_llama_engine(tiny_llama_dir: Path, tmp_path_factory) -> Engine:
    return open_engine(convert_and_build(tiny_llama_dir, tmp_path_factory.mktemp("plain")))


@pytest.fixture(scope="module")
def serial_engine(tiny_llama_dir: Path, tmp_path_factory) -> Engine:
    """The plain engine off the scheduler's batches: the single-stream loop speculative engines use."""
    engine_dir = convert_and_build(tiny_llama_dir, tmp_path_factory.mktemp("serial"))
    return open_engine(engine_dir, serving=SchedulerConfig(batched=False))


@pytest.mark.parametrize("arch,tp,pp", [("llama", 1, 1), ("llama", 2, 1), ("llama", 2, 2), ("qwen2", 2, 1)])
def test_tiny_greedy_matches_hugging_face(arch, tp, pp, tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    folder = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    engine = open_engine(convert_and_build(folder, tmp_path, tp=tp, pp=pp))  # TP 2 (PP 1): two processes
    hf = load_hf_model(str(folder))
    try:
        for text in PROMPTS:
            ids = engine.tokenizer(text).input_ids
            got = engine.generate(ids, SamplingParams(max_tokens=24, end_id=-1))
            assert got.token_ids == hf_greedy(hf, ids, 24), text
            assert (got.stats.steps, got.stats.draft_tokens, got.stats.accepted_tokens) == (23, 0, 0)
            assert got.stats.acceptance_length == 1.0
    finally:
        parallel.shutdown()  # one tensor-parallel engine a process


@pytest.mark.slow
def test_smollm2_greedy_matches_hugging_face(smollm2_engine_dir, smollm2_hf):
    engine = open_engine(smollm2_engine_dir)
    for text in ["The capital of France is", "Write a haiku about the sea.\n"]:
        ids = engine.tokenizer(text).input_ids
        assert engine.generate(ids, SamplingParams(max_tokens=32, end_id=-1)).token_ids == hf_greedy(
            smollm2_hf, ids, 32
        )


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny_llama_engine):
    ids = tiny_llama_engine.tokenizer(PROMPTS[1]).input_ids
    hot = SamplingParams(max_tokens=16, temperature=1.3, top_p=0.9, seed=7, end_id=-1)
    first = tiny_llama_engine.generate(ids, hot).token_ids
    assert tiny_llama_engine.generate(ids, hot).token_ids == first
    others = {
        tuple(
            tiny_llama_engine.generate(ids, SamplingParams(max_tokens=16, temperature=1.3, seed=s, end_id=-1)).token_ids
        )
        for s in range(4)
    }
    assert len(others) > 1, "different seeds should give different samples"
    greedy = tiny_llama_engine.generate(ids, SamplingParams(max_tokens=16, end_id=-1)).token_ids
    top1 = tiny_llama_engine.generate(ids, SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=3, end_id=-1))
    assert top1.token_ids == greedy


def test_stops_on_end_id_stop_word_and_max_tokens(tiny_llama_engine):
    ids = tiny_llama_engine.tokenizer(PROMPTS[0]).input_ids
    free = tiny_llama_engine.generate(ids, SamplingParams(max_tokens=20, end_id=-1))
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    end = free.token_ids[5]
    stopped = tiny_llama_engine.generate(ids, SamplingParams(max_tokens=20, end_id=end))
    assert stopped.finish_reason == "end_id"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(end) + 1]
    word = tiny_llama_engine.tokenizer.decode(free.token_ids[:8]).strip()[-3:]
    by_word = tiny_llama_engine.generate(ids, SamplingParams(max_tokens=20, end_id=-1, stop_words=(word,)))
    assert by_word.finish_reason == "stop" and by_word.text.endswith(word)
    assert len(by_word.token_ids) <= 8


@pytest.mark.parametrize(
    "params,prompt_len,match",
    [
        (SamplingParams(max_tokens=0), 3, "max_tokens"),
        (SamplingParams(max_tokens=-2), 3, "max_tokens"),
        (SamplingParams(temperature=-0.5), 3, "temperature"),
        (SamplingParams(top_p=0.0), 3, "top_p"),
        (SamplingParams(top_k=-1), 3, "top_k"),
        (SamplingParams(), 0, "empty"),
        (SamplingParams(), 1025, "max_input_len"),
        (SamplingParams(max_tokens=2000), 100, "max_seq_len"),
    ],
)
def test_bad_requests_are_refused(tiny_llama_engine, params, prompt_len, match):
    with pytest.raises(RequestError, match=match):
        tiny_llama_engine.validate([5] * prompt_len, params)


def test_generate_cli_json(tiny_llama_dir, tmp_path):
    engine_dir = convert_and_build(tiny_llama_dir, tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "generate",
            "--engine",
            str(engine_dir),
            "--prompt",
            PROMPTS[0],
            "--max-tokens",
            "6",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    record = json.loads(out.stdout)
    assert len(record["token_ids"]) == 6 and record["steps"] == 5
    assert (record["draft_tokens"], record["accepted_tokens"], record["acceptance_length"]) == (0, 0, 1.0)
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline", "generate", "--engine", str(tmp_path / "nope"), "--prompt", "x"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "engine folder not found" in bad.stderr


def test_full_slot_context_matches_the_eager_step(tiny_llama_engine):
    """The CUDA-graph path reads every cache slot with a device-side length; on the CPU its logic must give
    the same hidden states as the eager step, for a single token and for a tree."""
    from pipeline.engine.model import full_slot_context, make_context
    from pipeline.engine.tree import build_tree, parse_choices

    target = tiny_llama_engine.target
    prompt = torch.tensor(tiny_llama_engine.tokenizer(PROMPTS[2]).input_ids)
    n = prompt.shape[0]
    tree = build_tree(parse_choices("top16"))
    tokens = torch.randint(0, target.cfg.vocab_size, (tree.num_nodes,))
    with torch.inference_mode():
        for new_tokens, tree_mask, depths in [
            (tokens[:1], torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long)),
            (tokens, tree.mask, tree.depths),
        ]:
            outs = []
            for full in (False, True):
                cache = target.new_cache(64)
                target(prompt[None], make_context(cache, target.rotary, 0, torch.arange(n), None))
                positions = n + depths
                if full:
                    ctx = full_slot_context(
                        cache,
                        target.rotary,
                        torch.tensor(n),
                        positions,
                        n + torch.arange(len(depths)),
                        tree_mask,
                        torch.arange(cache.num_slots),
                    )
                else:
                    ctx = make_context(cache, target.rotary, n, positions, tree_mask if len(depths) > 1 else None)
                outs.append(target(new_tokens[None], ctx)[0])
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_a_padded_prefill_replay_matches_the_eager_prefill(tiny_llama_engine):
    """On CUDA a prompt runs padded to a power of two as one graph replay (GraphedTarget.prefill, here
    run directly): the prompt's rows and the next decode step must be those of the eager prefill, so
    the pads after the prompt (whose KV lands past it) change nothing the request reads."""
    from pipeline.engine.graphs import GraphedTarget, prefill_bucket
    from pipeline.engine.model import make_context

    target = tiny_llama_engine.target
    prompt = torch.tensor(tiny_llama_engine.tokenizer(PROMPTS[1]).input_ids)
    n = prompt.shape[0]
    bucket = prefill_bucket(n, 64)
    assert bucket > n  # pads are there to leak
    next_token, one = torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool)
    with torch.inference_mode():
        cache = target.new_cache(64)
        eager, _ = target(prompt[None], make_context(cache, target.rotary, 0, torch.arange(n), None))
        after_eager, _ = target(next_token, make_context(cache, target.rotary, n, torch.tensor([n]), None))
        graphed = GraphedTarget(target, target.new_cache(64), (), compile=False)
        replayed, _ = graphed.prefill(prompt)
        assert graphed.cache.k[:, :, n:bucket].abs().sum() > 0  # the pads' KV went past the prompt
        after_replay = graphed.run(next_token[0], n, torch.tensor([n]), one)[0].clone()
        reading_pads = graphed.run(next_token[0], bucket, torch.tensor([n]), one)[0]
    torch.testing.assert_close(replayed, eager[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after_replay, after_eager[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):  # the check can fail: a step that read the pads would differ
        torch.testing.assert_close(reading_pads, after_eager[0])


def test_a_refused_prompt_graph_falls_back_to_the_eager_pass(serial_engine, monkeypatch, capsys):
    """The single-stream loop with CUDA's graph objects run directly: the same tokens through the padded
    prompt replay, and after a capture the device refuses, through the eager pass (with one line on stderr)."""
    from pipeline.engine.graphs import GraphedTarget

    engine = serial_engine
    ids = engine.tokenizer(PROMPTS[1]).input_ids
    params = SamplingParams(max_tokens=12, end_id=-1)
    expected = engine.generate(ids, params).token_ids
    graphed = GraphedTarget(engine.target, engine.cache, (), compile=False)
    monkeypatch.setattr(engine, "graphs", graphed)
    assert engine.generate(ids, params).token_ids == expected and len(graphed.prefills) == 1

    def refused():
        raise RuntimeError("operation not permitted when stream is capturing")

    bucket, (inputs, _) = next(iter(graphed.prefills.items()))
    graphed.prefills[bucket] = inputs, refused
    assert engine.generate(ids, params).token_ids == expected
    assert not graphed.prefill_graphs and "prefill graph failed" in capsys.readouterr().err


def test_warm_up_reaches_every_prefill_bucket_a_request_can():
    from pipeline.engine.config import EngineLimits
    from pipeline.engine.graphs import prefill_bucket
    from pipeline.engine.runner import WARMUP_NEW_TOKENS, warm_up_prompt_lengths

    assert warm_up_prompt_lengths(EngineLimits(1, 512, 1024, 63), 256) == [16, 32, 64, 128, 256]  # longer: eager
    assert warm_up_prompt_lengths(EngineLimits(1, 768, 1024, 63)) == [16, 32, 64, 128, 256, 512]  # the default limit
    assert warm_up_prompt_lengths(EngineLimits(1, 100, 1024, 63), 256) == [16, 32, 64, 100]  # 100 runs at 128
    assert warm_up_prompt_lengths(EngineLimits(1, 16, 12, 0), 256) == [12 - WARMUP_NEW_TOKENS]
    for limits in (EngineLimits(1, 100, 1024, 63), EngineLimits(1, 700, 740, 0)):
        lengths = warm_up_prompt_lengths(limits, 256)
        reachable = {prefill_bucket(n, 256) for n in range(1, limits.max_input_len + 1)} - {None}
        assert {prefill_bucket(n, 256) for n in lengths} == reachable
        assert all(n <= limits.max_input_len and n + WARMUP_NEW_TOKENS <= limits.max_seq_len for n in lengths)


def test_eagle_prompt_pass_padded_to_its_bucket_drafts_the_same(tiny_llama_engine):
    """On CUDA the EAGLE drafter's pass over the prompt runs padded to the prefill bucket (fixed shapes
    for cuDNN's attention plans); the drafted tree must not change."""
    from pipeline.engine.config import DynamicTreeConfig
    from pipeline.engine.eagle import EagleNet, EagleProposer
    from pipeline.engine.model import ModelConfig, make_context
    from pipeline.engine.speculative import TargetPass

    target = tiny_llama_engine.target
    prompt = torch.tensor(tiny_llama_engine.tokenizer(PROMPTS[1]).input_ids)
    n = prompt.shape[0]
    torch.manual_seed(0)
    net = EagleNet(ModelConfig(**{**vars(target.cfg), "num_layers": 1})).eval()
    drafts = []
    with torch.inference_mode():
        hidden, _ = target(prompt[None], make_context(target.new_cache(64), target.rotary, 0, torch.arange(n), None))
        for pad in (False, True):
            proposer = EagleProposer(net, 64, None, DynamicTreeConfig(top_k=4, depth=3, max_non_leaves_per_layer=4), 10)
            proposer.pad_prompt = pad
            proposer.start(prompt, TargetPass(hidden[0], []), torch.tensor([5]))
            proposer.root.fill_(5)
            drafts.append([t.clone() for t in proposer._step()])
    assert len(drafts[0]) == len(drafts[1]) > 0
    for a, b in zip(*drafts):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_running_ahead_changes_only_how_tokens_are_grouped(tiny_llama_dir, tmp_path):
    """A plain engine off the scheduler's batches (the single-stream loop) queuing 5 greedy steps per host
    read (what CUDA engines do, 8 there) gives the tokens, stop reasons and step counts of one step at a
    time; a stop inside a group drops the steps after it."""
    engine = open_engine(convert_and_build(tiny_llama_dir, tmp_path), serving=SchedulerConfig(batched=False))
    assert not engine.batched and engine.pool is None
    ids = engine.tokenizer(PROMPTS[2]).input_ids
    free = engine.generate(ids, SamplingParams(max_tokens=23, end_id=-1)).token_ids
    word = engine.tokenizer.decode(free[:9]).strip()[-3:]
    requests = [
        SamplingParams(max_tokens=23, end_id=-1),
        SamplingParams(max_tokens=23, end_id=free[7]),
        SamplingParams(max_tokens=23, end_id=-1, stop_words=(word,)),
        SamplingParams(max_tokens=1, end_id=-1),
    ]
    seen, biggest = stream_by_run_ahead(engine, ids, requests, (1, 5))
    assert biggest[5] <= 5
    assert all(seen[1, i] == seen[5, i] for i in range(len(requests))), seen
    assert seen[5, 1][0] == free[: free.index(free[7]) + 1] and seen[5, 1][1] == "end_id"
    assert seen[5, 2][1] == "stop" and seen[5, 3][0] == free[:1]


def greedy_ids(engine: Engine, text: str, n: int) -> list[int]:
    return engine.generate(engine.tokenizer(text).input_ids, SamplingParams(max_tokens=n, end_id=-1)).token_ids


def test_sequences_past_max_position_embeddings(tmp_path):
    """An engine built for longer sequences than the config's max_position_embeddings extends its RoPE tables
    (as Hugging Face computes them on the fly) instead of failing mid-generation."""
    from pipeline.convert.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "short", seed=3, max_position_embeddings=32)
    engine = open_engine(convert_and_build(folder, tmp_path, max_input_len=16, max_seq_len=96))
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    got = engine.generate(ids, SamplingParams(max_tokens=60, end_id=-1))
    assert got.token_ids == hf_greedy(load_hf_model(str(folder)), ids, 60)


@pytest.mark.slow
def test_compiled_steps_trace_whole_and_match_eager():
    """On CUDA the target step and the EAGLE drafter step run through torch.compile(fullgraph=True)
    inside CUDA graphs; a graph break would silently fall back to eager there. The same functions
    compile on the CPU, so check here that they trace whole and compute what the eager code does."""
    from dataclasses import replace

    from pipeline.engine.config import DynamicTreeConfig
    from pipeline.engine.eagle import EagleNet, EagleProposer
    from pipeline.engine.graphs import Compiled, GraphedTarget
    from pipeline.engine.model import ModelConfig, Transformer, full_slot_context, make_context
    from pipeline.engine.speculative import TargetPass
    from pipeline.engine.tree import MC_SIM_7B_63, build_tree

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_size=8,
        intermediate_size=64,
        norm_epsilon=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=512,
    )
    target = Transformer(cfg).eval()
    n = 12
    prompt = torch.randint(cfg.vocab_size, (n,))
    with torch.inference_mode():
        cache = target.new_cache(128)
        hidden, _ = target(prompt[None], make_context(cache, target.rotary, 0, torch.arange(n), None))
        slot_ids, length = torch.arange(cache.num_slots), torch.tensor(n)

        def step(tokens, positions, tree_mask):
            ctx = full_slot_context(
                cache, target.rotary, length, positions, length + torch.arange(tokens.shape[0]), tree_mask, slot_ids
            )
            return target(tokens[None], ctx)[0]

        compiled = Compiled(step, enabled=True)
        token, position, mask = torch.tensor([7]), torch.tensor([n]), torch.ones(1, 1, dtype=torch.bool)
        torch.testing.assert_close(compiled(token, position, mask), step(token, position, mask), rtol=1e-5, atol=1e-5)
        assert compiled.compiled is not None

        # A greedy verification step: the pass, the argmax and the acceptance in one compiled function.
        graphed = GraphedTarget(target, cache, (), compile=True)
        graphed.length.fill_(n)
        tree = build_tree(MC_SIM_7B_63[:7])
        draft = (torch.randint(cfg.vocab_size, (tree.num_nodes,)), tree.parents, tree.depths, tree.mask, tree.max_depth)
        eager = graphed._greedy_verify(*draft)
        got = graphed.greedy_verify(*draft)
        assert graphed.greedy_verify.compiled is not None
        torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(got[2:], eager[2:]))

        net = EagleNet(replace(cfg, num_layers=1)).eval()
        proposer = EagleProposer(net, 128, None, DynamicTreeConfig(top_k=4, depth=3, max_non_leaves_per_layer=4), 10)
        proposer.start(prompt, TargetPass(hidden[0], []), torch.tensor([5]))
        proposer.root.fill_(5)
        eager = [t.clone() for t in proposer._step()]
        compiled_step = Compiled(proposer._step, enabled=True)
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled_step()))
        assert compiled_step.compiled is not None


def test_compile_mode_comes_from_the_environment_and_rejects_graph_modes(monkeypatch):
    from pipeline.engine.graphs import COMPILE_MODE_ENV, Compiled
    from pipeline.errors import UserError

    monkeypatch.setenv(COMPILE_MODE_ENV, "max-autotune-no-cudagraphs")
    double = Compiled(lambda x: x * 2, enabled=True)
    assert torch.equal(double(torch.arange(4.0)), torch.arange(4.0) * 2) and double.compiled is not None
    monkeypatch.setenv(COMPILE_MODE_ENV, "reduce-overhead")  # inductor's own CUDA graphs inside ours: refused
    with pytest.raises(UserError, match=COMPILE_MODE_ENV):
        Compiled(lambda x: x, enabled=True)


def test_cpu_products_run_through_onednn_and_match_f_linear(tiny_llama_engine, monkeypatch):
    from pipeline.engine import onednn
    from pipeline.engine.model import Linear

    if onednn.available():  # every CPU engine's target runs its products through oneDNN
        assert all(m.packed is not None for m in tiny_llama_engine.target.modules() if isinstance(m, Linear))
    lin = Linear(64, 24, bias=True)
    for shape in ((1, 1, 64), (2, 5, 64)):  # a decode step and a tree / prefill
        x = torch.randn(*shape)
        want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        lin.packed = None
        assert onednn.pack(lin) == 1
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    assert onednn.pack(Linear(64, 24).to(torch.bfloat16)) == 0  # float32 only
    monkeypatch.setenv(onednn.ENV, "0")
    assert onednn.pack(Linear(64, 24)) == 0
