#!/usr/bin/env python3
"""tests/test_fused.py's kernel CHECK on a CUDA device, without pytest (the GPU image has none): every
Triton kernel of the engine against the unfused ops it replaces. Prints "kernels ok" or fails.

  python3 build/check_kernels.py
  TRITON_INTERPRET=1 python3 build/check_kernels.py cpu   # what `make test` runs, on CPU tensors
"""
import ast
import os
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
tree = ast.parse((ROOT / "tests" / "test_fused.py").read_text())
check = next(node.value.args[0].value for node in tree.body
             if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CHECK")
os.environ["CHECK_DEVICE"] = sys.argv[1] if len(sys.argv) > 1 else "cuda"
exec(compile(textwrap.dedent(check), "tests/test_fused.py:CHECK", "exec"), {})
