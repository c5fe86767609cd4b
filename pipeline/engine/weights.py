"""Map merged TensorRT-LLM checkpoint tensors onto the portable engine's modules.

The checkpoint keeps TensorRT-LLM's names; the engine fuses `mlp.fc` and `mlp.gate` into one GEMM.
Everything else is a prefix change, so the map is a short table of renames plus one named fuse.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pipeline.errors import UserError

FUSED_MLP = re.compile(r"(.*)mlp\.(fc|gate)\.(weight|bias)$")


def fuse_fc_gate(fc: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """[I, H] gate_proj (TRT-LLM fc) and [I, H] up_proj (TRT-LLM gate) -> [2I, H], fc first."""
    return torch.cat([fc, gate], dim=0)


def engine_state_dict(tensors: dict[str, torch.Tensor], prefix: str, strip: str) -> dict[str, torch.Tensor]:
    """Tensors under `prefix`, renamed for a module: `strip` removed, fc/gate fused into fc_gate."""
    out: dict[str, torch.Tensor] = {}
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if not name.startswith(prefix):
            continue
        local = name[len(prefix) :]
        local = local[len(strip) :] if local.startswith(strip) else local
        m = FUSED_MLP.match(local)
        if m:
            pending.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = tensor
        else:
            out[local] = tensor
    for (stem, kind), parts in pending.items():
        if set(parts) != {"fc", "gate"}:
            raise UserError(f"checkpoint: {prefix}{stem}mlp.{{fc,gate}}.{kind} incomplete (found {sorted(parts)})")
        out[f"{stem}mlp.fc_gate.{kind}"] = fuse_fc_gate(parts["fc"], parts["gate"])
    return out


def load_into(
    module: nn.Module, state: dict[str, torch.Tensor], what: str, allow_missing: tuple[str, ...] = ()
) -> None:
    """load_state_dict with one clear error naming the first missing, unexpected or mis-shaped tensor."""
    own = module.state_dict()
    missing = [k for k in own if k not in state and k not in allow_missing]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UserError(f"{what}: checkpoint tensors do not match the model ({detail}); reconvert the checkpoint")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise UserError(f"{what}: tensor {k} has shape {tuple(v.shape)}, the config implies {tuple(own[k].shape)}")
    module.load_state_dict(state, strict=False)
