"""Every Triton kernel of the engine against the unfused ops it replaces; prints "kernels ok" or fails.

  python -m pipeline.bench.probes.check_kernels          # on a CUDA device
  python -m pipeline.bench.probes.check_kernels cpu      # on CPU tensors, under Triton's interpreter

On the CPU it sets TRITON_INTERPRET=1 before the kernels are defined (it must run in a process of its own:
tests/test_fused.py starts one). Triton's interpreter multiplies bf16 tiles as raw integers, so tensor-core
tiles are checked in float32 there, and it truncates each float32 -> bf16 cast where the GPU rounds to
nearest: the tolerances of bf16 checks are looser than the kernels' own error.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeline.bench.speed import _IdsOnly
from pipeline.engine.config import DynamicTreeConfig, EngineLimits, SpecConfig
from pipeline.engine.eagle import EagleNet, EagleProposer
from pipeline.engine.graphs import CapturedStep
from pipeline.engine.kernels.routing import (
    TORCH_TOPK,
    DrafterKernels,
    attach,
    paged_layer,
    sequence_layer,
    several_token_mlp,
)
from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning
from pipeline.engine.kv_cache import BlockPool, PagedView
from pipeline.engine.medusa import MedusaProposer, medusa_heads
from pipeline.engine.model import (
    DecoderLayer,
    KVCache,
    Linear,
    ModelConfig,
    RMSNorm,
    Rotary,
    Transformer,
    full_slot_context,
    make_context,
    paged_context,
)
from pipeline.engine.runner import Engine
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.tree import build_tree

DEVICES = ("cuda", "cpu")
# The small model of the whole-model checks.
CONFIG = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_size=16,
    intermediate_size=96,
    norm_epsilon=1e-5,
    rope_theta=1e4,
    rope_scaling=None,
    max_position_embeddings=128,
)
# One layer whose norm weights serve the norm-inside-the-product checks.
NORM_CONFIG = ModelConfig(64, 40, 1, 2, 1, 20, 24, 1e-5, 1e4, None, 64)


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """got equals want to `tol` of want's largest magnitude."""
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert err < tol, err


