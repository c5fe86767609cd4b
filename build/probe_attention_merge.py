#!/usr/bin/env python3
"""One token's attention on CUDA: slot_attention's two kernels (each split's partial softmax, then a
merge kernel) against one kernel whose last split to finish merges them (a ticket counter a kv head, so
the merge's launch and the gap before it go).

Why: in the H200 profiles of session n (BENCHMARKS.md §2) the one-token attention took 6.8 us a layer
plus 2.6 us for its merge, 39 % of SmolLM2's 0.72 ms plain step; trees' merges cost 2.1 us a layer.

Each case is timed as probe_gemv.py times a product (one CUDA graph of calls, each on a cache of its own)
and checked against float32 SDPA over the visible slots. Under TRITON_INTERPRET=1 on the CPU it checks
the merge alone (the interpreter runs programs one after another, so it cannot show a race; the CUDA
run's error column can).

  python3 build/probe_attention_merge.py                                    # CUDA: table of us a layer
  TRITON_INTERPRET=1 python3 build/probe_attention_merge.py --device cpu    # correctness only
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from probe_gemv import REPS, probe_device, timed  # noqa: E402

from pipeline.engine import fused_kernels  # noqa: E402
from pipeline.engine.fused import ATTENTION_CHUNK_SLOTS, ATTENTION_MAX_SPLITS  # noqa: E402

MERGE_SPLITS = 8  # splits merged a step of the last program's loop: a [group, 8, head] float32 tile
# name: heads, kv heads, head size, cache slots, text length (the token sits at this slot)
CASES = {
    "SmolLM2, 100 tokens": (9, 3, 64, 1089, 100),
    "SmolLM2, 600 tokens": (9, 3, 64, 1089, 600),
    "SmolLM2, 1000 tokens": (9, 3, 64, 1089, 1000),
    "8B, 300 tokens": (32, 8, 128, 1089, 300),
    "8B, 1500 tokens": (32, 8, 128, 2049, 1500),
}


@triton.jit
def _attention_split_merge_kernel(q_ptr, k_ptr, v_ptr, length_ptr, count_ptr, m_ptr, l_ptr, o_ptr, out_ptr,
                                  num_slots, sm_scale, stride_slot, stride_head, num_splits, span,
                                  GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD: tl.constexpr,
                                  CHUNK: tl.constexpr, MERGE: tl.constexpr):
    """fused_kernels._attention_split for one token (no region), then the split that takes the last ticket
    of its kv head merges the group's partials and resets the counter for the next call."""
    fused_kernels._attention_split(q_ptr, k_ptr, v_ptr, length_ptr, k_ptr, m_ptr, l_ptr, o_ptr, num_slots, 1, sm_scale,
                                   stride_slot, stride_head, num_splits, span, GROUP, GROUP_ROWS, HEAD, CHUNK, False)
    kv_head = tl.program_id(0)
    group = tl.arange(0, GROUP_ROWS)
    dims = tl.arange(0, HEAD)
    heads = kv_head * GROUP + group
    live = group < GROUP
    bound = tl.minimum(tl.load(length_ptr) + 1, num_slots)
    # Release: the partials above are visible to whoever takes the last ticket (acquire).
    ticket = tl.atomic_add(count_ptr + kv_head, 1, sem="acq_rel")
    if ticket == num_splits - 1:
        used = tl.cdiv(bound, span)  # splits past the text stored peak -inf: weight 0, skipped
        best = tl.full((GROUP_ROWS,), float("-inf"), tl.float32)
        for s0 in range(0, used, MERGE):
            s = s0 + tl.arange(0, MERGE)
            mask = live[:, None] & (s < used)[None, :]
            best = tl.maximum(best, tl.max(tl.load(m_ptr + heads[:, None] * num_splits + s[None, :], mask=mask,
                                                   other=float("-inf")), axis=1))
        norm = tl.zeros((GROUP_ROWS,), tl.float32)
        out = tl.zeros((GROUP_ROWS, HEAD), tl.float32)
        for s0 in range(0, used, MERGE):
            s = s0 + tl.arange(0, MERGE)
            mask = live[:, None] & (s < used)[None, :]
            part = heads[:, None] * num_splits + s[None, :]  # [GROUP_ROWS, MERGE]
            m = tl.load(m_ptr + part, mask=mask, other=float("-inf"))
            weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - best[:, None]))
            norm += tl.sum(weight * tl.load(l_ptr + part, mask=mask, other=0.0), axis=1)
            o = tl.load(o_ptr + part[:, :, None] * HEAD + dims[None, None, :], mask=mask[:, :, None], other=0.0)
            out += tl.sum(o * weight[:, :, None], axis=1)
        out = out / norm[:, None]
        tl.store(out_ptr + heads[:, None] * HEAD + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.atomic_xchg(count_ptr + kv_head, 0)


def split_merge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor,
                          count: torch.Tensor) -> torch.Tensor:
    """q [1, H, D] over k, v [S, Hkv, D], the token at slot length[0]: slot_attention(q, k, v, length,
    None) in one launch. count: [Hkv] int32 zeros, left zero after each call."""
    _, heads, head = q.shape
    slots, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    span = ATTENTION_CHUNK_SLOTS * triton.cdiv(triton.cdiv(slots, ATTENTION_CHUNK_SLOTS), ATTENTION_MAX_SPLITS)
    splits = triton.cdiv(slots, span)
    m = torch.empty(heads * splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    o = torch.empty(m.shape[0], head, dtype=torch.float32, device=q.device)
    out = q.new_empty(q.shape)
    _attention_split_merge_kernel[(kv_heads, splits)](
        q, k, v, length, count, m, l, o, out, slots, head ** -0.5, k.stride(0), k.stride(1), splits, span,
        GROUP=group, GROUP_ROWS=triton.next_power_of_2(group), HEAD=head, CHUNK=ATTENTION_CHUNK_SLOTS,
        MERGE=MERGE_SPLITS)
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """float32 SDPA of the token over slots [0, length]."""
    seen = slice(0, length + 1)
    return F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k[seen].float().transpose(0, 1)[None],
                                          v[seen].float().transpose(0, 1)[None], enable_gqa=True)[0].transpose(0, 1)


