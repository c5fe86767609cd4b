"""Single-token matrix-vector products on CUDA: one Triton kernel instead of cuBLAS.

At batch 1 a decode step is one row times every weight matrix, so its speed is how fast those
matrices stream from memory. cuBLAS's bf16 kernels for one row read the Llama-3-8B projections at
3.2-3.9 TB/s on an H200; this kernel, each program summing BLOCK_ROWS whole rows in float32, read
them at 4.1-4.4 TB/s in the same probe (build/probe_gemv.py, 2026-11-30; the 34 MB output projection
read faster than memory by both, partly from L2): 3.48 ms against 4.04 ms for the 129 products of
one token. Only half-precision weights use it (float32 models are
small and launch-bound), and only single-token products: trees and prefills stay on cuBLAS.

Imported only on CUDA (it needs Triton); `SPECPIPE_GEMV=0` keeps cuBLAS everywhere. With
TRITON_INTERPRET=1 the same kernel runs on CPU tensors, which is how the tests check it.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from pipeline.engine.model import Linear

GEMV_ENV = "SPECPIPE_GEMV"
# One configuration for every shape: the probe's best per shape ranged over (2-16 rows, 256-1024
# columns, 4-8 warps) but within a few percent of this one for the projections that dominate.
BLOCK_ROWS = 8
BLOCK_K = 512
NUM_WARPS = 4
HALF_DTYPES = (torch.float16, torch.bfloat16)


def available() -> bool:
    return os.environ.get(GEMV_ENV, "1") != "0" and importlib.util.find_spec("triton") is not None


def attach(model: nn.Module) -> int:
    """Route the single-token products of `model`'s half-precision Linear layers through the kernel;
    returns how many layers now use it (0 when Triton or the environment rules it out)."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.weight.is_cuda
              and m.weight.dtype in HALF_DTYPES]
    if not layers or not available():
        return 0
    from pipeline.engine.gemv_kernel import gemv

    for m in layers:
        m.gemv = gemv
    return len(layers)