def tile_dtype(device: str) -> torch.dtype:
    """The dtype of tensor-core tile checks: bf16 on a GPU, float32 under the interpreter."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def decoder_layer(model: Transformer, index: int) -> DecoderLayer:
    """model.layers[index] as its own type (an nn.ModuleList's items are typed Module)."""
    layer = model.layers[index]
    assert isinstance(layer, DecoderLayer)
    return layer


def input_norm(layer: DecoderLayer) -> RMSNorm:
    """The layer's input RMSNorm (EAGLE-1 draft layers have none)."""
    norm = layer.input_layernorm
    assert isinstance(norm, RMSNorm)
    return norm


def check_gemv(device: str) -> None:
    from pipeline.engine.kernels.gemv import gemv, gemv_rope_store
    from pipeline.engine.kernels.rotary import rope_store

    # Row counts and widths off the block sizes (8 rows, 1024 columns) exercise the masks.
    for n, k, dtype, tol in (
        (100, 300, torch.bfloat16, 1e-2),
        (37, 1030, torch.float16, 1e-3),
        (16, 1024, torch.float32, 1e-6),
    ):
        w, x, r = torch.randn(n, k, dtype=dtype), torch.randn(k, dtype=dtype), torch.randn(n, dtype=dtype)
        close(gemv(x, w), w.double() @ x.double(), tol)
        close(gemv(x, w, residual=r), w.double() @ x.double() + r.double(), tol)
        if n % 2 == 0:  # gated: fc rows over gate rows, SiLU(fc x) * (gate x)
            fc, gate = (w.double() @ x.double()).chunk(2)
            close(gemv(x, w, gated=True), F.silu(fc) * gate, tol)
    # The norm prologue against the unfused layer's own ops (looser: the norm rounds twice).
    norm = input_norm(decoder_layer(Transformer(NORM_CONFIG), 0)).to(torch.bfloat16)
    norm.weight.normal_()
    x, w2 = torch.randn(40, dtype=torch.bfloat16), torch.randn(2 * 24, 40, dtype=torch.bfloat16)
    close(gemv(x, w2, norm.weight, norm.eps), F.linear(norm(x), w2), 4e-2)
    # The QKV GEMV with rotary and the cache write as its epilogue against the two kernels it replaces,
    # which round the same way: the same cache (other rows and slots stay zero). Bit for bit under the
    # interpreter; on a GPU a row's float32 sum may run in another order, one bf16 unit apart.
    for heads, kv_heads, dim, k in ((6, 2, 16, 40), (4, 2, 64, 1100), (2, 1, 4, 24)):  # a head narrower than a block
        w = torch.randn((heads + 2 * kv_heads) * dim, k, dtype=torch.bfloat16)
        x, g = torch.randn(k, dtype=torch.bfloat16), torch.randn(k, dtype=torch.bfloat16)
        rotary = Rotary(dim, 1e4, None, 64)
        rope_args = rotary.cos, rotary.sin, torch.tensor([37]), torch.tensor([6])  # RoPE position, cache slot
        for norm_weight in (g, None):  # None: a layer without an input norm (an EAGLE-1 draft's first)
            want_k, want_v, got_k, got_v = (
                torch.zeros(2, 2, 10, kv_heads, dim, dtype=torch.bfloat16) for _ in range(4)
            )
            want = rope_store(gemv(x, w, norm_weight, 1e-5), *rope_args, want_k, want_v, 1, heads)
            close(gemv_rope_store(x, w, norm_weight, 1e-5, *rope_args, got_k, got_v, 1, heads), want, 1e-2)
            assert want_k[1, 0, 6].any() and torch.equal(got_v, want_v)
            close(got_k, want_k, 1e-2)


def check_rows(device: str) -> None:
    from pipeline.engine.kernels.gemv import gemv
    from pipeline.engine.kernels.rotary import rope_store
    from pipeline.engine.kernels.rows import rows_gemm, rows_rope_store

    half, tol = tile_dtype(device), 1e-2 if device == "cuda" else 1e-5
    # Rows, outputs and columns off the tiles, more rows than one tile.
    for m, n, k in ((3, 40, 70), (16, 64, 300), (37, 96, 128), (70, 20, 40)):
        x, w, r = torch.randn(m, k, dtype=half), torch.randn(n, k, dtype=half), torch.randn(m, n, dtype=half)
        want = x.double() @ w.double().T
        close(rows_gemm(x, w), want, tol)
        close(rows_gemm(x, w, residual=r), want + r.double(), tol)
        fc, gate = want.chunk(2, dim=1)
        close(rows_gemm(x, w, gated=True), F.silu(fc) * gate, tol)
    # The norm inside the products: against RMSNorm then the product, gated and not.
    norm = input_norm(decoder_layer(Transformer(dataclasses.replace(NORM_CONFIG, hidden_size=300)), 0)).to(half)
    norm.weight.normal_()
    for m, n in ((5, 48), (37, 96)):
        x, w = torch.randn(m, 300, dtype=half), torch.randn(n, 300, dtype=half)
        want = F.linear(norm(x).double(), w.double())
        close(rows_gemm(x, w, norm=norm.weight, eps=norm.eps), want, 4 * tol)
        fc, gate = want.chunk(2, dim=1)
        close(rows_gemm(x, w, gated=True, norm=norm.weight, eps=norm.eps), F.silu(fc) * gate, 4 * tol)
    # The QKV product of several tokens with the norm, rotary and the cache write inside, against the
    # single-token kernels token by token: q and the cache (other slots stay zero).
    for heads, kv_heads, dim, k, m in ((6, 2, 16, 40, 5), (4, 2, 64, 300, 19)):
        w = torch.randn((heads + 2 * kv_heads) * dim, k, dtype=half)
        x, g = torch.randn(m, k, dtype=half), torch.randn(k, dtype=half)
        rotary = Rotary(dim, 1e4, None, 64)
        positions, slots = torch.randint(64, (m,)), torch.randperm(30)[:m]
        for norm_weight in (g, None):
            want_k, want_v, got_k, got_v = (torch.zeros(2, 2, 30, kv_heads, dim, dtype=half) for _ in range(4))
            want = torch.stack(
                [
                    rope_store(
                        gemv(x[t], w, norm_weight, 1e-5),
                        rotary.cos,
                        rotary.sin,
                        positions[t : t + 1],
                        slots[t : t + 1],
                        want_k,
                        want_v,
                        1,
                        heads,
                    )
                    for t in range(m)
                ]
            )
            rope = (rotary.cos, rotary.sin, positions, slots, got_k, got_v, 1, heads)
            close(rows_rope_store(x, w, norm_weight, 1e-5, *rope), want, 4 * tol)
            assert want_k[1, 0, slots].any() and not got_k[0].any() and not got_k[1, 1].any()
            close(got_k, want_k, 4 * tol)
            close(got_v, want_v, 4 * tol)
    # A decoder layer's step of several tokens, its MLP through the two kernels, against the unfused layer.
    layer = decoder_layer(Transformer(NORM_CONFIG), 0).to(half)
    for p in layer.parameters():
        p.normal_(0, 0.3)
    x = torch.randn(1, 5, 40, dtype=half)
    close(several_token_mlp(layer, x), x + layer.mlp(layer.post_layernorm(x)), 4 * tol)


def check_linear(device: str) -> None:
    lin = Linear(64, 24, bias=True).to(torch.bfloat16)
    attach(lin, "gemv", (device,))
    one, many = torch.randn(1, 1, 64, dtype=torch.bfloat16), torch.randn(1, 3, 64, dtype=torch.bfloat16)
    close(lin(one), F.linear(one.double(), lin.weight.double(), lin.bias.double()), 2e-2)
    assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias))  # trees stay on the library GEMM


