"""CPU products through oneDNN, with each weight reordered once at load.

At batch 1 a CPU decode step, like a GPU one, is one row times every weight matrix. On a 2-core
machine F.linear runs such a product on one core, well below the memory's bandwidth; oneDNN's inner
product over a prepacked weight uses both cores (BENCHMARKS §8 has the numbers). Float32 CPU weights
only (the sums are reordered: relative differences around 1e-6). SPECPIPE_ONEDNN=0 keeps
F.linear.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pipeline.engine.model import Linear

ENV = "SPECPIPE_ONEDNN"
# oneDNN's reorder takes the expected row count as a hint. Given 1 it picks a layout that reads SmolLM2's
# weights a third slower even for one row; any hint from 2 to 64 gives the fast one (BENCHMARKS §8). 16 rows
# is a CPU engine's default batch.
ROWS_HINT = 16


def available() -> bool:
    return (
        os.environ.get(ENV, "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(module: nn.Module) -> int:
    """Give every float32 CPU Linear in `module` a prepacked weight (Linear.forward then uses it);
    returns how many. Call it after the weights are final: the packed copy does not follow them."""
    if not available():
        return 0
    linears = [
        m
        for m in module.modules()
        if isinstance(m, Linear) and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
    ]
    for m in linears:
        m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), ROWS_HINT)
    return len(linears)