def main() -> None:
    device = probe_device(__doc__)
    cuda = device.type == "cuda"
    layers = REPS if cuda else 1
    torch.manual_seed(0)
    print(f"{'case':<24}{'two kernels':>22}{'one kernel':>22}   (us a layer; max rel err against float32 SDPA)")
    worst = 0.0
    for case, (heads, kv_heads, dim, slots, length) in CASES.items():
        q = torch.randn(1, heads, dim, dtype=torch.bfloat16, device=device)
        k = torch.randn(layers, slots, kv_heads, dim, dtype=torch.bfloat16, device=device)
        v = torch.randn_like(k)
        length_t = torch.tensor([length], device=device)
        count = torch.zeros(kv_heads, dtype=torch.int32, device=device)
        want = reference(q, k[0], v[0], length)
        cells = []
        for name, fn in (("two kernels", lambda i: fused_kernels.slot_attention(q, k[i], v[i], length_t, None)),
                         ("one kernel", lambda i: split_merge_attention(q, k[i], v[i], length_t, count))):
            got = fn(0)
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            worst = max(worst, err) if name == "one kernel" else worst
            us = timed(fn) if cuda else float("nan")
            if cuda:  # the timed replays must leave every counter at zero and the output unchanged
                assert int(count.sum()) == 0 and torch.equal(fn(0), got), f"{case}: {name} is not repeatable"
            cells.append(f"{us:>14.1f} ({err:.0e})")
        print(f"{case:<24}" + "".join(cells), flush=True)
    assert worst < 1e-2, f"the one-kernel merge is off by {worst:.1e}"
    print("merge ok")


if __name__ == "__main__":
    main()
