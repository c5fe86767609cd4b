"""The ranks of a tensor-parallel engine: one torch.distributed group of processes on one host.

Rank 0 is the calling process and runs the scheduler. It spawns every other rank (torch.multiprocessing,
spawn); each builds its own copy of the replicated objects (its model shard, its block pool, its step)
and then runs, in rank 0's order, every call rank 0 makes on them: `replicate` makes a method of rank 0's
object send (object name, method, host arguments) down each rank's pipe before running it locally, and
the collectives inside the call (all-reduce, all-gather) keep the ranks in step. Commands travel by pipe
rather than by collective so that an idle rank waits with no collective timeout, and exits when rank 0's
end of the pipe closes (rank 0 gone: no orphans).

Collectives run on gloo for CPU tensors and NCCL for CUDA ones (rank r on cuda:r). Only one group lives
in a process at a time (the default torch.distributed group).

Failure: a rank that exits (or raises, which makes it exit), or a collective that waits longer than
`ParallelConfig.timeout_s` for a rank that hangs, fails rank 0's call with RankFailure naming the rank
and the cause; rank 0 then stops every other rank (killing those that do not exit within the grace),
and every later call fails at once with the same error.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.errors import UserError

# A collective waiting this long for another rank fails the group. It must outlast the largest skew
# between ranks inside one step, first compilations included (each rank compiles its own graphs).
RANK_TIMEOUT_S = 300.0
# Spawning the ranks and loading their shards.
START_TIMEOUT_S = 900.0
# A rank asked to stop gets this long to exit before it is killed.
STOP_GRACE_S = 5.0
# How long rank 0 looks for a rank's exit after its call failed, to name the rank that died.
DEATH_NOTICE_S = 1.0
LOCALHOST = "127.0.0.1"
ANY_PORT = 0
STOP = None  # the command that ends a rank's loop

# (rank, world, device) -> (objects by name, a small picklable report for rank 0)
Build = Callable[[int, int, torch.device], tuple[dict[str, Any], dict[str, Any]]]


@dataclass(frozen=True)
class ParallelConfig:
    timeout_s: float = RANK_TIMEOUT_S
    start_timeout_s: float = START_TIMEOUT_S
    stop_grace_s: float = STOP_GRACE_S


class RankFailure(RuntimeError):
    """A rank died, hung or failed: the group is stopped and the engine cannot serve any more."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """cuda:r for rank r of a CUDA engine; the CPU for every rank of a CPU one."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def share_cores(device: torch.device, world: int) -> None:
    """CPU ranks split the host's cores: threads of two ranks on one core wait on each other's spinning."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


_live: RankGroup | None = None  # the group of this process, if one is running


def live() -> RankGroup | None:
    return _live


def shutdown() -> None:
    """Stop this process's group, if any (also run at exit)."""
    if _live is not None:
        _live.close()


atexit.register(shutdown)


