"""Fit a static draft tree to a trained draft: the paths accepted most often on held-out text.

The default tree (mc_sim_7b_63) was tuned for Vicuna-7B's Medusa heads. This measures, on held-out
self-distilled sequences, at which rank each depth's guesses hold the token the target really emits
(Medusa: head d; EAGLE: step d of the draft's chain along the target's tokens, fed its own features, as a
tree's node on the accepted path is), then keeps the most often accepted paths
(pipeline.engine.tree.tree_from_ranks) and the mean acceptance length it expects beside the default tree's
on the same data.
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

from pipeline.convert.eagle import DEFAULT_MAX_NON_LEAVES
from pipeline.engine.tree import MC_SIM_7B_63, Choices, expected_acceptance, tree_from_ranks
from pipeline.errors import UserError, read_json
from pipeline.train import eagle
from pipeline.train.distill import DistillSet
from pipeline.train.eval import depth_valid
from pipeline.train.medusa import WEIGHTS_FILE, build_heads
from pipeline.train.target import FrozenHead, extract_features, layer_shape, load_target

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

DEFAULT_TOKENS = "drafts/distill/smollm2-sharegpt-42220.npz"  # the shipped heads' token file
HELD_OUT_ROWS = 200  # the token file's first rows are held out from training (see the model cards)
ROWS_PER_BATCH = 4  # a batch's logits are rows x 512 x 49152 floats per head
DEFAULT_MAX_RANK = 10  # top-k considered per depth
DEFAULT_EAGLE_DEPTH = 4  # an EAGLE tree's depth (the CUDA engines' dynamic depth)
KINDS = ("medusa", "eagle")
# Default bound on nodes with children a depth: TensorRT-LLM's max_non_leaves_per_layer for EAGLE trees
# (the converter's default); Medusa trees have none.
MAX_NON_LEAVES = {"medusa": 0, "eagle": DEFAULT_MAX_NON_LEAVES}


@dataclass(frozen=True)
class TreeFit:
    choices: Choices
    expected_acceptance: float
    default_expected_acceptance: float  # mc_sim_7b_63's on the same roots
    roots: int
    held_out_rows: int
    depth_acceptance: list[float]  # the fitted tree's P(depth d accepted), d = 1..

    def report(self, **settings: Any) -> dict[str, Any]:
        return {
            "choices": self.choices,
            "expected_acceptance": self.expected_acceptance,
            "mc_sim_7b_63_expected_acceptance": self.default_expected_acceptance,
            "roots": self.roots,
            "held_out_rows": self.held_out_rows,
            "depth_acceptance": self.depth_acceptance,
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
            ranks[:, : width - 1 - h, h] = rank_of(logits, greedy[:, 1 + h :], max_rank)
        valid = depth_valid(batch.lengths, batch.prompt_lens, width, len(heads)).to(device)
        out.append(ranks[valid].cpu())
    return torch.cat(out)


@torch.no_grad()
def eagle_ranks(
    target: LlamaForCausalLM, draft: eagle.EagleDraft, data: DistillSet, depth: int, max_rank: int
) -> torch.Tensor:
    """[roots, depth] rank of the target's own token among the draft's guesses at each step of the chain
    rooted there (step s runs at position root + s on the draft's own features), capped at max_rank."""
    frozen = FrozenHead.of(target)
    device = next(target.parameters()).device
    out = []
    for lo in tqdm(range(0, len(data.lengths), ROWS_PER_BATCH), desc="draft ranks", unit="batch"):
        batch = data.subset(torch.arange(lo, min(lo + ROWS_PER_BATCH, len(data.lengths))))
        tokens = batch.tokens.to(device)
        features, _ = extract_features(target, tokens, ())
        greedy = frozen.logits(features).argmax(-1)  # the target's token for position p + 1
        width = features.shape[1]
        ranks = torch.full((*greedy.shape, depth), max_rank, dtype=torch.long, device=device)
        for s, h in enumerate(draft.unroll(frozen, tokens, features, depth)):
            at_p = rank_of(frozen.logits(h[:, : width - 1]), greedy[:, 1:], max_rank)  # guesses token p + 2
            ranks[:, : width - 1 - s, s] = at_p[:, s:]  # the chain rooted at j runs step s at j + s
        valid = depth_valid(batch.lengths, batch.prompt_lens, width, depth).to(device)
        out.append(ranks[valid].cpu())
    return torch.cat(out)


def rank_of(logits: torch.Tensor, true: torch.Tensor, max_rank: int) -> torch.Tensor:
    """Rank of token `true` [...] among `logits` [..., V] (0: the top guess), capped at max_rank."""
    return (logits > logits.gather(-1, true[..., None])).sum(-1).clamp(max=max_rank)


def eagle_layers(folder: Path) -> int:
    """A trained EAGLE-1/2 draft's layer count (config.json + weights, as `specpipe train run` writes them)."""
    cfg = read_json(folder / "config.json", "EAGLE draft config", "train the draft with `specpipe train run`")
    if not (folder / eagle.WEIGHTS_FILE).is_file():
        raise UserError(f"{folder / eagle.WEIGHTS_FILE}: not found; train the draft with `specpipe train run`")
    return int(cfg["num_hidden_layers"])


def load_eagle(folder: Path, target: LlamaForCausalLM) -> eagle.EagleDraft:
    """A trained EAGLE-1/2 draft for `target`, in float32."""
    draft = eagle.EagleDraft(layer_shape(target.config), eagle_layers(folder))
    draft.load_state_dict({k: v.float() for k, v in load_file(str(folder / eagle.WEIGHTS_FILE)).items()})
    return draft.to(next(target.parameters()).device).eval()


def load_heads(heads_dir: Path, device: str) -> nn.ModuleList:
    """Trained Medusa heads (config.json + weights, as `specpipe train run` writes them), in float32."""
    cfg = read_json(heads_dir / "config.json", "Medusa config", "train the heads with `specpipe train run`")
    if not (heads_dir / WEIGHTS_FILE).is_file():
        raise UserError(f"{heads_dir / WEIGHTS_FILE}: not found; train the heads with `specpipe train run`")
    heads = build_heads(cfg["hidden_size"], cfg["medusa_num_heads"], cfg["medusa_num_layers"])
    heads.load_state_dict({k: v.float() for k, v in load_file(str(heads_dir / WEIGHTS_FILE)).items()})
    return heads.to(device).eval()


def fit_tree(
    kind: str,
    folder: Path,
    gguf: Path,
    tokens: str,
    held_out: int,
    num_paths: int,
    max_rank: int,
    depth: int,
    max_non_leaves: int | None,
    device: str,
) -> TreeFit:
    """Rank the draft's guesses on the token file's first `held_out` rows and keep the best `num_paths`
    paths (an EAGLE draft: `depth` steps deep; Medusa: a step a head), with at most `max_non_leaves` nodes
    that have children at each depth (None: any number)."""
    if num_paths < 1 or max_rank < 1 or depth < 1:
        raise UserError("--num-paths, --max-rank and --depth must be at least 1")
    heads = load_heads(folder, device) if kind == "medusa" else None
    if heads is None:
        eagle_layers(folder)  # a wrong folder fails before the target loads
    target = load_target(gguf, device)
    data = DistillSet.load_tokens(tokens, 0)
    data = data.subset(torch.arange(min(held_out, len(data.lengths))))
    if heads is not None:
        ranks = head_ranks(target, heads, data, max_rank)
    else:
        ranks = eagle_ranks(target, load_eagle(folder, target), data, depth, max_rank)
    choices, expected = tree_from_ranks(ranks, num_paths, max_rank, max_non_leaves)
    default = expected_acceptance(ranks, MC_SIM_7B_63)
    return TreeFit(choices, expected, default, ranks.shape[0], len(data.lengths), depth_acceptance(ranks, choices))


def depth_acceptance(ranks: torch.Tensor, choices: Choices) -> list[float]:
    """P(a node at depth d is accepted) under the tree `choices`, d = 1 .. its depth."""
    hit = torch.zeros(ranks.shape[0], max(len(p) for p in choices), dtype=torch.bool)
    for path in choices:
        on = torch.ones(ranks.shape[0], dtype=torch.bool)
        for d, r in enumerate(path):
            on &= ranks[:, d] == r
        hit[:, len(path) - 1] |= on
    return [round(float(v), 4) for v in hit.float().mean(0)]


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_fit(fit: TreeFit, output: Path, report: Path | None, **settings: Any) -> None:
    """The choices file `specpipe build --choices` reads, and optionally the fit as JSON."""
    write_atomically(output, json.dumps(fit.choices) + "\n")
    if report is not None:
        write_atomically(report, json.dumps(fit.report(**settings), indent=1) + "\n")