def check_attention(device: str) -> None:
    from pipeline.engine.kernels.attention import slot_attention

    half, tol = tile_dtype(device), 1e-2 if device == "cuda" else 1e-5
    cuda_cores = dataclasses.replace(DEFAULT_TUNING, one_token_tiles=False)
    # A strided cache (slots x kv heads x dims), groups of 3, 4 and 1, texts of one chunk and of several
    # splits' worth, a text far shorter than the cache. Single tokens see every slot up to their own, first
    # on the CUDA-core kernel...
    for heads, kv_heads, dim, slots, slot in (
        (6, 2, 16, 40, 39),
        (8, 2, 32, 150, 96),
        (4, 4, 64, 300, 0),
        (6, 2, 16, 1100, 1042),
        (6, 2, 16, 1100, 40),
        (6, 2, 16, 40, 5),
    ):
        q = torch.randn(1, heads, dim, dtype=torch.bfloat16)
        cache = torch.randn(2, slots, kv_heads, dim, dtype=torch.bfloat16)
        k, v = cache[0], cache[1]
        want = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].float(),
            k[: slot + 1].transpose(0, 1)[None].float(),
            v[: slot + 1].transpose(0, 1)[None].float(),
            enable_gqa=True,
        )[0]
        close(slot_attention(q, k, v, torch.tensor([slot]), None, cuda_cores), want.transpose(0, 1), 2e-2)
    # ... and the same through the several tokens' tensor-core tiles (one_token_tiles, the engine's way).
    for heads, kv_heads, dim, slots, slot in ((6, 2, 16, 40, 39), (9, 3, 64, 1100, 400), (4, 4, 64, 300, 0)):
        q, cache = torch.randn(1, heads, dim, dtype=half), torch.randn(2, slots, kv_heads, dim, dtype=half)
        k, v = cache[0], cache[1]
        seen_k, seen_v = (t[: slot + 1].transpose(0, 1)[None].float() for t in (k, v))
        want = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), seen_k, seen_v, enable_gqa=True)[0]
        for tuning in (DEFAULT_TUNING, cuda_cores):
            close(slot_attention(q, k, v, torch.tensor([slot]), None, tuning), want.transpose(0, 1), 2 * tol)
    # Tree tokens see the text and what their row of the region allows, through tensor-core tiles (a single
    # token with a wider region, an EAGLE level of one node, too).
    for heads, kv_heads, dim, slots, length, tokens, region, dtype in (
        (6, 2, 16, 300, 97, 5, 7, half),
        (8, 2, 32, 1100, 1040, 12, 12, torch.float32),
        (4, 4, 64, 64, 0, 3, 3, half),
        (9, 3, 64, 2000, 33, 64, 64, torch.float32),
        (32, 8, 128, 322, 128, 64, 64, half),
        (6, 2, 16, 300, 97, 1, 5, half),
        (4, 4, 64, 1100, 1040, 1, 9, torch.float32),
    ):  # one draft node
        q = torch.randn(tokens, heads + 2, dim, dtype=dtype)[:, 1 : heads + 1]  # a QKV view, as in the engine
        cache = torch.randn(2, slots, kv_heads, dim, dtype=dtype)
        k, v = cache[0], cache[1]
        rows = torch.rand(tokens, region) < 0.4
        rows[torch.arange(tokens), torch.arange(tokens)] = True  # a token always sees itself
        ctx = full_slot_context(
            KVCache(k, v),
            Rotary(dim, 1e4, None, 1),  # unread: only the mask is checked
            torch.tensor(length),
            torch.zeros(tokens),
            torch.zeros(tokens),
            rows,
            torch.arange(slots),
        )
        assert ctx.mask is not None  # full_slot_context masks every slot
        want = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].float(),
            k.transpose(0, 1)[None].float(),
            v.transpose(0, 1)[None].float(),
            attn_mask=ctx.mask[0],
            enable_gqa=True,
        )[0]
        close(slot_attention(q, k, v, torch.tensor(length), rows), want.transpose(0, 1), 2e-2)
    # A region row that hides a split's whole span (slots 1056-1087), against scores all near -160: the
    # hidden span must not lend the merge a peak that underflows every other span's weight.
    q = torch.full((1, 4, 64), 20.0)
    k, v = -0.5 - torch.rand(1100, 4, 64), torch.randn(1100, 4, 64)
    rows = torch.ones(1, 48, dtype=torch.bool)
    rows[0, 16:] = False
    seen = torch.cat([torch.ones(1040, dtype=torch.bool), rows[0], torch.zeros(12, dtype=torch.bool)])
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=seen[None]
    )[0]
    close(slot_attention(q, k, v, torch.tensor(1040), rows), want.transpose(0, 1), 1e-4)