class RankGroup:
    """Rank 0's side: the other ranks' processes and pipes, and the calls it replicates on them."""

    def __init__(self, world: int, device: torch.device, config: ParallelConfig, store: dist.TCPStore):
        self.world, self.device, self.config, self.store = world, device, config, store
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.lock = threading.Lock()  # one call at a time, in one order on every rank
        self.failure: str | None = None  # set once the group is stopped
        self.joined = False

    @classmethod
    def start(cls, world: int, device: torch.device, build: Build, config: ParallelConfig) -> RankGroup:
        """Spawn ranks 1..world-1, each running build(rank, world, its device); rank 0 builds its own meanwhile
        and then calls join()."""
        global _live
        if not dist.is_available():
            raise UserError("tensor parallel needs torch.distributed, which this PyTorch build lacks")
        if _live is not None or dist.is_initialized():
            raise UserError(
                "a tensor-parallel engine is already running in this process; stop it first "
                "(pipeline.engine.parallel.shutdown())"
            )
        timeout = datetime.timedelta(seconds=config.start_timeout_s)
        store = dist.TCPStore(LOCALHOST, ANY_PORT, world, is_master=True, timeout=timeout, wait_for_workers=False)
        group = cls(world, device, config, store)
        _live = group
        share_cores(device, world)
        context = mp.get_context("spawn")
        try:
            for rank in range(1, world):
                mine, theirs = context.Pipe()
                # Not a daemon: a daemonic process may not start its own (torch.compile's workers).
                proc = context.Process(
                    target=_rank_main,
                    args=(rank, world, rank_device(device, rank), store.port, build, config, theirs),
                    name=f"specpipe-rank{rank}",
                )
                proc.start()
                theirs.close()
                group.procs.append(proc)
                group.conns.append(mine)
        except BaseException:
            group.close()
            raise
        return group

    def join(self) -> list[dict[str, Any]]:
        """Wait until every rank has built its objects (their reports, rank 1 first), then form the group."""
        reports: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.config.start_timeout_s
        while len(reports) < self.world - 1:
            left = deadline - time.monotonic()
            waiting = {r: c for r, c in enumerate(self.conns, 1) if r not in reports}
            sentinels = {self.procs[r - 1].sentinel: r for r in waiting}
            ready = wait([*waiting.values(), *sentinels], timeout=max(left, 0.0))
            if not ready:
                self._stop(f"rank(s) {sorted(waiting)} did not load within {self.config.start_timeout_s:.0f} s")
                raise RankFailure(self.failure)
            for r, conn in waiting.items():
                if conn not in ready:
                    continue
                kind, payload = _receive(conn)
                if kind == "ready":
                    reports[r] = payload
                    continue
                proc = self.procs[r - 1]
                proc.join(DEATH_NOTICE_S)
                self._stop(f"rank {r} failed while loading: {payload or _exit_words(proc)}")
                # The rank's own error, re-raised here: a UserError (a bad shard, say) stays one.
                raise payload if isinstance(payload, BaseException) else RankFailure(self.failure)
            for sentinel, r in sentinels.items():
                if sentinel in ready and r not in reports:
                    self._stop(f"rank {r} {_exit_words(self.procs[r - 1])} while loading")
                    raise RankFailure(self.failure)
        _init_group(self.device, self.store, 0, self.world, self.config)
        self.joined = True
        return [reports[r] for r in range(1, self.world)]

    def replicate(self, obj: Any, name: str, methods: tuple[str, ...]) -> None:
        """Make each of obj's `methods` run on every rank (on the object each built under `name`), in call
        order, before it runs here. The object keeps its type; its other attributes stay rank 0's own."""
        for method in methods:
            setattr(obj, method, functools.partial(self.call, name, method, getattr(obj, method)))

    def call(self, name: str, method: str, local: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            if self.failure is not None:
                raise RankFailure(self.failure)
            try:
                for rank, conn in enumerate(self.conns, 1):
                    if not self.procs[rank - 1].is_alive():
                        raise RankFailure(f"rank {rank} {_exit_words(self.procs[rank - 1])}")
                    conn.send((name, method, args, kwargs))
                return local(*args, **kwargs)
            except Exception as exc:
                self._stop(f"{self._cause(exc)}, during {name}.{method}")
                raise RankFailure(self.failure) from exc

    def _cause(self, exc: Exception) -> str:
        """Which rank failed and how: a rank that exited (with its own error, if it sent one), else a hang."""
        deadline = time.monotonic() + DEATH_NOTICE_S
        while True:
            for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
                if not proc.is_alive():
                    sent = ""
                    if conn.poll():
                        kind, payload = _receive(conn)
                        sent = f": {payload}" if kind == "error" else ""
                    return f"tensor-parallel rank {rank} of {self.world} {_exit_words(proc)}{sent}"
            if time.monotonic() >= deadline:
                break
            time.sleep(DEATH_NOTICE_S / 10)
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return f"a tensor-parallel rank did not answer within {self.config.timeout_s:g} s ({_first_line(exc)})"
        return f"rank 0 of {self.world} failed: {type(exc).__name__}: {_first_line(exc)}"

    def _stop(self, why: str) -> None:
        """Record the failure, stop every other rank and leave the process free for another group."""
        global _live
        if self.failure is None:
            self.failure = f"{why}; the engine stopped its ranks and cannot serve: restart it"
        for conn in self.conns:
            try:
                conn.send(STOP)
            except (OSError, ValueError):
                pass  # that rank is gone already
        deadline = time.monotonic() + self.config.stop_grace_s
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()  # also ends a stopped (SIGSTOP) or hung rank
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns = []
        if dist.is_initialized():
            dist.destroy_process_group()
        if _live is self:
            _live = None

    def close(self) -> None:
        """Stop the ranks. Killing them first ends a call in flight on another thread (its collective fails)."""
        if self.failure is None:
            self.failure = "the engine was closed"
        if self.conns:
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
        with self.lock:
            if self.conns or _live is self:
                self._stop("the engine was closed")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]


def _init_group(device: torch.device, store: dist.Store, rank: int, world: int, config: ParallelConfig) -> None:
    """Join the default group (every rank already built: forming it is quick), then set the step timeout."""
    start = datetime.timedelta(seconds=config.start_timeout_s)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world, timeout=start)
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=config.timeout_s))


def _rank_main(
    rank: int, world: int, device: torch.device, port: int, build: Build, config: ParallelConfig, conn: Connection
) -> None:
    """A rank other than 0: build, report, then run rank 0's calls until it says stop or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops the others
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        share_cores(device, world)
        objects, report = build(rank, world, device)
        conn.send(("ready", report))
        timeout = datetime.timedelta(seconds=config.start_timeout_s)
        store = dist.TCPStore(LOCALHOST, port, world, is_master=False, timeout=timeout)
        _init_group(device, store, rank, world, config)
        with torch.inference_mode():
            while True:
                try:
                    command = conn.recv()
                except EOFError:  # rank 0 is gone
                    break
                if command is STOP:
                    break
                name, method, args, kwargs = command
                getattr(objects[name], method)(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this rank exits
        _send_error(conn, exc)
        os._exit(1)  # skip teardown that could wait on the other ranks
    if dist.is_initialized():
        dist.destroy_process_group()


def _send_error(conn: Connection, exc: BaseException) -> None:
    try:
        conn.send(("error", exc))
    except Exception:  # noqa: BLE001 - not picklable, or rank 0 gone: send the text if anything
        try:
            conn.send(("error", RankFailure("".join(traceback.format_exception_only(exc)).strip())))
        except (OSError, ValueError):
            pass


def _receive(conn: Connection) -> tuple[str, Any]:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return "gone", None


def _exit_words(proc: BaseProcess) -> str:
    code = proc.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
