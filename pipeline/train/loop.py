"""One training loop for every draft: AdamW, warmup then cosine decay, clipping, a step and time budget."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from pipeline.train.distill import DistillSet

WARMUP_FRACTION = 0.05
MAX_WARMUP_STEPS = 50
MIN_LR_FRACTION = 0.1
GRAD_CLIP = 1.0
BETAS = (0.9, 0.95)


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    lr: float
    batch_size: int
    time_budget_s: float
    seed: int = 0
    weight_decay: float = 0.0
    eval_every: int = 100


@dataclass
class TrainLog:
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0
    steps_done: int = 0


def lr_at(step: int, total: int, peak: float, time_fraction: float) -> float:
    """Linear warmup, then cosine decay over whichever runs out first: steps or time."""
    warmup = max(1, min(MAX_WARMUP_STEPS, int(total * WARMUP_FRACTION)))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_fraction))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    params: list[torch.nn.Parameter],
    loss_fn: Callable[[DistillSet], torch.Tensor],
    batches: Iterator[DistillSet],
    held_out: DistillSet,
    settings: TrainSettings,
    desc: str,
) -> TrainLog:
    """Runs until `settings.steps` or `settings.time_budget_s`, the learning rate decaying towards whichever
    limit is nearer, so a run stopped by time still ends at its low learning rate."""
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=BETAS, weight_decay=settings.weight_decay)
    log = TrainLog(eval_steps=[0], eval_loss=[held_out_loss(loss_fn, held_out, settings.batch_size)])
    start = time.monotonic()
    bar = tqdm(range(settings.steps), desc=desc, unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings.steps, settings.lr, (time.monotonic() - start) / settings.time_budget_s)
        loss = loss_fn(next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        log.steps.append(step)
        log.train_loss.append(float(loss.detach()))
        bar.set_postfix(loss=f"{log.train_loss[-1]:.4f}")
        if (step + 1) % settings.eval_every == 0:
            log.eval_steps.append(step + 1)
            log.eval_loss.append(held_out_loss(loss_fn, held_out, settings.batch_size))
        log.steps_done = step + 1
        if time.monotonic() - start > settings.time_budget_s:
            bar.write(f"{desc}: time budget spent at step {step + 1} of {settings.steps}")
            break
    if not log.eval_steps or log.eval_steps[-1] != log.steps_done:
        log.eval_steps.append(log.steps_done)
        log.eval_loss.append(held_out_loss(loss_fn, held_out, settings.batch_size))
    log.seconds = time.monotonic() - start
    return log


@torch.no_grad()
def held_out_loss(loss_fn: Callable[[DistillSet], torch.Tensor], held_out: DistillSet, rows: int) -> float:
    """Mean of the loss over chunks of `rows` held-out sequences."""
    n = len(held_out.lengths)
    chunks = [torch.arange(lo, min(n, lo + rows), device=held_out.lengths.device) for lo in range(0, n, rows)]
    return sum(float(loss_fn(held_out.subset(c))) for c in chunks) / len(chunks)


def plot_log(log: TrainLog, title: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(log.steps, log.train_loss, lw=0.6, alpha=0.6, label="train (per step)")
    ax.plot(log.eval_steps, log.eval_loss, "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