def engine_tuning(device: str) -> KernelTuning:
    """The tuning of the whole-model checks: the engine's, except that bf16 single tokens stay on the CUDA-core
    attention under the interpreter."""
    return DEFAULT_TUNING if device == "cuda" else dataclasses.replace(DEFAULT_TUNING, one_token_tiles=False)


def check_model(device: str) -> None:
    tuning, half = engine_tuning(device), tile_dtype(device)
    # Single-token steps fused against the unfused layers, eagerly (limit None) and the way the CUDA graphs
    # call them (full cache, device limit).
    model = Transformer(CONFIG).to(torch.bfloat16)
    for p in model.parameters():
        p.normal_(0, 0.3)
    assert attach(model, "fused", (device,), tuning=tuning) == {
        "gemv_layers": 2 * 4 + 1,
        "fused_layers": 2,
        "attention_layers": 2,
        "draft_topk": 0,
    }
    cache = model.new_cache(80)
    prompt = torch.randint(97, (1, 70), device=device)
    model(prompt, make_context(cache, model.rotary, 0, torch.arange(70), None))
    token = torch.tensor([[5]])
    contexts = {
        "eager": make_context(cache, model.rotary, 70, torch.tensor([70]), None),
        "graph": full_slot_context(
            cache,
            model.rotary,
            torch.tensor(70),
            torch.tensor([70]),
            torch.tensor([70]),
            torch.ones(1, 1, dtype=torch.bool),
            torch.arange(80),
        ),
    }
    for rope_in_gemv in (False, True):  # rotary and the cache write after the QKV GEMV, then in it (the default)
        variant = dataclasses.replace(tuning, rope_in_gemv=rope_in_gemv)
        attach(model, "fused", (device,), tuning=variant)
        for ctx in contexts.values():
            cache.k[:, 0, 70] = cache.v[:, 0, 70] = 0  # what the fused step leaves there is its own write
            got, _ = model(token, ctx)
            written = cache.k[:, 0, 70].clone(), cache.v[:, 0, 70].clone()  # the fused rotary's cache write
            attach(model, "gemv", (device,), tuning=variant)
            want, _ = model(token, ctx)
            attach(model, "fused", (device,), tuning=variant)
            close(got, want, 4e-2)  # as loose as the norm's: two bf16 residual sums and a norm apart
            close(written[0], cache.k[:, 0, 70], 3e-2)
            close(written[1], cache.v[:, 0, 70], 3e-2)
        step = torch.compile(
            lambda t: model(t, contexts["graph"])[0], fullgraph=True
        )  # as the engine's graphs trace it
        close(step(token), want, 3e-2)
    attach(model, "fused", (device,), tuning=dataclasses.replace(tuning, gated_gemv=True))
    close(model(token, contexts["graph"])[0], want, 4e-2)  # SiLU-and-multiply inside the fc_gate GEMV: the same step
    attach(model, "fused", (device,), tuning=tuning)
    # A tree step as the graphs run it: the slot-attention kernel against SDPA over the masked cache.
    model = model.to(half)
    cache = model.new_cache(80)
    model(prompt, make_context(cache, model.rotary, 0, torch.arange(70), None))
    rows = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    ctx = full_slot_context(
        cache,
        model.rotary,
        torch.tensor(70),
        torch.tensor([70, 71, 71, 72]),
        torch.arange(70, 74),
        rows,
        torch.arange(80),
    )
    got, _ = model(torch.tensor([[1, 2, 3, 4]]), ctx)
    attach(model, "off", (device,))
    want, _ = model(torch.tensor([[1, 2, 3, 4]]), ctx)
    close(got, want, 3e-2)
    # ... and a small layer's tree step whole through the kernels (sequence_layer: the norms, rotary
    # and the cache write inside the products) against the unfused layer: its output and cache writes.
    x = torch.randn(1, 4, 64, dtype=half)
    got = sequence_layer(decoder_layer(model, 1), x, ctx, 1, tuning)
    written = cache.k[1, 0, 70:74].clone(), cache.v[1, 0, 70:74].clone()
    cache.k[1, 0, 70:74] = cache.v[1, 0, 70:74] = 0
    close(got, model.layers[1](x, ctx, 1), 3e-2)
    close(written[0], cache.k[1, 0, 70:74], 3e-2)
    close(written[1], cache.v[1, 0, 70:74], 3e-2)


