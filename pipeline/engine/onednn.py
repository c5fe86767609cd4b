"""CPU products through oneDNN, with each weight reordered once at load.

At batch 1 a CPU decode step, like a GPU one, is one row times every weight matrix. On this
project's 2-core machine F.linear runs such a product on one core at 11 GB/s, where a plain read
streams 30 GB/s; oneDNN's inner product over a prepacked weight uses both cores: SmolLM2's
products of one token take 25 ms instead of 46, and a 64-token tree's 20% less. Float32 CPU
weights only (the sums are reordered: relative differences around 1e-6). SPECPIPE_ONEDNN=0 keeps
F.linear.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pipeline.engine.model import Linear

ENV = "SPECPIPE_ONEDNN"
# oneDNN's reorder takes the expected row count as a hint; decode steps have one row.
ROWS_HINT = 1


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
