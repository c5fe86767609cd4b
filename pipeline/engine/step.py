"""The batched step: the target over a batch of rows in the block pool, then each row's next token drawn
on the device.

A decode step takes one token from each of B running requests. On CUDA it replays a graph captured for
the smallest batch bucket (1, 2, 4, ..., max_batch_size) holding B rows; the padding rows read and write
only the pool's scratch block. A prefill chunk runs a run of one request's prompt tokens (eager), its
last token's draw taken only when the chunk ends the prompt. Each call's result stays on the device:
the scheduler copies all of a step's tokens to the host at once.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.engine.graphs import CapturedStep, Compiled, prefill_bucket
from pipeline.engine.kernels.tuning import DEFAULT_TUNING
from pipeline.engine.kv_cache import BlockPool, PagedView
from pipeline.engine.model import Transformer, paged_context
from pipeline.engine.readback import Readback
from pipeline.engine.sampling import argmax_rows, sample_rows

# Batch buckets of the decode graphs: each step pads its rows to the next one.
MIN_BUCKET = 1


def batch_buckets(max_batch_size: int) -> list[int]:
    buckets, b = [], MIN_BUCKET
    while b < max_batch_size:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch_size]


# Columns of a row's int64 step input: the token fed, its position, top-k, seed, the row of the step before
# whose output it feeds instead of TOKEN (-1: none), the request's row in a proposer's state (speculative
# steps; 0 is a scratch row the padding rows use), then the block table.
TOKEN, POSITION, TOP_K, SEED, CARRY, STATE, TABLE = 0, 1, 2, 3, 4, 5, 6
NOT_CARRIED = -1  # a row's CARRY column when its token comes from the host
# Columns of a row's float input.
TEMPERATURE, TOP_P = 0, 1


def step_mode(floats: np.ndarray, ints: np.ndarray) -> str:
    """The step's sampling variant (each has graphs of its own): greedy when every row is, filtered when
    any row uses top-k or top-p."""
    if not (floats[:, TEMPERATURE] > 0).any():
        return "greedy"
    return "filtered" if (ints[:, TOP_K] > 0).any() or (floats[:, TOP_P] < 1.0).any() else "sampled"


class _Buffers:
    """A bucket's static inputs: graphs read them at fixed addresses, the host fills them before each replay.
    A speculative step's buckets also hold each row's draft input (draft_width columns)."""

    def __init__(self, rows: int, max_blocks: int, device: torch.device, draft_width: int = 0):
        self.ints = torch.zeros(rows, TABLE + max_blocks, dtype=torch.long, device=device)
        self.floats = torch.zeros(rows, 2, device=device)
        self.drafts = torch.zeros(rows, draft_width, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self.host_ints = torch.zeros(self.ints.shape, dtype=torch.long, pin_memory=pin)
        self.host_floats = torch.zeros(self.floats.shape, pin_memory=pin)
        self.host_drafts = torch.zeros(self.drafts.shape, dtype=torch.long, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None  # recorded after the last copy out of the host buffers

    def fill(self, ints: np.ndarray, floats: np.ndarray, drafts: np.ndarray | None = None) -> None:
        """The step's rows into the host buffers (padding rows: position 0 of the scratch block, greedy, no
        carried token, no drafts), then to the device. The step before may still be queued, with its copy out
        of these same host buffers behind it: that copy must have run before the host writes them again."""
        if self.copied is not None:
            self.copied.synchronize()
        rows = ints.shape[0]
        host_ints, host_floats = self.host_ints.numpy(), self.host_floats.numpy()
        host_ints[:rows], host_floats[:rows] = ints, floats
        host_ints[rows:] = 0
        host_ints[rows:, CARRY] = NOT_CARRIED
        host_floats[rows:] = (0.0, 1.0)
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.floats.copy_(self.host_floats, non_blocking=True)
        if self.drafts.shape[1]:
            host_drafts = self.host_drafts.numpy()
            host_drafts[:] = 0
            if drafts is not None:
                host_drafts[:rows] = drafts
            self.drafts.copy_(self.host_drafts, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()


class BatchStep:
    draft_width = 0  # draft input columns a row carries (speculative steps)

    def __init__(self, target: Transformer, pool: BlockPool, max_batch_size: int, max_seq_len: int):
        self.target, self.pool = target, pool
        self.device = target.lm_head.weight.device
        self.max_blocks = pool.blocks_for(max_seq_len)
        self.max_seq_len = self.max_blocks * pool.block_size
        self.buckets = batch_buckets(max_batch_size)
        self.capture = self.device.type == "cuda"
        self.pool_handle = torch.cuda.graph_pool_handle() if self.capture else None
        self.compiled = Compiled(self._decode, None if self.capture else False)
        self.buffers: dict[int, _Buffers] = {}
        if self.capture:
            self.buffers = {b: _Buffers(b, self.max_blocks, self.device, self.draft_width) for b in self.buckets}
        self.graphs: dict[tuple[int, str], CapturedStep] = {}
        self.readback = Readback()  # a step's tokens on their way to the host while the next step runs
        self.last = torch.zeros(self.buckets[-1], dtype=torch.long, device=self.device)  # the last step's tokens
        self.prefill_buffers: dict[int, _PrefillBuffers] = {}
        self.prefill_graphs: dict[tuple[int, str], CapturedStep] = {}
        self.capture_layers: tuple[int, ...] = ()  # residual streams a proposer reads from the prefill
        self.prefill_pieces_up_to = PREFILL_PIECES_UP_TO  # longer chunks run whole (see _prefill_pass)

    def new_row(self) -> tuple[np.ndarray, np.ndarray]:
        """A request's step inputs (ints, floats), kept by the scheduler and updated in place."""
        ints = np.zeros(TABLE + self.max_blocks, dtype=np.int64)
        ints[CARRY] = NOT_CARRIED
        return ints, np.zeros(2, dtype=np.float32)

    def decode(self, ints: np.ndarray, floats: np.ndarray) -> torch.Tensor:
        """One token a row: ints [B, TABLE + blocks] and floats [B, 2] as laid out above (each row's table
        already holds its new token's slot) -> [B] next tokens on the device. A row whose CARRY column is
        j >= 0 feeds row j's output of the step before (still on the device, not read by the host) instead
        of its TOKEN column."""
        rows = ints.shape[0]
        mode = step_mode(floats, ints)
        if not self.capture:
            attn_len = int(ints[:, POSITION].max()) + 1
            out = self.compiled(torch.from_numpy(ints), torch.from_numpy(floats), attn_len, mode)
        else:
            bucket = next(b for b in self.buckets if b >= rows)
            x = self.buffers[bucket]
            x.fill(ints, floats)
            key = (bucket, mode)
            if key not in self.graphs:
                self.graphs[key] = CapturedStep(
                    lambda: self.compiled(x.ints, x.floats, self.max_seq_len, mode), self.pool_handle
                )
            out = self.graphs[key]()
        # Outside the graph: its warm-up runs before capture must all read the same carried tokens.
        self.last[: out.shape[0]].copy_(out)
        return out[:rows]

    def _decode(self, ints: torch.Tensor, floats: torch.Tensor, attn_len: int, mode: str) -> torch.Tensor:
        carry, top_k, seeds, table = ints[:, CARRY], ints[:, TOP_K], ints[:, SEED], ints[:, TABLE:]
        tokens = torch.where(carry >= 0, self.last[carry.clamp(min=0)], ints[:, TOKEN])
        positions = ints[:, POSITION, None]
        view = PagedView(
            self.pool,
            positions,
            self.pool.slots(table, positions),
            table,
            positions[:, 0] + 1,
            attn_len,
            positions,
            positions[:, :, None],
            torch.ones_like(positions),
        )
        hidden, _ = self.target(tokens[:, None], paged_context(view, self.target.rotary))
        logits = self.target.logits(hidden[:, 0])
        # The drawn token's key is its own position: one past the token fed.
        return self._choose(logits, floats, top_k, seeds, positions[:, 0] + 1, mode)

    @staticmethod
    def _choose(
        logits: torch.Tensor,
        floats: torch.Tensor,
        top_k: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
        mode: str,
    ) -> torch.Tensor:
        if mode == "greedy":
            return argmax_rows(logits)
        return sample_rows(
            logits, floats[:, TEMPERATURE], top_k, floats[:, TOP_P], seeds, positions, mode == "filtered"
        )

    def prefill(
        self, tokens: list[int], start: int, ints: np.ndarray, floats: np.ndarray, last: bool
    ) -> torch.Tensor | None:
        """Prompt tokens at positions start.. of one request (its row inputs `ints`, `floats`; its table
        holds them) -> its next token [1] on the device when `last` (the chunk ends the prompt), else None.
        On CUDA a chunk replays the graph of its padded length (padding tokens write the scratch block)."""
        n = len(tokens)
        mode = step_mode(floats[None], ints[None]) if last else "none"
        if not self.capture:
            x = _PrefillBuffers(n, len(ints), self.device)
            self._fill_prefill(x, tokens, start, ints, floats)
            return self._prefill(x, start + n, mode)
        bucket = prefill_bucket(n, PREFILL_GRAPH_TOKENS)
        if bucket is None:  # past the largest graph: eagerly
            x = _PrefillBuffers(n, len(ints), self.device)
            self._fill_prefill(x, tokens, start, ints, floats)
            return self._prefill(x, start + n, mode)
        if bucket not in self.prefill_buffers:
            self.prefill_buffers[bucket] = _PrefillBuffers(bucket, len(ints), self.device)
        x = self.prefill_buffers[bucket]
        self._fill_prefill(x, tokens, start, ints, floats)
        key = (bucket, mode)
        if key not in self.prefill_graphs:
            self.prefill_graphs[key] = CapturedStep(lambda: self._prefill(x, self.max_seq_len, mode), self.pool_handle)
        first = self.prefill_graphs[key]()
        return None if first is None else first.clone()  # the graph's output is the next replay's too

    def _fill_prefill(
        self, x: _PrefillBuffers, tokens: list[int], start: int, ints: np.ndarray, floats: np.ndarray
    ) -> None:
        n = len(tokens)
        if x.copied is not None:  # a prefill still queued may copy out of these host buffers: let it first
            x.copied.synchronize()
        positions = np.arange(start, start + n)
        table = ints[TABLE:]
        host = x.host.numpy()
        host[:] = 0  # padding: token 0 at position 0, written to slot 0 of the scratch block
        host[TOKENS, :n] = tokens
        host[POSITIONS, :n] = positions
        host[SLOTS, :n] = (
            table[positions // self.pool.block_size] * self.pool.block_size + positions % self.pool.block_size
        )
        host[LAST, 0] = n - 1
        x.row_host.numpy()[:] = ints
        x.floats_host.numpy()[:] = floats
        x.ints.copy_(x.host, non_blocking=True)
        x.row.copy_(x.row_host, non_blocking=True)
        x.floats.copy_(x.floats_host, non_blocking=True)
        if self.capture:
            x.copied = torch.cuda.Event()
            x.copied.record()

    def _prefill(self, x: _PrefillBuffers, attn_len: int, mode: str) -> torch.Tensor | None:
        hidden, captured = self._prefill_pass(x, attn_len)
        positions = x.ints[POSITIONS][None]
        last = x.ints[LAST, :1]
        first = None
        if mode != "none":
            logits = self.target.logits(hidden[0].index_select(0, last))
            first = self._choose(
                logits,
                x.floats[None],
                x.row[None, TOP_K],
                x.row[None, SEED],
                positions[0].index_select(0, last) + 1,
                mode,
            )
        self._after_prefill(
            x.ints[TOKENS], x.ints[POSITIONS], x.row, hidden[0], [c[0] for c in captured], last, first, attn_len
        )
        return first

    def _prefill_pass(self, x: _PrefillBuffers, attn_len: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The target over a chunk's tokens -> (hidden [1, T, H], captured residual streams [1, T, H]). Each
        token reads its row's sequence below its position, then itself, as a decode token does (on CUDA the
        paged kernel reads them, the chunk's own keys written first). Where the target's layers run the
        kernels, the chunk goes through in pieces of PREFILL_PIECE_TOKENS, one after the other, so that
        every piece takes the rows kernels (a few kernels a layer) rather than the library's dozens."""
        tokens, positions, slots = x.ints[TOKENS][None], x.ints[POSITIONS][None], x.ints[SLOTS][None]
        table = x.row[None, TABLE:]
        n = tokens.shape[1]
        routed = getattr(self.target.layers[0], "paged", None) is not None
        piece = PREFILL_PIECE_TOKENS if routed and n <= self.prefill_pieces_up_to else n
        hiddens, captures = [], []
        for s in range(0, n, piece):
            at = positions[:, s : s + piece]
            # each token: its sequence below its own position, then its own slot (a region of one)
            view = PagedView(
                self.pool,
                at,
                slots[:, s : s + piece],
                table,
                at[:, -1] + 1,
                attn_len,
                prefix=at,
                region=at[:, :, None],
                count=torch.ones_like(at),
            )
            hidden, captured = self.target(
                tokens[:, s : s + piece], paged_context(view, self.target.rotary), self.capture_layers
            )
            hiddens.append(hidden)
            captures.append(captured)
        if len(hiddens) == 1:
            return hiddens[0], captures[0]
        return torch.cat(hiddens, 1), [torch.cat(parts, 1) for parts in zip(*captures)]

    def _after_prefill(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        row: torch.Tensor,
        hidden: torch.Tensor,
        captured: list[torch.Tensor],
        last: torch.Tensor,
        first: torch.Tensor | None,
        attn_len: int,
    ) -> None:
        """A speculative step's proposer takes the chunk here (SpecStep); plain decoding needs nothing."""


# Rows of a prefill chunk's int input: tokens, positions, pool slots, and the last real token's index.
TOKENS, POSITIONS, SLOTS, LAST = 0, 1, 2, 3
# Chunks up to this many tokens replay a graph of their padded length; longer ones run eagerly.
PREFILL_GRAPH_TOKENS = 512
# Where the target runs the kernels, chunks of up to BatchStep.prefill_pieces_up_to tokens go through in pieces
# this long (the rows kernels' 64-token tile, KernelTuning.rows_gemm_max_tokens: the measured piece).
PREFILL_PIECE_TOKENS = DEFAULT_TUNING.rows_gemm_max_tokens
PREFILL_PIECES_UP_TO = 128


class _PrefillBuffers:
    def __init__(self, tokens: int, row: int, device: torch.device):
        self.ints = torch.zeros(4, tokens, dtype=torch.long, device=device)
        self.row = torch.zeros(row, dtype=torch.long, device=device)
        self.floats = torch.zeros(2, device=device)
        pin = device.type == "cuda"
        self.host = torch.zeros(self.ints.shape, dtype=torch.long, pin_memory=pin)
        self.row_host = torch.zeros(row, dtype=torch.long, pin_memory=pin)
        self.floats_host = torch.zeros(2, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None  # recorded after the last copy out of the host buffers