def check_eagle(device: str) -> None:
    """EAGLE drafting through the attention kernel: the catch-up's causal rows, a dynamic tree's frontier rows
    and a static tree's one-node level (a single token with a wider region) give the draft network the
    outputs SDPA gives it, pass for pass."""

    tuning = engine_tuning(device)
    target, net = eagle_pair()
    passes: dict[str, list[torch.Tensor]] = {}
    level = "off"
    net.register_forward_hook(lambda module, args, out: passes[level].append(out.clone()))
    for tree, dynamic, nodes in (
        (build_tree([[0], [1], [0, 0], [0, 0, 0]]), None, 4),
        (None, DynamicTreeConfig(top_k=3, depth=3, max_non_leaves_per_layer=2), 6),
    ):
        for level in ("off", "fused"):
            assert attach(net, level, (device,), tuning=tuning)["attention_layers"] == (level == "fused")
            passes[level] = []
            proposer = EagleProposer(net, 200, tree.to(device) if tree else None, dynamic, nodes)
            generate_eagerly(target, proposer, nodes)
        assert len(passes["off"]) == len(passes["fused"]) > 10
        assert tree is None or any(x.shape[1] == 1 for x in passes["off"])  # the static tree's one-node level
        for got, want in zip(passes["fused"], passes["off"]):
            close(got, want, 1e-4)


def eagle_pair() -> tuple[Transformer, EagleNet]:
    """A float32 target and a one-layer EAGLE net of CONFIG's shape, small random weights."""
    target = Transformer(CONFIG).float()
    net = EagleNet(dataclasses.replace(CONFIG, num_layers=1)).float()
    for p in [*target.parameters(), *net.parameters()]:
        p.normal_(0, 0.15)  # at 0.3 the drafter's deeper passes reach scores of 1e5, where float32 sums
        # in another order (SDPA's, the kernel's on CUDA) differ by percents
    return target, net


def generate_eagerly(
    target: Transformer, proposer, nodes: int, record: Callable[[torch.Tensor], None] | None = None
) -> None:
    """Ten tokens through an EAGLE engine without graphs or compiled steps (which would not call the hooks that
    record the passes); `record` gets each drafted tree's tokens."""

    engine = Engine(target, _IdsOnly(), EngineLimits(1, 16, 160, nodes), SpecConfig(), proposer)
    engine.graphs = None
    proposer.step, proposer.graph = proposer._step, CapturedStep(proposer.draft, capture=False)
    if record is not None:
        draft = proposer.draft

        def recorded():
            tree = draft()
            record(tree.tokens.clone())
            return tree

        proposer.draft = recorded
    engine.generate(list(range(1, 13)), SamplingParams(max_tokens=10, end_id=-1))


