"""Responses sent from the Python backend's request threads, one at a time.

The backend's response path is not safe under concurrent sends from several threads (seen: boost
lock_exception and a segfault in libtriton_python with 4 streams), so sends take one lock. A send can also
block for good: a response to a request of a BLS stub that died is never acknowledged by the server (seen in
a soak), and its thread holds the lock forever, so every other request's responses waited behind it and the
server stopped answering on every route. A waiting sender that sees the lock's holder in its send for over
STUCK_SEND_S takes it for stuck, leaves that lock to it and sends under a new one (again if that one's holder
gets stuck too); the other sends stay serialized. It judges by the holder's time, not its own wait: under
many streams a waiter can lose the lock to others for seconds while each of them holds it for milliseconds.
It also runs the stuck send's `on_stuck` (the engine model closes that request's stream), so a request nobody
can hear from stops generating and frees its engine row at once, instead of decoding to max_tokens.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STUCK_SEND_S = 2.0  # a send takes microseconds to milliseconds; one this long means its holder is stuck
POLL_S = 0.1  # how often a waiting sender looks at the holder's time


class _SendLock:
    """A lock and when its holder took it (infinity while free)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.since = float("inf")
        self.on_stuck: Callable[[], None] | None = None  # the holder's, run if its send is taken for stuck


_current = _SendLock()
_swap = threading.Lock()


@contextmanager
def serialized(on_stuck: Callable[[], None] | None = None) -> Iterator[None]:
    """Holds the send lock (responses and metric updates share the backend's channel to the server);
    on_stuck runs (on another thread) if this send is taken for stuck."""
    global _current
    while True:
        held = _current
        if held.lock.acquire(timeout=POLL_S):
            break
        stuck = None
        with _swap:
            if _current is held and time.monotonic() - held.since > STUCK_SEND_S:  # the first to notice
                _current, stuck = _SendLock(), held.on_stuck
                print(
                    f"specpipe: a response send has been blocked for over {STUCK_SEND_S:.0f} s (its requester is "
                    "gone); later sends no longer wait for it" + ("; its request is cancelled" if stuck else ""),
                    file=sys.stderr,
                    flush=True,
                )
        if stuck is not None:
            stuck()
    held.since, held.on_stuck = time.monotonic(), on_stuck
    try:
        yield
    finally:
        held.since, held.on_stuck = float("inf"), None
        held.lock.release()


def send(sender: Any, response: Any = None, flags: int = 0, on_stuck: Callable[[], None] | None = None) -> None:
    """sender.send(response, flags) (no response: flags alone), serialized with every other send; on_stuck
    runs if the send blocks for good (see serialized)."""
    with serialized(on_stuck):
        if response is None:
            sender.send(flags=flags)
        else:
            sender.send(response, flags=flags)
