"""Our Triton kernels (engine/kernels/) and their routing, the kernels run on CPU tensors by Triton's interpreter."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.bench.probes import check_kernels
from pipeline.engine.kernels import routing
from pipeline.engine.kernels.routing import TORCH_TOPK, DrafterKernels
from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning
from pipeline.engine.model import DecoderLayer, Linear, ModelConfig, Transformer
from pipeline.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

NO_TRITON = importlib.util.find_spec("triton") is None


def interpreter_broken() -> bool:
    """Triton 3.6's interpreter fails on NumPy 2.4 (`for k0 in range(0, n, B)` already: 'only
    0-dimensional arrays can be converted to Python scalars'); 3.9 runs. make setup pins NumPy 1.26,
    but a CUDA image may not."""
    import numpy as np

    if NO_TRITON:
        return False
    import triton

    version = lambda text: tuple(int(p) for p in text.split(".")[:2])
    return version(np.__version__) >= (2, 4) and version(triton.__version__) < (3, 9)


@pytest.mark.skipif(NO_TRITON, reason="Triton is not installed (make setup installs it)")
@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                interpreter_broken(), reason="this Triton's interpreter cannot run under this NumPy"
            ),
        ),
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
    ],
)
def test_kernels_match_the_unfused_layers(device):
    """check_kernels in a process of its own: under the interpreter, TRITON_INTERPRET must be set before the
    kernels are defined, and this process may have defined them already."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **({"TRITON_INTERPRET": "1"} if device == "cpu" else {}))
    run = subprocess.run(
        [sys.executable, "-m", check_kernels.__name__, device], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0 and "kernels ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.skipif(NO_TRITON or not torch.cuda.is_available(), reason="needs CUDA and Triton")
def test_every_kernel_level_decodes_the_same_tokens_on_cuda():
    """Whole engine, compiled graphs: fused, gemv and cuBLAS steps on a bf16 model whose logits have
    clear winners, so that rounding cannot flip a greedy choice."""
    from pipeline.bench.speed import _IdsOnly
    from pipeline.engine.config import EngineLimits, SpecConfig
    from pipeline.engine.graphs import GraphedTarget
    from pipeline.engine.runner import Engine
    from pipeline.engine.sampling import SamplingParams

    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(tiny_config(), vocab_size=64, num_layers=2, max_position_embeddings=256))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model = model.to("cuda", torch.bfloat16).eval()
    engine = Engine(model, _IdsOnly(), EngineLimits(1, 16, 160, 0), SpecConfig())
    outputs = {}
    for kernels in routing.LEVELS:
        counts = routing.attach(model, kernels)
        assert counts["fused_layers"] == (2 if kernels == "fused" else 0)
        engine.graphs = GraphedTarget(model, engine.cache, ())
        outputs[kernels] = engine.generate(list(range(1, 17)), SamplingParams(max_tokens=128, end_id=-1)).token_ids
    assert outputs["fused"] == outputs["gemv"] == outputs["off"], outputs


def tiny_config(**changes) -> ModelConfig:
    return dataclasses.replace(
        ModelConfig(
            vocab_size=32,
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_size=16,
            intermediate_size=48,
            norm_epsilon=1e-5,
            rope_theta=1e4,
            rope_scaling=None,
            max_position_embeddings=64,
        ),
        **changes,
    )


def test_attach_leaves_cpu_models_on_the_library_kernels():
    model = Transformer(tiny_config()).to(torch.bfloat16)
    assert routing.attach(model, "fused") == {
        "gemv_layers": 0,
        "fused_layers": 0,
        "attention_layers": 0,
        "draft_topk": 0,
    }  # CPU weights: nothing to route
    assert all(m.gemv is None for m in model.modules() if isinstance(m, Linear))


def test_only_plain_llama_layers_fuse():
    assert routing.fusable(Transformer(tiny_config()).layers[0])
    assert routing.fusable(DecoderLayer(tiny_config(), input_norm=False))  # an EAGLE-1 draft's layer
    for changes in ({"qkv_bias": True}, {"mlp_bias": True}, {"hidden_act": "gelu"}, {"head_size": 24}):
        assert not routing.fusable(Transformer(tiny_config(**changes)).layers[0]), changes


