"""Our Triton kernels for CUDA steps, by family, and the routing that puts a model's work on them.

- routing.py: attach() (which modules use which kernels, from SPECPIPE_KERNELS), the fused decoder layer,
  and the drafters' top-k route (drafter_kernels, from SPECPIPE_DRAFT_TOPK). Imports no Triton.
- tuning.py: KernelTuning, every block size, tile and routing flag in one frozen dataclass.
- gemv.py: single-token products, with the norm, SiLU-and-multiply, the residual add or rotary inside.
- rows.py: products of 2-64 rows on tensor cores, with the same prologues and epilogues.
- rotary.py: rotary embedding and the cache write (rope_store), and their helpers for the epilogues.
- attention.py: slot attention of one or several tokens (split kernels and their merge).
- topk.py: a drafter's LM head + log-softmax + top-k (lm_head_topk) and the small top-k (row_topk).
- invariant.py: batch-invariant products and RMS norm (every row's sums in one order for any row count).
"""
