"""Our engine behind Triton and the OpenAI front, started the way a user does: `specpipe triton-repo`
then `specpipe serve --openai-port`, as a subprocess so its cores are free once it stops."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.bench import process
from pipeline.errors import UserError
from pipeline.triton.server import Ports, free_ports

HOST = "127.0.0.1"
STOP_GRACE_S = 60.0
STOP_SIGNAL = signal.SIGTERM  # `specpipe serve` stops tritonserver on SIGTERM


@dataclass
class OurServer:
    """`with OurServer(engine, ...) as s:` serves the OpenAI API at s.base_url."""

    engine_dir: Path
    repo_dir: Path
    openai_port: int
    log_path: Path
    served_name: str
    max_batch_size: int | None = None  # rows the engine batches (serving option); None: the engine's
    startup_timeout_s: float = 600.0
    proc: subprocess.Popen | None = field(default=None, init=False)
    ports: Ports = field(default_factory=free_ports)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.openai_port}"

    def _specpipe(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "pipeline", *args]

    def __enter__(self) -> OurServer:
        batch = ["--max-batch-size", str(self.max_batch_size)] if self.max_batch_size else []
        subprocess.run(
            self._specpipe("triton-repo", "--engine", str(self.engine_dir), "--output", str(self.repo_dir), *batch),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        cmd = self._specpipe(
            "serve",
            "--repo",
            str(self.repo_dir),
            "--openai-port",
            str(self.openai_port),
            "--served-model-name",
            self.served_name,
            "--http-port",
            str(self.ports.http),
            "--grpc-port",
            str(self.ports.grpc),
            "--metrics-port",
            str(self.ports.metrics),
        )
        self.proc = process.start(
            cmd,
            self.log_path,
            self.base_url,
            self.startup_timeout_s,
            self._exited,
            self._timed_out,
            STOP_SIGNAL,
            STOP_GRACE_S,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _exited(self, proc: subprocess.Popen) -> Exception:
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return UserError(f"specpipe serve exited with code {proc.returncode}: {tail[0]} (log {self.log_path})")

    def _timed_out(self) -> Exception:
        return UserError(f"our server not ready after {self.startup_timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        process.stop(self.proc, STOP_SIGNAL, STOP_GRACE_S)