def test_a_bad_kernel_level_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(routing.KERNELS_ENV, "gemm")
    with pytest.raises(UserError, match="SPECPIPE_KERNELS=gemm: use one of fused, gemv, off"):
        routing.level()


def test_drafter_kernels_take_half_weights_on_the_devices_named_only(monkeypatch):
    w = torch.zeros(64, 16, dtype=torch.bfloat16)
    assert routing.drafter_kernels(w) == TORCH_TOPK  # CPU weights, CUDA asked: torch's ops
    assert routing.drafter_kernels(w, "fused", ("cpu",)) == DrafterKernels(DEFAULT_TUNING)
    tuning = dataclasses.replace(DEFAULT_TUNING, draft_topk_max_k=8)
    assert routing.drafter_kernels(w, "fused", ("cpu",), tuning=tuning).tuning is tuning
    assert routing.drafter_kernels(w.float(), "fused", ("cpu",)) == TORCH_TOPK
    assert routing.drafter_kernels(w, "off", ("cpu",)) == TORCH_TOPK
    monkeypatch.setenv(routing.DRAFT_TOPK_ENV, "torch")
    assert routing.drafter_kernels(w, "fused", ("cpu",)) == TORCH_TOPK
    x = torch.tensor([3.0, 1.0, 2.0])
    assert [t.tolist() for t in TORCH_TOPK.topk(x, 2)] == [[3.0, 2.0], [0, 2]]
    fits = DrafterKernels(DEFAULT_TUNING).lm_head_topk_fits
    assert fits(128, 16) and not fits(129, 8) and not fits(8, 32) and not TORCH_TOPK.lm_head_topk_fits(1, 1)


def test_the_default_tuning_is_the_engines():
    """The values the engine's kernels were measured with (BENCHMARKS.md); a bad variant is refused."""
    t = KernelTuning()
    assert (t.block_rows, t.block_k, t.num_warps) == (8, 1024, 8)
    flags = (t.gated_gemv, t.rope_in_gemv, t.rows_mlp, t.rows_layer, t.one_token_tiles)
    assert flags == (False, True, True, True, True)
    assert (t.rows_gemm_max_tokens, t.rows_gemm_gated_tile, t.rows_gemm_tile) == (64, (64, 64, 4, 4), (32, 256, 4, 4))
    assert (t.paged_layer, t.paged_decode_rows, t.paged_layer_max_tokens) == (True, (1, 64), 2048)
    assert (t.rows_small_weights, t.rows_small_rope_tile, t.rows_small_gated_tile, t.rows_small_tile) == (
        1 << 22,
        (16, 32, 64, 4, 5),
        (16, 64, 64, 4, 5),
        (64, 16, 128, 4, 5),
    )
    assert (
        t.attention_chunk_slots,
        t.attention_max_splits,
        t.attention_programs,
        t.tree_block_rows,
        t.tree_block_slots,
        t.tree_min_rows,
        t.tree_min_blocks_per_split,
        t.tree_max_blocks_per_split,
        t.float32_dot,
    ) == (16, 64, 256, 16, 64, 16, 2, 4, "ieee")
    assert (
        t.draft_topk_tile,
        t.draft_topk_warps,
        t.draft_topk_max_rows,
        t.draft_topk_fused_rows,
        t.draft_topk_max_k,
        t.draft_topk_block_h,
        t.row_topk_max,
    ) == (256, 4, 16, 128, 16, 64, 4096)
    for bad in ({"block_rows": 6}, {"float32_dot": "fast"}, {"rows_gemm_tile": (32, 256, 4)}):
        with pytest.raises(ValueError):
            dataclasses.replace(t, **bad)


def test_eagle_nets_reach_their_top_k_kernels_through_drafter_kernels():
    """attach gives EAGLE's nets drafter_kernels' answer (MedusaProposer asks it for its heads)."""
    from pipeline.engine.eagle import EagleNet

    net = EagleNet(tiny_config()).to(torch.bfloat16)
    assert net.drafter == TORCH_TOPK
    if NO_TRITON:
        return
    tuning = dataclasses.replace(DEFAULT_TUNING, draft_topk_max_rows=8)
    assert routing.attach(net, "fused", ("cpu",), tuning=tuning)["draft_topk"] == 1
    assert net.drafter == DrafterKernels(tuning)
    routing.attach(net, "off", ("cpu",))
    assert net.drafter == TORCH_TOPK
