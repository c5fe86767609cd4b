"""Batched speculation on CUDA (captured graphs, steps queued ahead of the host's reads) against plain greedy.

The CPU tests run the same scheduler eagerly; this runs it where steps are graphs replayed ahead of the
host's reads: every batched method's output, in every tier and at batch sizes 1, 3 and 5, must equal the
plain engine's, in float32 on tiny random models. On a GPU: `python tests/batched_cuda_check.py [cuda|cpu]`
(SPECPIPE_COMPILE=0 skips compilation). Prints one line a method and "ok" when all match.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # conftest, the CPU tests' cases
sys.path.insert(0, str(Path(__file__).parent.parent))  # the pipeline package, when run from anywhere

from conftest import convert_and_build  # noqa: E402
from test_batched_speculation import CASES, mixed_requests, run_together, vocab_of  # noqa: E402

from pipeline.convert.tiny import make_tiny_model  # noqa: E402
from pipeline.engine.loader import open_engine

BATCHES = (1, 3, 5)
DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def main() -> None:
    root = Path(tempfile.mkdtemp())
    target = make_tiny_model(root / "llama", arch="llama", seed=0)
    plain = open_engine(convert_and_build(target, root / "plain"), device=DEVICE)
    requests = mixed_requests(plain)
    want = [plain.generate(ids, params).token_ids for ids, params in requests]
    failed = []
    for case, make in sorted(CASES.items()):
        start = time.time()
        engine = open_engine(convert_and_build(target, root / case, **make(root, vocab_of(target))), device=DEVICE)
        controller = engine.scheduler.controller
        assert controller is not None
        bad = []
        for policy in ["adaptive", *controller.names]:
            controller.config = replace(controller.config, policy=policy)
            for batch in BATCHES:
                if run_together(engine, requests[:batch]) != want[:batch]:
                    bad.append(f"{policy}@{batch}")
        print(f"{case}: {'ok' if not bad else 'MISMATCH ' + ' '.join(bad)} ({time.time() - start:.0f} s)", flush=True)
        failed += bad
    print("ok" if not failed else f"FAILED: {len(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
