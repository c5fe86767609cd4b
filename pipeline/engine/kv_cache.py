"""The paged KV cache: a pool of fixed-size blocks shared by every request in flight.

Each request holds a block table (the pool blocks its tokens live in, in order); token i of a
request sits in slot `table[i // block_size] * block_size + i % block_size` of the pool's flat slot
axis. Blocks are taken as a sequence grows and given back when it finishes or is cancelled, so the
pool is sized by a memory budget, not by max_batch_size x max_seq_len rows. Block 0 is never handed
out: padded rows of a batched step write their KV there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.errors import UserError

SCRATCH_BLOCK = 0  # written by the padding rows of a captured step; never read by a real request
DEFAULT_BLOCK_SIZE = 32


@dataclass(frozen=True)
class CacheBudget:
    """How big the pool is: `max_num_tokens` slots when given, else `kv_cache_fraction` of the device's
    free memory (CUDA) or of `cpu_bytes` (CPU), capped at what max_batch_size full sequences need."""

    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_tokens: int | None = None
    kv_cache_fraction: float = 0.5
    cpu_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise UserError(f"--kv-block-size {self.block_size}: must be >= 1")
        if self.max_num_tokens is not None and self.max_num_tokens < 1:
            raise UserError(f"--max-num-tokens {self.max_num_tokens}: must be >= 1")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise UserError(f"--kv-cache-fraction {self.kv_cache_fraction}: must be in (0, 1]")

    def num_blocks(self, bytes_per_token: int, device: torch.device, max_batch_size: int, max_seq_len: int) -> int:
        """Blocks of the pool (the scratch block included), at least one full sequence's worth."""
        per_sequence = -(-max_seq_len // self.block_size)
        if self.max_num_tokens is not None:
            if self.max_num_tokens < max_seq_len:
                raise UserError(
                    f"--max-num-tokens {self.max_num_tokens} holds less than one sequence of this engine's "
                    f"max_seq_len {max_seq_len}; raise it, or rebuild the engine with a smaller --max-seq-len"
                )
            blocks = -(-self.max_num_tokens // self.block_size)
        else:
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else self.cpu_bytes
            blocks = int(free * self.kv_cache_fraction) // (bytes_per_token * self.block_size)
        return 1 + max(per_sequence, min(blocks, max_batch_size * per_sequence))


class BlockPool:
    """K and V of every layer as [layers, blocks * block_size, kv_heads, head_size], with a free list."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, num_blocks * block_size, kv_heads, head_size)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # popped from the end: low blocks first

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` until it holds num_tokens tokens (the caller checked there are enough)."""
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())

    def release(self, table: list[int]) -> None:
        self.free.extend(reversed(table))
        table.clear()

    def slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat pool slots of `positions` (any shape) through a block table [..., blocks] of matching leading shape."""
        block = table.gather(-1, (positions // self.block_size).view(table.shape[:-1] + (-1,)))
        return (block * self.block_size + positions.view(block.shape) % self.block_size).view(positions.shape)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [..., kv_heads, head_size] into `slots` [...] of one layer, as one index_put_ each."""
        layers = torch.full_like(slots, layer)
        self.k.index_put_((layers.reshape(-1), slots.reshape(-1)), k.reshape(-1, *k.shape[-2:]))
        self.v.index_put_((layers.reshape(-1), slots.reshape(-1)), v.reshape(-1, *v.shape[-2:]))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src -> dst (any shape, matching) in every layer: compacts accepted tree paths.
        The reads complete before the writes, so overlapping moves along a path are safe."""
        src, dst = src.reshape(-1), dst.reshape(-1)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def gather(self, layer: int, table: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first num_slots tokens of each row's sequence: table [B, blocks] -> k, v [B, num_slots, kv_heads, D]."""
        positions = torch.arange(num_slots, device=table.device).expand(table.shape[0], num_slots)
        slots = self.slots(table, positions).reshape(-1)
        shape = (table.shape[0], num_slots, *self.k.shape[2:])
        # index_select on the flat slots: half the time of advanced indexing on the CPU (BENCHMARKS §7).
        return self.k[layer].index_select(0, slots).view(shape), self.v[layer].index_select(0, slots).view(shape)


@dataclass
class PagedView:
    """Where a step's tokens go in the pool and what each may read: rows of one batch, each row a request.

    positions [B, T] RoPE positions (= sequence indices) of the new tokens; slots [B, T] their pool slots;
    table [B, blocks] each row's block table; lengths [B] each row's sequence length after the step
    (token t of row b reads sequence indices <= positions[b, t]); attn_len bounds every row's length
    (a host int: how many slots the gathered reads cover).
    """

    pool: BlockPool
    positions: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    lengths: torch.Tensor
    attn_len: int
    # Tree and decode steps: token t of row b reads sequence indices below prefix[b, t], then
    # region[b, t, :count[b, t]] (its path through the tree, itself last; paged_attention). None: a
    # causal run (a prefill chunk) reading indices <= its position.
    prefix: torch.Tensor | None = None
    region: torch.Tensor | None = None
    count: torch.Tensor | None = None