def check_topk(device: str) -> None:
    from pipeline.engine.kernels.topk import lm_head_topk, row_topk

    half, tol = tile_dtype(device), 1e-2 if device == "cuda" else 1e-5
    # A dynamic tree's small top-k's in one sort: torch.topk's values and positions, ties to the lower
    # position (torch.topk's own order at a tie is unspecified: ties are checked by value only there).
    # Rows of a few hundred values: the interpreter sorts slowly.
    for shape, k in (((1, 8), 8), ((64,), 8), ((200,), 63), ((2, 600), 10), ((1, 1024), 1), ((5, 7), 3)):
        x = torch.randn(shape) * 30
        values, positions = row_topk(x, k)
        want = x.topk(k)
        assert torch.equal(values, want.values) and torch.equal(positions, want.indices), shape
    x = torch.tensor([[2.0, -1.0, 2.0, float("-inf"), -0.0, 0.0, -3.5, 2.0]])
    values, positions = row_topk(x, 6)
    assert values.tolist() == [[2.0, 2.0, 2.0, 0.0, 0.0, -1.0]] and positions[0, :3].tolist() == [0, 2, 7]
    assert torch.equal(row_topk(x.to(half), 3)[0], x.to(half).topk(3).values)

    # The drafter's LM head + log-softmax + top-k in one kernel: rows in one tile and in several, vocabularies
    # and hidden sizes off the tiles, against the unfused ops; then dynamic trees drafted through it.
    for rows, vocab, hidden, k in ((1, 1000, 48, 8), (8, 700, 100, 4), (16, 300, 64, 10), (37, 300, 64, 5)):
        w = (torch.randn(vocab, hidden) * hidden**-0.5).to(half)
        h = (torch.randn(rows, hidden) * 3).to(half)
        logp, tok = lm_head_topk(h, w, k)
        want_logp, want_tok = F.log_softmax(F.linear(h.float(), w.float()), dim=-1).topk(k, dim=-1)
        assert device == "cuda" or torch.equal(tok, want_tok)  # in bf16 a near-tie may order either way
        close(logp, want_logp, tol)
    if device == "cuda":  # float32 through TF32 tiles on a GPU may pick another node at a near-tie
        return
    fused = DrafterKernels(engine_tuning(device))
    target, net = eagle_pair()
    drafted: dict[str, list[torch.Tensor]] = {}
    for name, drafter in (("torch", TORCH_TOPK), ("fused", fused)):
        net.drafter = drafter
        drafted[name] = []
        proposer = EagleProposer(net, 200, None, DynamicTreeConfig(top_k=3, depth=3, max_non_leaves_per_layer=2), 6)
        generate_eagerly(target, proposer, 6, drafted[name].append)
    assert len(drafted["torch"]) > 2 and all(map(torch.equal, drafted["torch"], drafted["fused"]))

    # Medusa's dynamic tree through the same kernels (its heads' shared LM head, log-softmax and top-k in
    # one; the frontier's and the selection's in row_topk): torch's trees, node for node.
    heads = medusa_heads(3, 1, CONFIG.hidden_size, CONFIG.vocab_size, "silu").float()
    for p in heads.parameters():
        p.normal_(0, 0.15)
    medusa = MedusaProposer(
        heads, None, target.lm_head, DynamicTreeConfig(top_k=5, depth=3, max_non_leaves_per_layer=3), 9
    )
    assert medusa.drafter == TORCH_TOPK  # CPU weights: torch's ops unless asked
    for trial in range(3):
        medusa.hidden.copy_(torch.randn_like(medusa.hidden) * 3)
        trees = {}
        for name, drafter in (("torch", TORCH_TOPK), ("fused", fused)):
            medusa.drafter = drafter
            trees[name] = medusa.draft()
        for field in ("tokens", "parents", "depths", "mask"):
            assert torch.equal(getattr(trees["torch"], field), getattr(trees["fused"], field)), (trial, field)


def node_paths(parents: torch.Tensor) -> torch.Tensor:
    """[T, max depth + 1]: each node's indices from the root down to it, padded with its own."""
    paths = []
    for node in range(parents.shape[0]):
        up = [node]
        while parents[up[-1]] >= 0:
            up.append(int(parents[up[-1]]))
        paths.append(up[::-1])
    width = max(map(len, paths))
    return torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths])


