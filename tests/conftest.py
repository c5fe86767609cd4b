"""Shared fixtures: tiny random models (fast) and SmolLM2 (loaded once per session, tests marked slow)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.builder.build import BuildOptions, build_engine
from pipeline.convert.convert import DraftInputs, convert
from pipeline.convert.source import TargetSource, load_hf_model, load_target
from pipeline.convert.tiny import make_tiny_model


def convert_and_build(
    target: str | Path | TargetSource,
    out_root: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "float32",
    medusa: str | Path | None = None,
    eagle: str | Path | None = None,
    eagle3: str | Path | None = None,
    draft_model: str | Path | None = None,
    backend: str = "portable",
    **build_flags: Any,
) -> Path:
    """Convert (in-process, like `specpipe convert`) into out_root/ckpt and build out_root/engine.

    build_flags are BuildOptions fields (max_draft_len, choices, dynamic_tree, speculative="ngram", ...);
    convert-only numbers go in as num_medusa_heads / num_eagle_layers / max_non_leaves_per_layer.
    """
    out_root = Path(out_root)
    convert_keys = ("num_medusa_heads", "num_eagle_layers")
    conv = {k: build_flags.pop(k) for k in convert_keys if k in build_flags}
    drafts = DraftInputs(
        medusa=_str(medusa),
        eagle=_str(eagle),
        eagle3=_str(eagle3),
        draft_model=_str(draft_model),
        max_draft_len=build_flags.get("max_draft_len"),
        max_non_leaves_per_layer=build_flags.get("max_non_leaves_per_layer"),
        **conv,
    )
    ckpt = convert(target, out_root / "ckpt", dtype=dtype, tp=tp, pp=pp, drafts=drafts)
    return build_engine(ckpt, out_root / "engine", backend, BuildOptions(**build_flags))


def stream_by_run_ahead(
    engine: Any, ids: list[int], requests: list[Any], aheads: tuple[int, ...]
) -> tuple[dict[tuple[int, int], tuple], dict[int, int]]:
    """Each request streamed at each run_ahead (restored to 1 after): (tokens, finish reason, steps)
    by (ahead, request index), and the largest chunk seen at each ahead. Checks that the chunks add
    up to the final result."""
    seen, biggest = {}, {}
    try:
        for ahead in aheads:
            engine.run_ahead = ahead
            for i, params in enumerate(requests):
                chunks = list(engine.stream(ids, params))
                result = chunks[-1].result
                assert [t for c in chunks for t in c.token_ids] == result.token_ids
                seen[ahead, i] = (result.token_ids, result.finish_reason, result.stats.steps)
                biggest[ahead] = max(biggest.get(ahead, 0), *(len(c.token_ids) for c in chunks))
    finally:
        engine.run_ahead = 1
    return seen, biggest


def _str(p: str | Path | None) -> str | None:
    return None if p is None else str(p)


# The clients' wait for a response in tests: a request that Triton 2.51 never answers (its BLS stub died under
# it; upstream server#8882) fails its test in minutes rather than the 10 a user's client waits.
TEST_REQUEST_TIMEOUT_S = 180.0


@pytest.fixture(scope="session", autouse=True)
def _request_timeout() -> Iterator[None]:
    from pipeline.client import client  # here: the GPU check scripts import this file without tritonclient

    saved, client.REQUEST_TIMEOUT_S = client.REQUEST_TIMEOUT_S, TEST_REQUEST_TIMEOUT_S
    yield
    client.REQUEST_TIMEOUT_S = saved


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def smollm2_source() -> TargetSource:
    return load_target("smollm2")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_source: TargetSource) -> Any:
    return load_hf_model(smollm2_source)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_source: TargetSource, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(smollm2_source, tmp_path_factory.mktemp("smollm2") / "ckpt")


@pytest.fixture(scope="session")
def smollm2_engine_dir(smollm2_checkpoint: Path) -> Path:
    return build_engine(smollm2_checkpoint, smollm2_checkpoint.parent / "engine")
