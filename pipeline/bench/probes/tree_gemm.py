"""Verification passes multiply a few rows (a tree's 8-64 tokens) by every weight matrix: cuBLAS
against a Triton tensor-core kernel that streams each weight tile once for all rows, on the
Llama-3-8B shapes, over a sweep of tile sizes (a bare kernel of this probe's own).

Each product runs inside one CUDA graph cycling through distinct weight copies (as the gemv probe),
so that no matrix is read from L2. Prints microseconds (GB/s of weights) per shape and row count,
and the sum over one pass's 129 products for cuBLAS, the best tile per shape and the best single tile.

With --mlp: a tree step's MLP of one layer (gate/up, SiLU-and-multiply, down, residual add) compiled as
without KernelTuning.rows_mlp (cuBLAS, inductor's SiLU, cuBLAS split-K and its reduction) against rows_gemm's
two kernels over a sweep of its tiles (rows_gemm_gated_tile, rows_gemm_tile).
With --layer: a small layer's four products as KernelTuning.rows_layer runs them, over a sweep of the
rows_small_*_tile tiles.

  python -m pipeline.bench.probes.tree_gemm               # on a CUDA machine (about a minute)
  python -m pipeline.bench.probes.tree_gemm --mlp [--shape smollm2]   # the MLP of a tree step
  python -m pipeline.bench.probes.tree_gemm --layer 64 --shape smollm2  # a small layer's products: their tiles
  TRITON_INTERPRET=1 python -m pipeline.bench.probes.tree_gemm --check   # the kernel's sums on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pipeline.bench.probes.gemv import COPIES, REPS, SHAPES, cold_copies, timed
from pipeline.bench.probes.variants import format_variant
from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning

ROWS = (16, 64)  # tree tokens
# rows (BLOCK_N weight rows a program), columns (BLOCK_K), warps, pipeline stages
SWEEP = tuple(itertools.product((16, 32, 64), (128, 256), (4,), (3, 4)))


def with_tiles(tiles: Mapping[str, tuple[int, ...]]) -> KernelTuning:
    """DEFAULT_TUNING with the named tile fields replaced (dataclasses.replace, which mypy cannot check
    with field names chosen at run time)."""
    return dataclasses.replace(DEFAULT_TUNING, **cast("dict[str, Any]", dict(tiles)))


def _linear_copy(x: torch.Tensor, ws: list[torch.Tensor], copies: int, i: int) -> torch.Tensor:
    """cuBLAS's product of x and the i-th of `copies` weight copies (cycling)."""
    return F.linear(x, ws[i % copies])


