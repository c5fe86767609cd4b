"""CPU work that must not leave an OpenMP thread pool behind in the calling thread.

libgomp keeps a worker pool for each thread that ran a parallel region, and once the pools hold more
threads than there are cores it stops letting idle workers spin before they sleep. So when the thread
that loaded a model (or converted one) keeps its pool while another thread decodes (the batcher's, a
server's request thread), every parallel op of the decoder waits for workers to wake: plain SmolLM2
decoding on 2 cores took 43 ms a token that way, 35 ms with the decoding thread's pool alone.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")


def on_own_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) on a thread that ends before this returns (its pool with it); exceptions propagate."""
    with ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(fn, *args, **kwargs).result()
