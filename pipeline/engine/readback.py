"""Device results read back behind queued work: the host waits for the group of steps it reads, not for
the group already queued behind it, so the device keeps running while Python reads and emits."""

from __future__ import annotations

import torch


class Pending:
    """Values on their way to the host: `host` holds them once `done` has passed."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None):
        self.host, self.done = host, done

    def read(self) -> list:
        if self.done is not None:
            self.done.synchronize()  # only the work queued before the copy
        return self.host.tolist()


class Readback:
    """Copies into two pinned buffers used in turn (CUDA): at most one group is read while the next is
    queued. A group dropped after a stop leaves its copy pending; the next copy into the same buffer is
    ordered after it on the stream. Elsewhere the values are already on the host."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.turn = 0

    def start(self, values: torch.Tensor) -> Pending:
        if values.device.type != "cuda":
            return Pending(values, None)
        if not self.buffers or self.buffers[0].numel() < values.numel():
            self.buffers = [
                torch.empty(values.numel(), dtype=values.dtype, device="cpu", pin_memory=True) for _ in range(2)
            ]
        host = self.buffers[self.turn][: values.numel()].view(values.shape)
        self.turn ^= 1
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Pending(host, done)
