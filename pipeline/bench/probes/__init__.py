"""Probes: focused GPU measurements and checks behind the engine's kernel and tree choices, each run as
`python -m pipeline.bench.probes.NAME` (see each module's docstring; BENCHMARKS.md cites their results).

- check_kernels: every Triton kernel against the unfused ops it replaces (also on CPU, under the interpreter).
- gemv: single-token products, cuBLAS against the GEMV kernel over its block sizes.
- tree_gemm: products of a tree's rows: cuBLAS, rows_gemm and its tiles (MLP, small layers).
- eagle_step: the EAGLE dynamic step on random weights, A/B by kernel tuning.
- invariance: the batch-invariant products against cuBLAS and the GEMV, and which routes are row invariant.
- catch_up: EAGLE's acceptance after runs of plain steps, its drafter's catch-up deferred or at every step.
"""
