"""Soak test: minutes of mixed traffic through a real tritonserver, then what was answered, what failed and how
the server's memory moved. `python -m pipeline.bench.soak --repo triton_repo --minutes 10 --concurrency 16`.

Each of `concurrency` client threads loops until the time is up, choosing per request: a normal request
(gRPC, ensemble or BLS, alternately), a stream to the BLS model cancelled after its first chunks, or a bad
request over HTTP that must be refused with 400. Reported as JSON (and written under bench/): requests per
kind, errors by kind (expected refusals apart from unexpected errors), latency percentiles of the normal
requests, and the RSS of tritonserver and each of its Python-backend stubs at start and end.
"""

from __future__ import annotations

import argparse
import collections
import json
import queue
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import numpy as np
import requests
import tritonclient.grpc as grpcclient

from pipeline.client.client import (
    BLS,
    ENSEMBLE,
    Sampling,
    TritonRequestError,
    _grpc_input,
    close_stream,
    generate,
    text_inputs,
)
from pipeline.triton.server import TritonServer, free_ports, python_stubs

RSS_EVERY_S = 60.0
PROMPTS = ("The quick brown fox", "Tell me about Paris.", "def add(a, b):", "Once upon a time there was")
NORMAL_MAX_TOKENS = 16
CANCELLED_MAX_TOKENS = 256
CHUNKS_BEFORE_CANCEL = 2
# Share of each kind of request; the rest are normal.
CANCELLED_SHARE, BAD_SHARE = 0.15, 0.15
BAD_BODIES = (
    {"max_tokens": 4},  # no text_input
    {"text_input": "hi", "max_tokens": 4, "tempreature": 0.5},  # unknown input
    {"text_input": "hi", "max_tokens": 4, "temperature": -1},  # bad value
    {"text_input": "hi", "max_tokens": 4, "end_id": 10**7},  # id outside the vocabulary
    {"text_input": "hello " * 200_000, "max_tokens": 4},  # 1.2 MB prompt
)
PROGRESS_EVERY_S = 10.0
REQUEST_TIMEOUT_S = 300.0
PERCENTILES = (50, 90, 99)


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: collections.Counter = field(default_factory=collections.Counter)
    answered: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)  # "kind: first words"
    latencies_s: list[float] = field(default_factory=list)

    def add(self, kind: str, ok: bool, error: str = "", latency_s: float | None = None) -> None:
        with self.lock:
            self.sent[kind] += 1
            if ok:
                self.answered[kind] += 1
            else:
                self.errors[f"{kind}: {error[:80]}"] += 1
            if latency_s is not None:
                self.latencies_s.append(latency_s)


