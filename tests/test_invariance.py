"""Batch invariance of the products and norms: tests/invariance_check.py under Triton's interpreter on CPU tensors
(in a process of its own: TRITON_INTERPRET must be set before the kernels are defined)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INVARIANCE_CHECK = Path(__file__).with_name("invariance_check.py")
TIMEOUT_S = 600


def test_rows_of_a_batch_equal_their_one_row_products_and_norms_bitwise():
    """invariant_linear and invariant_rms_norm: row r of a B-row call (B in 1, 2, 7, 64) is the 1-row call's
    bits, in float32 and bf16, with and without bias, K split or not; close to F.linear and RMSNorm; attach
    routes a model's Linear layers and norms to them and back."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(INVARIANCE_CHECK)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok" in done.stdout
