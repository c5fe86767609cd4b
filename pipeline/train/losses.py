"""Losses shared by the trainers: distillation against the target's distribution, feature regression."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum p_teacher log q_student (KL to the teacher plus a constant)."""
    return cross_entropy_to(student_logits, torch.softmax(teacher_logits.float(), dim=-1))


def cross_entropy_to(
    student_logits: torch.Tensor, teacher_probs: torch.Tensor, hard_weight: float = 0.0
) -> torch.Tensor:
    """soft_cross_entropy for a teacher distribution already computed, so several students can share one;
    hard_weight of it taken against the teacher's argmax alone instead."""
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    soft = -(teacher_probs * log_q).sum(-1).mean()
    if not hard_weight:
        return soft
    return (1 - hard_weight) * soft + hard_weight * F.nll_loss(log_q, teacher_probs.argmax(-1))


def feature_regression(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """EAGLE's smooth-L1 on features, averaged over rows (summed over the hidden dimension / H)."""
    return F.smooth_l1_loss(predicted.float(), target.float())


def step_weights(steps: int, decay: float) -> list[float]:
    """decay ** s for unrolled step (or Medusa head) s: later steps matter less and are harder."""
    return [decay**s for s in range(steps)]
