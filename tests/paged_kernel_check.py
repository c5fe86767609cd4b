"""The paged decode kernel against the gathered attention (SDPA over each row's sequence).

Run with TRITON_INTERPRET=1 on CPU tensors (tests/test_scheduler.py does), or as is on a GPU:
`python tests/paged_kernel_check.py`. Prints "ok" when every case matches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent.parent))  # the pipeline package, when run from anywhere

from pipeline.engine.kv_cache import BlockPool
from pipeline.engine.paged_attention import paged_attention, paged_decode_attention

# (rows' lengths, heads, kv heads, head size, block size, dtype)
CASES = (
    ((5, 1, 40, 17), 4, 2, 16, 8, torch.float32),
    ((3,), 3, 3, 32, 4, torch.float32),
    ((70, 9, 33), 9, 3, 64, 16, torch.bfloat16),
)


def check(device: str) -> None:
    torch.manual_seed(0)
    for lengths, heads, kv_heads, head, block, dtype in CASES:
        rows = len(lengths)
        blocks = [-(-n // block) for n in lengths]
        pool = BlockPool(1, 1 + sum(blocks) + 3, block, kv_heads, head, dtype, device)
        pool.k.normal_()
        pool.v.normal_()
        tables = []
        for n in blocks:  # blocks handed out in a scrambled order: tables are not contiguous
            table: list[int] = []
            pool.grow(table, n * block)
            tables.append(table[::-1])
        width = max(blocks)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        q = torch.randn(rows, heads, head, device=device).to(dtype)
        length = torch.tensor(lengths, device=device)
        got = paged_decode_attention(q, pool.k[0], pool.v[0], table, length, block)
        keys, values = pool.gather(0, table, max(lengths))
        visible = torch.arange(max(lengths), device=device)[None, :] < length[:, None]
        want = F.scaled_dot_product_attention(
            q[:, :, None].float(),
            keys.transpose(1, 2).float(),
            values.transpose(1, 2).float(),
            attn_mask=visible[:, None, None],
            enable_gqa=True,
        )[:, :, 0]
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        for r in range(rows):  # batch invariance: each row alone gives its batched output, bit for bit
            alone = paged_decode_attention(
                q[r : r + 1], pool.k[0], pool.v[0], table[r : r + 1], length[r : r + 1], block
            )
            assert torch.equal(alone, got[r : r + 1]), (lengths, r)
    check_batch_invariance(device)
    check_tree_nodes(device)
    print("ok")


def check_batch_invariance(device: str) -> None:
    """Row r of a B-row call equals the 1-row call on that row, bitwise, for B in 1, 2, 7, 64, bf16 and fp32."""
    torch.manual_seed(1)
    block, width, heads, kv_heads, head = 8, 2, 4, 2, 16  # small: the interpreter runs each program in Python
    for dtype in (torch.float32, torch.bfloat16):
        rows = 64
        lengths = torch.randint(1, block * width + 1, (rows,))
        pool = BlockPool(1, 1 + rows * width, block, kv_heads, head, dtype, device)
        pool.k.normal_()
        pool.v.normal_()
        tables = []
        for n in lengths.tolist():
            table: list[int] = []
            pool.grow(table, n)
            tables.append(table + [0] * (width - len(table)))
        table_t = torch.tensor(tables, device=device)
        q = torch.randn(rows, heads, head, device=device).to(dtype)
        alone = [
            paged_decode_attention(
                q[r : r + 1], pool.k[0], pool.v[0], table_t[r : r + 1], lengths[r : r + 1].to(device), block
            )
            for r in range(rows)
        ]
        for batch in (1, 2, 7, 64):
            got = paged_decode_attention(
                q[:batch], pool.k[0], pool.v[0], table_t[:batch], lengths[:batch].to(device), block
            )
            for r in range(batch):
                assert torch.equal(got[r : r + 1], alone[r]), (dtype, batch, r)


def check_tree_nodes(device: str) -> None:
    """A tree node reads the accepted text and then its path, and gets bitwise what a decode step gets once
    that path is compacted behind the text; a batch of rows' trees in one call gives each row's own result."""
    torch.manual_seed(2)
    block, heads, kv_heads, head = 8, 4, 2, 16
    # A tree of 11 nodes, 4 deep: two tiles of queries (8 a tile at 2 query heads a kv head).
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 5, 0]
    paths = []
    for node in range(len(parents)):
        up = [node]
        while parents[up[-1]] >= 0:
            up.append(parents[up[-1]])
        paths.append(up[::-1])
    width = max(len(p) for p in paths)
    for dtype in (torch.float32, torch.bfloat16):
        prefixes = [5, 45, 70]  # the longer ones read chunks of their text shared by the whole tile
        rows, nodes = len(prefixes), len(parents)
        blocks = -(-(max(prefixes) + nodes) // block)
        pool = BlockPool(1, 1 + rows * blocks, block, kv_heads, head, dtype, device)
        pool.k.normal_()
        pool.v.normal_()
        tables = []
        for _ in prefixes:
            table: list[int] = []
            pool.grow(table, blocks * block)
            tables.append(table[::-1])
        table_t = torch.tensor(tables, device=device)
        q = torch.randn(rows, nodes, heads, head, device=device).to(dtype)
        prefix = torch.tensor(prefixes, device=device)[:, None].expand(rows, nodes)
        region = torch.tensor([[p + [p[-1]] * (width - len(p)) for p in paths]], device=device) + prefix[:, :, None]
        count = torch.tensor([len(p) for p in paths], device=device)[None].expand(rows, nodes)
        got = paged_attention(q, pool.k[0], pool.v[0], table_t, prefix, region, count, block)
        for r, length in enumerate(prefixes):
            for node, path in enumerate(paths):
                alone = paged_attention(
                    q[r : r + 1, node : node + 1],
                    pool.k[0],
                    pool.v[0],
                    table_t[r : r + 1],
                    prefix[r : r + 1, node : node + 1],
                    region[r : r + 1, node : node + 1],
                    count[r : r + 1, node : node + 1],
                    block,
                )
                assert torch.equal(alone[0, 0], got[r, node]), (dtype, r, node)
                compacted = BlockPool(1, pool.num_blocks, block, kv_heads, head, dtype, device)
                compacted.k.copy_(pool.k)
                compacted.v.copy_(pool.v)
                src = compacted.slots(table_t[r], torch.tensor([length + n for n in path], device=device))
                dst = compacted.slots(table_t[r], torch.arange(length, length + len(path), device=device))
                compacted.move(src, dst)
                decoded = paged_decode_attention(
                    q[r : r + 1, node],
                    compacted.k[0],
                    compacted.v[0],
                    table_t[r : r + 1],
                    torch.tensor([length + len(path)], device=device),
                    block,
                )
                assert torch.equal(decoded[0], got[r, node]), ("compacted", dtype, r, node)


if __name__ == "__main__":
    check("cuda" if torch.cuda.is_available() else "cpu")