@triton.jit
def _tree_gemm_kernel(
    x_ptr, w_ptr, y_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """y[m, n] = x[m, k] W[n, k]^T for m <= BLOCK_M: each program owns BLOCK_N weight rows and
    reads them once, for every row of x (x itself comes from L2)."""
    tokens = tl.arange(0, BLOCK_M)
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        inside = cols < k
        x = tl.load(
            x_ptr + tokens[:, None] * k + cols[None, :], mask=(tokens < m)[:, None] & inside[None, :], other=0.0
        )
        w = tl.load(w_ptr + outs[:, None] * k + cols[None, :], mask=(outs < n)[:, None] & inside[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(
        y_ptr + tokens[:, None] * n + outs[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(tokens < m)[:, None] & (outs < n)[None, :],
    )


def tree_gemm(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int, warps: int, stages: int
) -> None:
    m, k = x.shape
    n = w.shape[0]
    _tree_gemm_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        y,
        m,
        n,
        k,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )


def check() -> None:
    """The kernel against float64 on small float32 shapes, edges included (Triton's interpreter)."""
    for m, n, k in ((3, 20, 70), (16, 33, 130), (9, 64, 256)):
        x, w = torch.randn(m, k), torch.randn(n, k)
        y = torch.empty(m, n)
        tree_gemm(x, w, y, 16, 64, 4, 2)
        err = ((y.double() - x.double() @ w.double().T).abs().max() / (x.double() @ w.double().T).abs().max()).item()
        assert err < 1e-5, (m, n, k, err)
    print("tree gemm ok")


def main() -> None:
    torch.manual_seed(0)
    t0 = time.time()
    for m in ROWS:
        totals = {"cublas": 0.0, "best tile per shape": 0.0}
        per_config = {c: 0.0 for c in SWEEP}
        print(f"{m} rows; tiles as rows,columns,warps,stages: us (GB/s)")
        for name, (n, k, per_pass, _) in SHAPES.items():
            copies = max(1, min(COPIES, int(2e9 // (n * k * 2))))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            mb = n * k * 2 / 1e6
            gbs = lambda us, mb=mb: mb / us * 1e3
            t_cublas = timed(functools.partial(_linear_copy, x, ws, copies))
            ref = F.linear(x.float(), ws[0].float())
            times: dict[tuple[int, ...], float] = {}
            for config in SWEEP:
                try:
                    tree_gemm(x, ws[0], y, *config)
                except triton.runtime.errors.OutOfResources:  # the tile's pipeline exceeds shared memory
                    per_config[config] = float("inf")
                    continue
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 2e-2, (name, m, config, err)

                def run_tile(
                    i: int,
                    c: tuple[int, int, int, int] = config,
                    x: torch.Tensor = x,
                    ws: list[torch.Tensor] = ws,
                    copies: int = copies,
                    y: torch.Tensor = y,
                ) -> None:
                    tree_gemm(x, ws[i % copies], y, *c)

                times[config] = timed(run_tile)
                per_config[config] += per_pass * times[config]
            best = min(times, key=lambda c: times[c])
            totals["cublas"] += per_pass * t_cublas
            totals["best tile per shape"] += per_pass * times[best]
            print(
                f"{name:<8}{mb:7.1f} MB  cublas {t_cublas:6.1f} ({gbs(t_cublas):4.0f})  best {best}: "
                f"{times[best]:6.1f} ({gbs(times[best]):4.0f})  "
                + "  ".join(f"{','.join(map(str, c))}: {t:.1f}" for c, t in times.items()),
                flush=True,
            )
            ws = []  # free this shape's copies before the next shape's
        single = min(per_config, key=lambda c: per_config[c])
        totals[f"best single tile {single}"] = per_config[single]
        print(f"{m} rows, one pass's 129 products (ms):", {key: round(v / 1e3, 3) for key, v in totals.items()})
    print(f"probe {time.time() - t0:.0f} s")


# rows_gemm tiles: BLOCK_N outputs, BLOCK_K columns, warps, stages
MLP_SWEEP = (
    *itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4)),
    (32, 128, 8, 4),
    (64, 128, 8, 3),
    (32, 64, 4, 6),
    (16, 128, 4, 6),
)
MLP_SHAPES = {"llama3-8b": (4096, 14336, 32), "smollm2": (576, 1536, 30)}  # hidden, intermediate, layers


def mlp(shape: str) -> None:
    from pipeline.engine.kernels.rows import rows_gemm

    HIDDEN, INTERMEDIATE, LAYERS = MLP_SHAPES[shape]
    copies = cold_copies(3 * INTERMEDIATE * HIDDEN * 2)
    torch.manual_seed(0)
    t0 = time.time()
    up = [torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    down = [torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    mb = (up[0].numel() + down[0].numel()) * 2 / 1e6

    def engine_mlp(
        x: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, r: torch.Tensor
    ) -> torch.Tensor:  # the engine's unfused MLP as torch.compile traces it
        fc, gate = F.linear(x, wu).chunk(2, dim=-1)
        return r + F.linear(F.silu(fc) * gate, wd)

    compiled = torch.compile(engine_mlp, fullgraph=True)
    for m in (64, 16):
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(m, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        want = engine_mlp(x, up[0], down[0], r).float()

        def run_base(i: int, x: torch.Tensor = x, r: torch.Tensor = r) -> torch.Tensor:
            return compiled(x, up[i % copies], down[i % copies], r)

        t_base = timed(run_base)
        t_up = timed(functools.partial(_linear_copy, x, up, copies))
        t_down = timed(functools.partial(_linear_copy, g, down, copies))
        print(
            f"{m} rows: compiled cuBLAS MLP {t_base:.1f} us a layer ({mb / t_base * 1e3:.0f} GB/s); its GEMMs "
            f"alone gate/up {t_up:.1f}, down {t_down:.1f}",
            flush=True,
        )
        best: dict[bool, tuple[int, int, int, int]] = {}
        for gated in (True, False):
            times: dict[tuple[int, int, int, int], float] = {}
            for tile in MLP_SWEEP:
                field = "rows_gemm_gated_tile" if gated else "rows_gemm_tile"
                tuning = with_tiles({field: tile})

                def run_gated(i: int, t: KernelTuning = tuning, x: torch.Tensor = x) -> torch.Tensor:
                    return rows_gemm(x, up[i % copies], gated=True, tuning=t)

                def run_down(
                    i: int, t: KernelTuning = tuning, g: torch.Tensor = g, r: torch.Tensor = r
                ) -> torch.Tensor:
                    return rows_gemm(g, down[i % copies], residual=r, tuning=t)

                run: Callable[[int], torch.Tensor] = run_gated if gated else run_down
                try:
                    run(0)
                except triton.runtime.errors.OutOfResources:
                    continue
                times[tile] = timed(run)
            top = sorted(times, key=lambda c: times[c])[:4]
            best[gated] = top[0]
            print(
                f"  rows_gemm {'gated gate/up' if gated else 'down + residual'}: "
                + "  ".join(f"{','.join(map(str, c))}: {times[c]:.1f}" for c in top),
                flush=True,
            )

        def fused_mlp(i: int, tuning: KernelTuning, x: torch.Tensor = x, r: torch.Tensor = r) -> torch.Tensor:
            h = rows_gemm(x, up[i % copies], gated=True, tuning=tuning)
            return rows_gemm(h, down[i % copies], residual=r, tuning=tuning)

        best_tuning = dataclasses.replace(DEFAULT_TUNING, rows_gemm_gated_tile=best[True], rows_gemm_tile=best[False])
        for label, tuning in (("best tiles", best_tuning), ("the engine's tiles", DEFAULT_TUNING)):
            err = ((fused_mlp(0, tuning).float() - want).abs().max() / want.abs().max()).item()
            t_fused = timed(functools.partial(fused_mlp, tuning=tuning))
            print(
                f"  two kernels, {label}: {t_fused:.1f} us a layer against {t_base:.1f} "
                f"({LAYERS * (t_base - t_fused):+.0f} us a step of {LAYERS} layers); max rel err {err:.1e}",
                flush=True,
            )
    print(f"probe {time.time() - t0:.0f} s")


# KernelTuning.rows_small_*_tile: BLOCK_M tokens, BLOCK_N outputs, BLOCK_K columns, warps, stages
LAYER_SWEEP = tuple(itertools.product((16, 32, 64), (16, 32, 64), (64, 128), (4,), (2, 3, 4, 5)))
# --wide-k: tiles that take a row's whole K (SmolLM2's 576; down's 1,536 in 2-6) in one or a few loads, as the
# single-token GEMV does (BLOCK_K 1024), instead of a pipelined loop of 64- or 128-column steps; the engine's
# tiles beside them for scale.
WIDE_K_SWEEP = tuple(itertools.product((16, 64), (16, 32), (256, 512, 1024), (4, 8), (1, 2)))
TILE_NAMES = {"rope": "rows_small_rope_tile", "gated": "rows_small_gated_tile", "plain": "rows_small_tile"}
LAYER_SHAPES = {"smollm2": (576, 1536, 9, 3, 64)}  # hidden, intermediate, heads, kv heads, head size


def layer(shape: str, tokens: int, wide_k: bool = False) -> None:
    """A small layer's four products as sequence_layer runs them, over a sweep of KernelTuning's
    rows_small_*_tile: the QKV product with its norm, rotary and cache write; the output product and its residual;
    the gated gate/up with its norm; down and its residual. cuBLAS's bare product of each for scale."""
    from pipeline.engine.kernels.rows import rows_gemm, rows_rope_store
    from pipeline.engine.model import Rotary

    hidden, inter, heads, kv_heads, head = LAYER_SHAPES[shape]
    torch.manual_seed(0)
    t0 = time.time()

    def randn(*shape_: int) -> torch.Tensor:
        return torch.randn(*shape_, device="cuda", dtype=torch.bfloat16)

    qkv_out = (heads + 2 * kv_heads) * head
    weights = {
        "rope": (qkv_out, hidden),
        "output": (hidden, heads * head),
        "gated": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    copies = {name: cold_copies(rows * cols * 2) for name, (rows, cols) in weights.items()}
    ws = {name: [randn(*shape_) * 0.02 for _ in range(copies[name])] for name, shape_ in weights.items()}
    x, r, g = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    att, h = randn(tokens, heads * head), randn(tokens, inter)
    rotary = Rotary(head, 1e4, None, 1024)
    cos, sin = rotary.cos.cuda(), rotary.sin.cuda()
    positions, slots = torch.arange(100, 100 + tokens, device="cuda"), torch.arange(100, 100 + tokens, device="cuda")
    k_cache, v_cache = (torch.zeros(1, 1, 1024, kv_heads, head, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runs: dict[str, tuple[Callable[[torch.Tensor, KernelTuning], object], str, torch.Tensor]] = {
        "rope": (
            lambda w, t: rows_rope_store(
                x, w, g, 1e-5, cos, sin, positions, slots, k_cache, v_cache, 0, heads, tuning=t
            ),
            "rope",
            x,
        ),
        "output": (lambda w, t: rows_gemm(att, w, residual=r, tuning=t), "plain", att),
        "gated": (lambda w, t: rows_gemm(x, w, gated=True, norm=g, eps=1e-5, tuning=t), "gated", x),
        "down": (lambda w, t: rows_gemm(h, w, residual=r, tuning=t), "plain", h),
    }
    best_sum = 0.0
    per_tile: dict[str, dict[tuple[int, ...], float]] = {}
    engine_tiles = {getattr(DEFAULT_TUNING, name) for name in TILE_NAMES.values()}
    sweep = (*sorted(engine_tiles), *WIDE_K_SWEEP) if wide_k else LAYER_SWEEP
    for name, (run, kind, inp) in runs.items():
        n_copies, reps = copies[name], max(REPS, copies[name])
        t_cublas = timed(functools.partial(_linear_copy, inp, ws[name], n_copies), reps)
        times: dict[tuple[int, ...], float] = {}
        for tile in sweep:
            tuning = with_tiles({TILE_NAMES[kind]: tile})
            try:
                run(ws[name][0], tuning)
            except triton.runtime.errors.OutOfResources:
                continue

            def run_tile(
                i: int,
                t: KernelTuning = tuning,
                run: Callable[[torch.Tensor, KernelTuning], object] = run,
                w: list[torch.Tensor] = ws[name],
                n: int = n_copies,
            ) -> object:
                return run(w[i % n], t)

            times[tile] = timed(run_tile, reps)
            per_tile.setdefault(kind, {}).setdefault(tile, 0.0)
            per_tile[kind][tile] += times[tile]
        top = sorted(times, key=lambda c: times[c])[:6]
        best_sum += times[top[0]]
        print(
            f"{name:<7} {weights[name]} x{n_copies} cuBLAS {t_cublas:5.1f} us; rows kernel: "
            + "  ".join(f"{','.join(map(str, c))}: {times[c]:.1f}" for c in top),
            flush=True,
        )
    best = {kind: min(tiles, key=tiles.__getitem__) for kind, tiles in per_tile.items()}
    for kind, tile in best.items():
        print(f"best {kind} tile over its products: {tile} {per_tile[kind][tile]:.1f} us")
    best_tuning = with_tiles({TILE_NAMES[kind]: tile for kind, tile in best.items()})
    print(f"as an eagle_step variant: {format_variant(best_tuning)}")
    print(f"{tokens} tokens: best tiles {best_sum:.1f} us a layer; probe {time.time() - t0:.0f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="check the kernel's sums (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--mlp", action="store_true", help="a tree step's MLP: cuBLAS and inductor against rows_gemm")
    ap.add_argument(
        "--layer",
        type=int,
        metavar="TOKENS",
        help="a small layer's products (--shape smollm2) over a "
        "sweep of KernelTuning.rows_small_*_tile, for TOKENS rows",
    )
    ap.add_argument(
        "--wide-k",
        action="store_true",
        help="with --layer: sweep tiles of 256-1,024 columns (WIDE_K_SWEEP) beside the engine's",
    )
    ap.add_argument(
        "--shape", default="llama3-8b", choices=sorted({*MLP_SHAPES, *LAYER_SHAPES}), help="the MLP's or layer's shape"
    )
    args = ap.parse_args()
    check() if args.check else layer(args.shape, args.layer, args.wide_k) if args.layer else mlp(
        args.shape
    ) if args.mlp else main()
