"""The batch-invariant kernels (pipeline/engine/kernels/invariant.py): row r of a B-row call is the 1-row call on
that row, bit for bit, and the results match F.linear and RMSNorm.forward.

Run with TRITON_INTERPRET=1 on CPU tensors (tests/test_invariance.py does), or as is on a GPU:
`python tests/invariance_check.py`. Prints "ok" when every case holds.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent.parent))  # the pipeline package, when run from anywhere

from pipeline.engine.kernels.invariant import invariant_linear, invariant_rms_norm, k_span
from pipeline.engine.kernels.routing import attach
from pipeline.engine.kernels.tuning import DEFAULT_TUNING
from pipeline.engine.model import MLP, Linear, ModelConfig, RMSNorm

BATCHES = (1, 2, 7, 64)
# The 1-row calls compared: every row of the small batches, and rows spread over the batch of 64 (each call
# runs program by program in the interpreter).
SINGLE_ROWS = (0, 1, 2, 3, 4, 5, 6, 20, 41, 63)
# (outputs N, columns K, bias): K not a multiple of the 128-column block; (130, 700) splits K into 3 spans
# (the partials' path), (96, 200) is one span (the direct path).
LINEAR_SHAPES = ((96, 150, True), (130, 700, False), (130, 700, True))
NORM_SIZES = (200, 1500)  # one block and two of the norm's 1024 columns
EPS = 1e-5
# Against float32 references: float32 sums of another order, or one bf16 rounding (the interpreter truncates
# where the GPU rounds to nearest: two bf16 units at most).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
TINY = ModelConfig(64, 48, 1, 2, 1, 24, 80, EPS, 1e4, None, 64, mlp_bias=True)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """got equals want to TOLERANCE[dtype] of want's largest magnitude."""
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert err < TOLERANCE[dtype], (dtype, err)


def rows_invariant(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x[:B]) row r == fn(x[r : r + 1]) bitwise for every B in BATCHES and r in SINGLE_ROWS below B.
    Returns fn(x) (the batch of 64)."""
    singles = {r: fn(x[r : r + 1]) for r in SINGLE_ROWS}
    out = x
    for b in BATCHES:
        out = fn(x[:b])
        for r in (r for r in SINGLE_ROWS if r < b):
            assert torch.equal(out[r : r + 1], singles[r]), (b, r)
    return out


def check_linear(device: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for n, k, with_bias in LINEAR_SHAPES:
            x = torch.randn(max(BATCHES), k, device=device).to(dtype)
            w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
            bias = torch.randn(n, device=device).to(dtype) if with_bias else None
            got = rows_invariant(lambda rows, w=w, bias=bias: invariant_linear(rows, w, bias), x)
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            assert got.dtype == dtype and got.shape == want.shape
            close(got, want, dtype)
    # Rows in launches of 16: the same bits as one launch of 64.
    chunked = dataclasses.replace(DEFAULT_TUNING, invariant_max_rows=16)
    x, w = torch.randn(64, 700, device=device), torch.randn(130, 700, device=device)
    assert torch.equal(invariant_linear(x, w, tuning=chunked), invariant_linear(x, w))
    assert k_span(130, 700) < 700 and k_span(96, 150) >= 150  # both of the kernel's paths were run above


def check_norm(device: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for size in NORM_SIZES:
            norm = RMSNorm(size, EPS).to(device=device, dtype=dtype)
            with torch.no_grad():
                norm.weight.normal_()
            x = torch.randn(max(BATCHES), size, device=device).to(dtype)
            got = rows_invariant(lambda rows, norm=norm: invariant_rms_norm(rows, norm.weight, norm.eps), x)
            with torch.no_grad():
                want = norm(x)
            assert got.dtype == want.dtype
            close(got, want, dtype)


def check_routing(device: str) -> None:
    """attach(..., invariant=True) routes a model's Linear layers and norms, for every row count; and back."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(2)
        mlp, norm = MLP(TINY).to(device=device, dtype=dtype), RMSNorm(TINY.hidden_size, EPS).to(device, dtype)
        model = torch.nn.ModuleList([mlp, norm])
        x = torch.randn(1, max(BATCHES), TINY.hidden_size, device=device).to(dtype)
        with torch.no_grad():
            want = mlp(norm(x))
            counts = attach(model, "off", (device,), invariant=True)
            assert counts["invariant_linears"] == 2 and counts["invariant_norms"] == 1, counts
            assert isinstance(mlp.proj, Linear) and mlp.proj.invariant is not None and mlp.proj.gemv is None
            got = rows_invariant(lambda rows, mlp=mlp, norm=norm: mlp(norm(rows[None]))[0], x[0])
            close(got, want[0], dtype)
            assert "invariant_linears" not in attach(model, "off", (device,))
            assert mlp.proj.invariant is None and norm.invariant is None


def check(device: str) -> None:
    torch.manual_seed(0)
    check_linear(device)
    check_norm(device)
    check_routing(device)
    print("ok")


if __name__ == "__main__":
    check("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
