#!/usr/bin/env python3
"""Attention of several tokens (a tree's verification, an EAGLE draft pass) on CUDA: masked SDPA over
every cache slot (what the graphs ran before slot_attention) against slot_attention's tensor-core kernel
with other split rules, tile heights and float32 product precisions.

Each case is timed as probe_gemv.py times a product: one CUDA graph of calls, each on a layer of its own
cache (so no call reads another's slots from L2); prints microseconds a call and the error against
float32 SDPA.

  python3 build/probe_tree_attention.py        # on CUDA (about half a minute)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipeline.engine import fused_kernels  # noqa: E402
from probe_gemv import REPS, timed  # noqa: E402

LAYERS = REPS  # caches: one per call of the timed graph
VISIBLE_SHARE = 0.4  # of the region's rows a tree token sees (a tree's ancestors, roughly)
# name: heads, kv heads, head size, cache slots, text length, tokens, dtype
CASES = {
    "8B tree 64, short text": (32, 8, 128, 322, 128, 64, torch.bfloat16),
    "8B tree 64, long text": (32, 8, 128, 2048, 1500, 64, torch.bfloat16),
    "8B tree 16, short text": (32, 8, 128, 322, 128, 16, torch.bfloat16),
    "SmolLM2 tree 64": (9, 3, 64, 1400, 600, 64, torch.bfloat16),
    "SmolLM2 draft pass 10": (9, 3, 64, 1400, 600, 10, torch.bfloat16),
    "SmolLM2 fp32 tree 64": (9, 3, 64, 1400, 600, 64, torch.float32),
    "SmolLM2 fp32 draft pass 10": (9, 3, 64, 1400, 600, 10, torch.float32),
}
# name: fused_kernels constants to override (the rest as the engine has them)
VARIANTS = {
    "engine": {},
    "64-row tiles": {"TREE_BLOCK_ROWS": 64},
    "32-row tiles": {"TREE_BLOCK_ROWS": 32},
    "1 block/split": {"TREE_MIN_BLOCKS_PER_SPLIT": 1},
    "4 blocks/split": {"TREE_MIN_BLOCKS_PER_SPLIT": 4},
    "32-slot blocks": {"TREE_BLOCK_SLOTS": 32},
    "128-slot blocks": {"TREE_BLOCK_SLOTS": 128},
    "fp32 as tf32x3": {"FLOAT32_DOT": "tf32x3"},
}


def main() -> None:
    torch.manual_seed(0)
    engine = {name: getattr(fused_kernels, name) for change in VARIANTS.values() for name in change}
    names = ["sdpa over every slot"] + list(VARIANTS)
    print(f"{'case':<26}" + "".join(f"{n:>22}" for n in names) + "   (us a layer; max rel err)")
    for case, (heads, kv_heads, dim, slots, length, tokens, dtype) in CASES.items():
        q = torch.randn(tokens, heads, dim, dtype=dtype, device="cuda")
        k = torch.randn(LAYERS, slots, kv_heads, dim, dtype=dtype, device="cuda")
        v = torch.randn_like(k)
        rows = torch.rand(tokens, tokens, device="cuda") < VISIBLE_SHARE
        rows[torch.arange(tokens), torch.arange(tokens)] = True
        length_t = torch.tensor([length], device="cuda")
        mask = torch.zeros(tokens, slots, dtype=torch.bool, device="cuda")
        mask[:, :length] = True
        mask[:, length:length + tokens] = rows

        def sdpa(layer: int, precise: bool = False) -> torch.Tensor:
            cast = (lambda t: t.float()) if precise else (lambda t: t)
            return F.scaled_dot_product_attention(
                cast(q.transpose(0, 1))[None], cast(k[layer].transpose(0, 1))[None], cast(v[layer].transpose(0, 1))[None],
                attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)

        want = sdpa(0, precise=True)
        cells = [f"{timed(sdpa):>22.1f}"]
        for change in VARIANTS.values():
            for name, value in {**engine, **change}.items():
                setattr(fused_kernels, name, value)
            got = fused_kernels.slot_attention(q, k[0], v[0], length_t, rows)
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            us = timed(lambda layer: fused_kernels.slot_attention(q, k[layer], v[layer], length_t, rows))
            cells.append(f"{us:>14.1f} ({err:.0e})")
        print(f"{case:<26}" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