def rss_bytes(pid: int) -> int:
    """VmRSS of a process; 0 once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def server_rss(server_pid: int) -> dict[str, int]:
    """RSS of tritonserver and of each Python-backend stub, by model name."""
    out = {"tritonserver": rss_bytes(server_pid)}
    for pid, model in python_stubs(server_pid).items():
        out[f"stub {model}"] = rss_bytes(pid)
    return out


def normal(server: TritonServer, tally: Tally, rng: random.Random, turn: int) -> None:
    model = ENSEMBLE if turn % 2 else BLS
    start = time.monotonic()
    try:
        generate(server.grpc_url, rng.choice(PROMPTS), Sampling(max_tokens=NORMAL_MAX_TOKENS), model=model)
        tally.add("normal", True, latency_s=time.monotonic() - start)
    except TritonRequestError as exc:
        tally.add("normal", False, str(exc))


def cancelled(server: TritonServer, tally: Tally, rng: random.Random) -> None:
    inputs = text_inputs(rng.choice(PROMPTS), Sampling(max_tokens=CANCELLED_MAX_TOKENS, end_id=-1), stream=True)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(BLS, [_grpc_input(k, v) for k, v in inputs.items()], request_id=uuid.uuid4().hex)
        for _ in range(CHUNKS_BEFORE_CANCEL):
            _, error = responses.get(timeout=REQUEST_TIMEOUT_S)
            if error is not None:
                tally.add("cancelled", False, str(error))
                return
        tally.add("cancelled", True)
    except queue.Empty:
        tally.add("cancelled", False, "no chunk in time")
    finally:
        close_stream(client, cancel=True)


def bad(server: TritonServer, tally: Tally, rng: random.Random) -> None:
    body = rng.choice(BAD_BODIES)
    reply = requests.post(
        f"http://{server.http_url}/v2/models/{rng.choice((ENSEMBLE, BLS))}/generate",
        data=json.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=REQUEST_TIMEOUT_S,
    )
    if reply.status_code == 400:
        tally.add("bad (refused with 400)", True)
    else:
        tally.add("bad (refused with 400)", False, f"HTTP {reply.status_code} {reply.text}")


def client_loop(server: TritonServer, tally: Tally, seed: int, deadline: float) -> None:
    rng = random.Random(seed)
    turn = 0
    while time.monotonic() < deadline:
        turn += 1
        draw = rng.random()
        try:
            if draw < CANCELLED_SHARE:
                cancelled(server, tally, rng)
            elif draw < CANCELLED_SHARE + BAD_SHARE:
                bad(server, tally, rng)
            else:
                normal(server, tally, rng, turn)
        except Exception as exc:  # counted, so that one odd failure does not end the run
            tally.add("client", False, f"{type(exc).__name__}: {exc}")


def soak(server: TritonServer, minutes: float, concurrency: int) -> dict:
    process, watchdog = server.process, server.watchdog
    assert process is not None and watchdog is not None, "soak needs a started server"
    rss_start = server_rss(process.pid)
    tally = Tally()
    start = time.monotonic()
    deadline = start + minutes * 60
    threads = [
        threading.Thread(target=client_loop, args=(server, tally, i, deadline), daemon=True) for i in range(concurrency)
    ]
    for t in threads:
        t.start()
    rss_timeline = []  # (seconds, RSS per process) every RSS_EVERY_S: warm-up levels off, a leak keeps growing
    next_rss = start + RSS_EVERY_S
    died_at = None  # seconds into the soak when tritonserver exited: the clients' requests then hang
    while any(t.is_alive() for t in threads):
        time.sleep(PROGRESS_EVERY_S)
        if process.poll() is not None:
            died_at = round(time.monotonic() - start)
            print(f"soak {died_at:6d} s: tritonserver exited with {process.returncode}; stopping", flush=True)
            break
        if time.monotonic() >= next_rss:
            rss_timeline.append((round(time.monotonic() - start), server_rss(process.pid)))
            next_rss += RSS_EVERY_S
        with tally.lock:
            print(
                f"soak {time.monotonic() - start:6.0f} s: sent {sum(tally.sent.values())}, "
                f"answered {sum(tally.answered.values())}, errors {sum(tally.errors.values())}",
                flush=True,
            )
    if died_at is None:
        for t in threads:
            t.join()
    latencies = np.array(tally.latencies_s or [0.0])
    rss_end = server_rss(process.pid)
    with tally.lock:  # a dead server's clients are still waiting: copy what they counted so far
        sent, answered, errors = dict(tally.sent), dict(tally.answered), dict(tally.errors)
    return {
        "minutes": minutes,
        "concurrency": concurrency,
        "seconds": time.monotonic() - start,
        "sent": sent,
        "answered": answered,
        "errors": errors,
        "normal_latency_s": {f"p{p}": float(np.percentile(latencies, p)) for p in PERCENTILES},
        "rss_start_bytes": rss_start,
        "rss_end_bytes": rss_end,
        "rss_growth": {k: rss_end.get(k, 0) / v - 1 for k, v in rss_start.items() if v},
        # From the first sample (a minute in, past warm-up) to the end: the figure the < 5 % goal is about.
        "rss_growth_after_first_minute": (
            {k: rss_end.get(k, 0) / v - 1 for k, v in rss_timeline[0][1].items() if v} if rss_timeline else {}
        ),
        "rss_timeline": [{"seconds": t, "rss_bytes": rss} for t, rss in rss_timeline],
        "server_alive": process.poll() is None,
        "server_died_at_s": died_at,
        "stub_reloads": watchdog.reloads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default="triton_repo", help="model repository (a server is started on it)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON report (default bench/soak-<date>-c<concurrency>.json)"
    )
    args = parser.parse_args(argv)
    output = args.output or Path("bench") / f"soak-{date.today().isoformat()}-c{args.concurrency}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    with TritonServer(args.repo, free_ports(), log=open(output.with_suffix(".log"), "w")) as server:
        report = soak(server, args.minutes, args.concurrency)
    output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"wrote {output}", file=sys.stderr)
    return 0 if report["server_died_at_s"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