def check_paged(device: str) -> None:
    """A small layer's batched step over the block pool through paged_layer (the QKV product writing the
    pool's slots, the paged attention kernel, rows_gemm) against the unfused layer: decode rows, then every
    row's tree (also past the 64-token tile), rows of different lengths whose blocks are not in order; one
    decode row through the GEMVs. A target's layer, and an EAGLE-1 draft's (no input norm)."""
    tuning, half = engine_tuning(device), tile_dtype(device)
    model = Transformer(CONFIG).to(half)
    for p in model.parameters():
        p.normal_(0, 0.3)
    draft_layer = DecoderLayer(CONFIG, input_norm=False).to(half)  # an EAGLE-1 draft's: no input norm
    for p in draft_layer.parameters():
        p.normal_(0, 0.3)
    block = 8
    pool = BlockPool(CONFIG.num_layers, 24, block, CONFIG.num_kv_heads, CONFIG.head_size, half, device)
    pool.k.normal_()
    pool.v.normal_()
    lengths = torch.tensor([37, 5, 20])
    tables = torch.tensor([[9, 3, 12, 1, 20, 7], [2, 16, 0, 0, 0, 0], [5, 11, 18, 4, 0, 0]])
    tree = build_tree([[0], [1], [0, 0]])
    wide = build_tree([[i] for i in range(8)] + [[0, i] for i in range(8)] + [[0, 0, i] for i in range(6)])
    wide_lengths, wide_tables = (
        torch.tensor([17, 5, 20]),
        torch.tensor([[9, 3, 12, 1, 20, 7], [2, 16, 0, 6, 8, 10], [5, 11, 18, 4, 13, 14]]),
    )
    assert 3 * wide.num_nodes > tuning.rows_gemm_max_tokens  # past the tile of 64 tokens, in the kernels' grid
    one = torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    # One decode row (the single-token GEMVs), three decode rows, three rows' trees (rows_gemm), three rows'
    # trees of 69 tokens in all.
    steps = (
        (1, one[0], one[1], lengths, tables),
        (3, one[0], one[1], lengths, tables),
        (3, tree.depths, node_paths(tree.parents), lengths, tables),
        (3, wide.depths, node_paths(wide.parents), wide_lengths, wide_tables),
    )
    for layer, (rows, depths, paths, row_lengths, row_tables) in itertools.product(
        (decoder_layer(model, 1), draft_layer), steps
    ):
        t = depths.shape[0]
        assert rows * t <= tuning.paged_layer_max_tokens
        lengths, table = row_lengths[:rows], row_tables[:rows]
        seq = lengths[:, None] + torch.arange(t)[None]
        region = lengths[:, None, None] + paths[None]
        count = (depths + 1)[None].expand(rows, t)
        view = PagedView(
            pool,
            lengths[:, None] + depths[None],
            pool.slots(table, seq),
            table,
            lengths + t,
            48,
            lengths[:, None].expand(rows, t),
            region,
            count,
        )
        ctx = paged_context(view, model.rotary)
        x = torch.randn(rows, t, CONFIG.hidden_size, dtype=half)
        got = paged_layer(layer, x, ctx, 1, tuning)
        slots = view.slots.reshape(-1)
        written = pool.k[1, slots].clone(), pool.v[1, slots].clone()
        pool.k[1, slots] = pool.v[1, slots] = 0
        close(got, layer.unfused(x, ctx, 1), 3e-2)
        close(written[0], pool.k[1, slots], 3e-2)
        close(written[1], pool.v[1, slots], 3e-2)


CHECKS = (check_gemv, check_rows, check_linear, check_attention, check_model, check_paged, check_eagle, check_topk)


def check(device: str) -> None:
    """Every check on `device` (cpu: TRITON_INTERPRET=1 must be set before the kernel modules are imported)."""
    torch.manual_seed(0)
    torch.set_default_device(device)
    with torch.no_grad():  # the engine never takes gradients; the ops have no backward
        for fn in CHECKS:
            fn(device)


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    if device not in DEVICES:
        sys.exit(f"usage: python -m {__spec__.name} [{'|'.join(DEVICES)}]")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    check(device)
    print("kernels ok")


if __name__ == "__main__":
    main()
