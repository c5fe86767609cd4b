"""A server under test as a subprocess: its own process group, its log in a file, ready once
GET /v1/models answers, stopped by a signal to the whole group (so children such as tritonserver or
vLLM's engine core stop too)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import requests

POLL_S = 1.0


def launch(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(
    proc: subprocess.Popen,
    base_url: str,
    timeout_s: float,
    exited: Callable[[], Exception],
    timed_out: Callable[[], Exception],
) -> None:
    """Poll until the OpenAI API answers; raise `exited()` if the process dies, `timed_out()` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise exited()
        try:
            if requests.get(f"{base_url}/v1/models", timeout=POLL_S).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(POLL_S)
    raise timed_out()


def stop(proc: subprocess.Popen | None, sig: signal.Signals, grace_s: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, sig)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start(
    cmd: list[str],
    log_path: Path,
    base_url: str,
    timeout_s: float,
    exited: Callable[[subprocess.Popen], Exception],
    timed_out: Callable[[], Exception],
    stop_signal: signal.Signals,
    grace_s: float,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """launch + wait_ready; a server that fails to come up is stopped before the error propagates."""
    proc = launch(cmd, log_path, env)
    try:
        wait_ready(proc, base_url, timeout_s, lambda: exited(proc), timed_out)
    except BaseException:
        stop(proc, stop_signal, grace_s)
        raise
    return proc
