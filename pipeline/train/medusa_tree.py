"""Fit a static Medusa tree to trained heads: the paths accepted most often on held-out text.

The default tree (mc_sim_7b_63) was tuned for Vicuna-7B's heads. This measures, on held-out
self-distilled sequences, at which rank each head holds the token the target really emits, then keeps
the most often accepted paths (pipeline.engine.tree.tree_from_ranks) and the mean acceptance length it
expects beside the default tree's on the same data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from pipeline.engine.tree import MC_SIM_7B_63, Choices, expected_acceptance, tree_from_ranks
from pipeline.errors import UserError, read_json
from pipeline.train.distill import DistillSet
from pipeline.train.eval import depth_valid
from pipeline.train.medusa import WEIGHTS_FILE, build_heads
from pipeline.train.target import FrozenHead, extract_features, load_target

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

DEFAULT_TOKENS = "drafts/distill/smollm2-sharegpt-42220.npz"  # the shipped heads' token file
HELD_OUT_ROWS = 200  # the token file's first rows are held out from training (see the model cards)
ROWS_PER_BATCH = 4  # a batch's logits are rows x 512 x 49152 floats per head
DEFAULT_MAX_RANK = 10  # top-k considered per head


@dataclass(frozen=True)
class TreeFit:
    choices: Choices
    expected_acceptance: float
    default_expected_acceptance: float  # mc_sim_7b_63's on the same roots
    roots: int
    held_out_rows: int

    def report(self, **settings: Any) -> dict[str, Any]:
        return {
            "choices": self.choices,
            "expected_acceptance": self.expected_acceptance,
            "mc_sim_7b_63_expected_acceptance": self.default_expected_acceptance,
            "roots": self.roots,
            "held_out_rows": self.held_out_rows,
            **settings,
        }


@torch.no_grad()
def head_ranks(target: LlamaForCausalLM, heads: nn.ModuleList, data: DistillSet, max_rank: int) -> torch.Tensor:
    """[roots, heads] rank of the target's own token among each head's guesses, capped at max_rank."""
    frozen = FrozenHead.of(target)
    device = next(target.parameters()).device
    out = []
    for lo in tqdm(range(0, len(data.lengths), ROWS_PER_BATCH), desc="head ranks", unit="batch"):
        batch = data.subset(torch.arange(lo, min(lo + ROWS_PER_BATCH, len(data.lengths))))
        features, _ = extract_features(target, batch.tokens.to(device), ())
        greedy = frozen.logits(features).argmax(-1)  # the target's token for position p + 1
        width = features.shape[1]
        ranks = torch.full((*greedy.shape, len(heads)), max_rank, dtype=torch.long, device=device)
        for h, head in enumerate(heads):
            logits = frozen.logits(head(features))[:, : width - 1 - h]
            true = greedy[:, 1 + h :, None]
            ranks[:, : width - 1 - h, h] = (logits > logits.gather(-1, true)).sum(-1).clamp(max=max_rank)
        valid = depth_valid(batch.lengths, batch.prompt_lens, width, len(heads)).to(device)
        out.append(ranks[valid].cpu())
    return torch.cat(out)


def load_heads(heads_dir: Path, device: str) -> nn.ModuleList:
    """Trained Medusa heads (config.json + weights, as `specpipe train run` writes them), in float32."""
    cfg = read_json(heads_dir / "config.json", "Medusa config", "train the heads with `specpipe train run`")
    if not (heads_dir / WEIGHTS_FILE).is_file():
        raise UserError(f"{heads_dir / WEIGHTS_FILE}: not found; train the heads with `specpipe train run`")
    heads = build_heads(cfg["hidden_size"], cfg["medusa_num_heads"], cfg["medusa_num_layers"])
    heads.load_state_dict({k: v.float() for k, v in load_file(str(heads_dir / WEIGHTS_FILE)).items()})
    return heads.to(device).eval()


def fit_tree(
    heads_dir: Path, gguf: Path, tokens: str, held_out: int, num_paths: int, max_rank: int, device: str
) -> TreeFit:
    """Rank the heads' guesses on the token file's first `held_out` rows and keep the best `num_paths` paths."""
    if num_paths < 1 or max_rank < 1:
        raise UserError("--num-paths and --max-rank must be at least 1")
    heads = load_heads(heads_dir, device)
    target = load_target(gguf, device)
    data = DistillSet.load_tokens(tokens, 0)
    data = data.subset(torch.arange(min(held_out, len(data.lengths))))
    ranks = head_ranks(target, heads, data, max_rank)
    choices, expected = tree_from_ranks(ranks, num_paths, max_rank)
    return TreeFit(choices, expected, expected_acceptance(ranks, MC_SIM_7B_63), ranks.shape[0], len(data.lengths))


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_fit(fit: TreeFit, output: Path, report: Path | None, **settings: Any) -> None:
    """The choices file `specpipe build --choices` reads, and optionally the fit as JSON."""
    write_atomically(output, json.dumps(fit.choices) + "\n")
    if report is not None:
        write_atomically(report, json.dumps(fit.report(**settings), indent=1) + "\n")
