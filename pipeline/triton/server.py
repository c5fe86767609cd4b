"""Start a real `tritonserver` on a model repository and stop it cleanly: `with TritonServer(repo) as server:`.
With `max_restarts`, a tritonserver that dies unasked is started again on the same ports (`specpipe serve`).

The binary is the one on PATH (NGC container) or else the one bundled in the nvidia-pytriton wheel,
which needs its library folder and the Python's on LD_LIBRARY_PATH, the venv first on PATH, and a
backend folder holding the Python backend with the stub built for the running Python version.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pipeline.errors import UserError

LOCALHOST = "127.0.0.1"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
# tritonserver waits this long for models to unload; the ensemble never reports unloaded, so keep it short.
EXIT_TIMEOUT_S = 5
POLL_INTERVAL_S = 0.25
# How often the watchdog looks for dead Python-backend stubs, and how long one model's reload may take.
WATCH_INTERVAL_S = 0.5
RELOAD_TIMEOUT_S = 300.0
STUB_BINARY = "triton_python_backend_stub"
LOG_TAIL_LINES = 40
SHM_DIR = Path("/dev/shm")
# Triton's Python backend names its shared-memory regions <prefix><n>; ours carry a per-server prefix.
SHM_PREFIX = "triton_python_backend_shm_region_specpipe"
# libevhtp, tritonserver's HTTP layer, parses an application/x-www-form-urlencoded body (curl -d's and
# urllib's default content type, whatever the body holds) into two stack arrays of the body's length on
# an HTTP worker thread: with glibc's default 8 MiB thread stacks a form body of a few MB kills the server
# with SIGSEGV before any model sees it, and 2.51 has no option that bounds the body. Thread stacks take
# their size from RLIMIT_STACK at exec, so the server gets this much (address space, touched only as used):
# form bodies up to about half of it parse; the preprocessing model then refuses the prompt by its bytes.
THREAD_STACK_BYTES = 256 * 1024 * 1024
MAX_FORM_BODY_BYTES = THREAD_STACK_BYTES // 2 - 1024 * 1024  # the two arrays plus the parser's own frames
# Restarts after tritonserver died unasked: `specpipe serve` allows MAX_RESTARTS crashes within any
# RESTART_WINDOW_S and gives up on the next one; a server that crashes now and then keeps being restarted.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
# How long a crashed server's leftovers (its stubs, its log pipe, its ports) may take to go away.
LEFTOVER_TIMEOUT_S = 30.0
BACKEND_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specpipe" / "triton_backends"
_instance_counter = itertools.count()


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def free_ports() -> Ports:
    return Ports(free_port(), free_port(), free_port())


def _pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "tritonserver is not on PATH and nvidia-pytriton is not installed; run `make setup` "
            "or use the NGC tritonserver container"
        )
    return Path(spec.submodule_search_locations[0])


def _check_numpy() -> None:
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise UserError(
            f"numpy {numpy.__version__} is installed; the bundled Python backend needs numpy < 2 "
            "(pip install 'numpy<2')"
        )


def bundled_backend_dir(pytriton: Path) -> Path:
    """A backend folder with the wheel's Python backend and the stub for this Python (built once, cached)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = pytriton / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise UserError(
            f"{stub.parent}: nvidia-pytriton ships no Python-backend stub for Python {version}; use Python 3.8-3.13"
        )
    dest = BACKEND_CACHE / f"py{version}"
    python_dir = dest / "python"
    if not (python_dir / stub.name).is_file():
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "python").mkdir(parents=True)
        for src in (pytriton / "tritonserver" / "backends" / "python").iterdir():
            if src.is_file():
                shutil.copy2(src, tmp / "python" / src.name)
        shutil.copy2(stub, tmp / "python" / stub.name)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def server_command(repo: Path, ports: Ports, shm_prefix: str, log_verbose: int) -> tuple[list[str], dict[str, str]]:
    """The tritonserver command line and its environment."""
    env = dict(os.environ)
    args = [
        f"--model-repository={repo}",
        f"--http-address={LOCALHOST}",
        f"--grpc-address={LOCALHOST}",
        f"--metrics-address={LOCALHOST}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        f"--log-verbose={log_verbose}",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        # Explicit control, every model loaded at start: the watchdog can reload a model whose stub died.
        "--model-control-mode=explicit",
        "--load-model=*",
        # Our configs are complete; auto-complete would start one more Python stub per model.
        "--disable-auto-complete-config",
    ]
    on_path = shutil.which("tritonserver")
    if on_path:
        return [on_path, *args], env
    _check_numpy()
    pytriton = _pytriton_dir()
    libs = [str(pytriton.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    binary = pytriton / "tritonserver" / "bin" / "tritonserver"
    return [str(binary), *args, f"--backend-directory={bundled_backend_dir(pytriton)}"], env


def describe_exit(code: int) -> str:
    """A Popen return code in words: "exit code 1", "signal SIGKILL"."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def group_members(pgid: int) -> list[int]:
    """Living (not zombie) processes of process group pgid."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # After comm's ')': state ppid pgrp ...
            state, _, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # the process ended while we looked
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((LOCALHOST, port)) == 0


def python_stubs(server_pid: int) -> dict[int, str]:
    """{pid: model name} of the server's living Python-backend stubs (zombies left out). A stub's first
    argument is its model file, <repo>/<model>/<version>/model.py."""
    stubs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after its ')'.
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) != server_pid or state == "Z":
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # the process ended while we looked
        if len(argv) > 1 and argv[0].endswith(STUB_BINARY.encode()):
            stubs[int(entry.name)] = Path(argv[1].decode()).parent.parent.name
    return stubs


class StubWatchdog(threading.Thread):
    """Reloads a model whose Python-backend stub died (killed, out of memory, a crash in native code).

    tritonserver 2.51 never restarts such a stub: every later request fails with "Stub process ... is not
    healthy" while health and readiness still answer 200. The watchdog unloads the model, so that it and
    the server report not ready, then loads it again (a new stub) and logs both steps. Requests that were
    inside the dead stub get no answer from Triton; clients need a deadline for those.
    """

    def __init__(self, server: TritonServer):
        super().__init__(daemon=True, name="stub-watchdog")
        self.server = server
        self.stopping = threading.Event()
        self.reloads: list[str] = []  # models reloaded, in order (tests read it)
        assert server.process is not None, "the watchdog starts after the server process"
        # Every model's stubs as the server came up ready, taken now: a stub that dies before the first
        # look would otherwise never be known, and its model never reloaded.
        self.known = python_stubs(server.process.pid)

    def run(self) -> None:
        process = self.server.process
        assert process is not None, "the watchdog starts after the server process"
        known = self.known
        while not self.stopping.wait(WATCH_INTERVAL_S):
            if process.poll() is not None:
                return
            alive = python_stubs(process.pid)
            dead = {model for pid, model in known.items() if pid not in alive}
            for model in sorted(dead):
                if self.stopping.is_set():
                    return
                self.server.note(f"the Python-backend stub of model {model!r} died; reloading {model!r}")
                try:
                    self.server.reload(model)
                except (UserError, OSError) as exc:
                    self.server.note(f"reloading {model!r} failed: {exc}")
                    continue
                self.reloads.append(model)
                self.server.note(f"model {model!r} is loaded again")
            known = python_stubs(process.pid) if dead else alive


def _raise_stack_limit() -> None:
    """In the child before exec: thread stacks of THREAD_STACK_BYTES (see there), or the hard limit if lower."""
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    size = THREAD_STACK_BYTES if hard == resource.RLIM_INFINITY else min(THREAD_STACK_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_STACK, (size, hard))


class TritonServer:
    """A running tritonserver; logs go to `log` (stderr by default), the last lines are kept for errors."""

    def __init__(
        self,
        repo: str | Path,
        ports: Ports | None = None,
        log: TextIO | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        log_verbose: int = 0,
        max_restarts: int = 0,
        restart_window_s: float = RESTART_WINDOW_S,
    ):
        """max_restarts: how many unasked exits of tritonserver within restart_window_s are answered with a
        restart on the same ports (0: none, the process just ends; wait() returns its code)."""
        self.repo = Path(repo).resolve()
        if not (self.repo.is_dir() and any(self.repo.glob("*/config.pbtxt"))):
            raise UserError(
                f"{repo}: not a Triton model repository (no */config.pbtxt); generate one with `specpipe triton-repo`"
            )
        self.ports = ports or Ports()
        self.log = log or sys.stderr
        self.ready_timeout_s = ready_timeout_s
        self.log_verbose = log_verbose
        self.shm_prefix = f"{SHM_PREFIX}{os.getpid()}_{next(_instance_counter)}_"
        self.process: subprocess.Popen[str] | None = None
        self.log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._log_thread: threading.Thread | None = None
        self.watchdog: StubWatchdog | None = None
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.crashes: list[float] = []  # monotonic times of unasked exits (tests read it)
        self.failure: str | None = None  # why the restarts were given up, once they were
        self._stopping = threading.Event()
        self._launch_lock = threading.Lock()  # a stop() never misses a process being started
        self._supervisor: threading.Thread | None = None

    @property
    def http_url(self) -> str:
        return f"{LOCALHOST}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{LOCALHOST}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOCALHOST}:{self.ports.metrics}/metrics"

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def _ports(self) -> tuple[int, int, int]:
        return (self.ports.http, self.ports.grpc, self.ports.metrics)

    def start(self) -> None:
        for port in self._ports:
            if _port_in_use(port):
                raise UserError(
                    f"port {port} on {LOCALHOST} is in use; stop that server or choose other "
                    "--http-port/--grpc-port/--metrics-port"
                )
        try:
            self._launch()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self._start_watchdog()
        if self.max_restarts > 0:
            self._supervisor = threading.Thread(target=self._supervise, daemon=True, name="tritonserver-supervisor")
            self._supervisor.start()

    def _launch(self) -> None:
        """Start a tritonserver process and the thread that forwards its log (not waiting for it to be ready)."""
        cmd, env = server_command(self.repo, self.ports, self.shm_prefix, self.log_verbose)
        with self._launch_lock:
            if self._stopping.is_set():
                raise UserError("the server is stopping")
            # A new session, so that stopping the server also stops its Python-backend stub processes.
            self.process = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
                preexec_fn=_raise_stack_limit,
            )
        self._log_thread = threading.Thread(target=self._forward_logs, args=(self.process,), daemon=True)
        self._log_thread.start()

    def _start_watchdog(self) -> None:
        self.watchdog = StubWatchdog(self)
        self.watchdog.start()

    def _supervise(self) -> None:
        """Restart tritonserver whenever it exits unasked, until more than max_restarts crashes fall within
        restart_window_s; then record `failure` and end (wait() returns)."""
        while True:
            process = self._started()
            code = process.wait()
            if self._stopping.is_set():
                return
            self._clean_up_after(process)
            now = time.monotonic()
            self.crashes.append(now)
            recent = [t for t in self.crashes if now - t <= self.restart_window_s]
            self.note(
                f"tritonserver (pid {process.pid}) exited unasked with {describe_exit(code)} "
                f"({len(recent)} crash(es) in the last {self.restart_window_s:.0f} s); "
                f"its last log lines: {self.tail_text()}"
            )
            if len(recent) > self.max_restarts:
                self.failure = (
                    f"tritonserver crashed {len(recent)} times within {self.restart_window_s:.0f} s, more than "
                    f"the {self.max_restarts} restarts allowed; giving up (last: {describe_exit(code)}; "
                    f"its log: {self._log_name()})"
                )
                return
            self.note(f"restarting tritonserver on {self.http_url} (HTTP), {self.grpc_url} (gRPC)")
            busy = self._wait_ports_free()
            if busy:
                self.failure = (
                    f"port(s) {busy} on {LOCALHOST} were still in use {LEFTOVER_TIMEOUT_S:.0f} s after tritonserver "
                    f"crashed; giving up (its log: {self._log_name()})"
                )
                return
            self.log_tail.clear()  # the next crash's tail is the next run's
            try:
                self._launch()
                self._wait_ready()
            except (UserError, OSError):
                if self._stopping.is_set():
                    return
                # Exited while loading, or not ready in time (killed here): the loop counts it as the next crash.
                if self._started().poll() is None:
                    self.note(f"the restarted tritonserver was not ready within {self.ready_timeout_s:.0f} s")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._started().pid, signal.SIGKILL)
                continue
            self._start_watchdog()
            self.note(f"tritonserver is ready again (pid {self._started().pid})")

    def _clean_up_after(self, process: subprocess.Popen[str]) -> None:
        """After tritonserver died: kill its stubs, read the rest of its log, remove its shared memory."""
        deadline = time.monotonic() + LEFTOVER_TIMEOUT_S
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        while group_members(process.pid) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        if self._log_thread is not None:
            # The stubs held the log pipe open too; with them gone it ends.
            self._log_thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.remove_shm()

    def _wait_ports_free(self) -> list[int]:
        """Wait up to LEFTOVER_TIMEOUT_S for the server's ports to be free; those still in use."""
        deadline = time.monotonic() + LEFTOVER_TIMEOUT_S
        while (busy := [port for port in self._ports if _port_in_use(port)]) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        return busy

    def _log_name(self) -> str:
        """Where the server log goes: its file, or stderr."""
        name = getattr(self.log, "name", None)
        return name if isinstance(name, str) and not name.startswith("<") else "stderr, above"

    def note(self, message: str) -> None:
        """A line of the launcher's own in the server log."""
        self.log_tail.append(message)
        self.log.write(f"[specpipe] {message}\n")
        self.log.flush()

    def _post(self, path: str, timeout_s: float) -> None:
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                pass
        except urllib.error.HTTPError as exc:
            raise UserError(f"POST {path}: {exc.code} {exc.read().decode(errors='replace')}") from None

    def reload(self, model: str) -> None:
        """Unload then load one model through the repository API (not ready in between)."""
        self._post(f"/v2/repository/models/{model}/unload", RELOAD_TIMEOUT_S)
        self._post(f"/v2/repository/models/{model}/load", RELOAD_TIMEOUT_S)

    def _started(self) -> subprocess.Popen[str]:
        """The server process, which start() sets before anything that calls this runs."""
        assert self.process is not None, "the server was not started"
        return self.process

    def _forward_logs(self, process: subprocess.Popen[str]) -> None:
        stdout = process.stdout
        assert stdout is not None  # started with stdout=PIPE
        for line in stdout:
            self.log_tail.append(line.rstrip())
            self.log.write(f"[tritonserver] {line}")
            self.log.flush()

    def tail_text(self) -> str:
        """The last log lines on one line, runs of blanks (Triton's padded tables) squeezed."""
        return " | ".join(" ".join(line.split()) for line in self.log_tail if line.strip())[-2000:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        process = self._started()
        while time.monotonic() < deadline:
            if process.poll() is not None:
                time.sleep(POLL_INTERVAL_S)  # let the log thread catch the last lines
                raise UserError(
                    f"tritonserver exited with code {process.returncode} while loading {self.repo}; "
                    f"its last log lines: {self.tail_text()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=POLL_INTERVAL_S * 4) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(POLL_INTERVAL_S)
        raise UserError(
            f"tritonserver was not ready after {self.ready_timeout_s:.0f} s on {self.repo}; "
            f"its last log lines: {self.tail_text()}"
        )

    def wait(self) -> int:
        """Block until tritonserver has ended for good; its exit code. With restarts, that is after they were
        given up (`failure` says why; never 0 then) or after stop()."""
        if self._supervisor is None:
            return self._started().wait()
        while self._supervisor.is_alive():
            self._supervisor.join(POLL_INTERVAL_S)  # in steps, so that Ctrl-C gets through
        code = self._started().wait()
        return (code or 1) if self.failure else code

    def stop(self) -> None:
        self._stopping.set()
        if self.watchdog is not None:
            self.watchdog.stopping.set()
        with self._launch_lock:
            process = self.process  # none starts after this: _launch checks _stopping under the lock
        if process is not None and process.poll() is None:
            # tritonserver alone: it finalizes its stubs itself.
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        if process is not None:
            # Stubs still running after tritonserver ended (it gave up on an unload) would outlive it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=STOP_TIMEOUT_S)
        if self._log_thread is not None:
            self._log_thread.join(timeout=STOP_TIMEOUT_S)
        self.remove_shm()

    def remove_shm(self) -> list[Path]:
        """Remove this server's Python-backend shared-memory regions (left behind if it was killed)."""
        regions = sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))
        for region in regions:
            region.unlink(missing_ok=True)
        return regions
