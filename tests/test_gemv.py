"""The CUDA single-token kernel (engine/gemv_kernel.py), run on CPU tensors by Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pipeline.engine import gemv
from pipeline.engine.model import Linear

ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from pipeline.engine.gemv_kernel import gemv
    from pipeline.engine.model import Linear

    torch.manual_seed(0)
    torch.set_grad_enabled(False)  # the engine never takes gradients; the op has no backward
    # Row counts and widths off the block sizes (8 rows, 512 columns) exercise the masks.
    for n, k, dtype, tol in ((100, 300, torch.bfloat16, 1e-2), (37, 1030, torch.float16, 1e-3),
                             (16, 1024, torch.float32, 1e-6)):
        w, x = torch.randn(n, k, dtype=dtype), torch.randn(k, dtype=dtype)
        ref = w.double() @ x.double()
        err = ((gemv(x, w).double() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, (n, k, dtype, err)

    lin = Linear(64, 24, bias=True).to(torch.bfloat16)
    lin.gemv = gemv
    one, many = torch.randn(1, 1, 64, dtype=torch.bfloat16), torch.randn(1, 3, 64, dtype=torch.bfloat16)
    want = F.linear(one.double(), lin.weight.double(), lin.bias.double())
    assert (lin(one).double() - want).abs().max() < 5e-2
    assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias))  # trees stay on the library GEMM

    compiled = torch.compile(lambda t: lin(t) * 2, fullgraph=True)  # the op traces whole, like the engine's graphs
    assert torch.equal(compiled(one), lin(one) * 2)
    print("gemv ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (make setup installs it)")
def test_kernel_matches_the_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "gemv ok" in run.stdout, run.stderr[-3000:]


def test_attach_leaves_cpu_and_float32_models_on_the_library_gemm(monkeypatch):
    model = torch.nn.Sequential(Linear(8, 8), Linear(8, 4).to(torch.bfloat16))
    assert gemv.attach(model) == 0  # CPU weights: nothing to route
    assert all(m.gemv is None for m in model)
    monkeypatch.setenv(gemv.GEMV_ENV, "0")
    assert not gemv.available()
