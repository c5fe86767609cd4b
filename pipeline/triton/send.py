"""Responses sent from the Python backend's request threads, one at a time.

The backend's response path is not safe under concurrent sends from several threads (seen: boost
lock_exception and a segfault in libtriton_python with 4 streams), so sends take one lock. A send can also
block for good: a response to a request of a BLS stub that died is never acknowledged by the server (seen in
a soak), and its thread holds the lock forever, so every other request's responses waited behind it and the
server stopped answering on every route. A sender that waits STUCK_SEND_S for the lock takes its holder for
stuck, leaves that lock to it and sends under a new one (again if that one's holder gets stuck too); the
other sends stay serialized.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STUCK_SEND_S = 2.0  # a send takes microseconds to milliseconds; waiting this long means its holder is stuck

_lock = threading.Lock()
_swap = threading.Lock()


@contextmanager
def serialized() -> Iterator[None]:
    """Holds the send lock (responses and metric updates share the backend's channel to the server)."""
    global _lock
    while True:
        lock = _lock
        if lock.acquire(timeout=STUCK_SEND_S):
            break
        with _swap:  # its holder is stuck (so may the next lock's be: the loop checks again)
            if _lock is lock:  # the first to notice
                _lock = threading.Lock()
                print(
                    f"specpipe: a response send has been blocked for over {STUCK_SEND_S:.0f} s (its requester is "
                    "gone); later sends no longer wait for it",
                    file=sys.stderr,
                    flush=True,
                )
    try:
        yield
    finally:
        lock.release()


def send(sender: Any, response: Any = None, flags: int = 0) -> None:
    """sender.send(response, flags) (no response: flags alone), serialized with every other send."""
    with serialized():
        if response is None:
            sender.send(flags=flags)
        else:
            sender.send(response, flags=flags)
