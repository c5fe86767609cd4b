"""Self-distillation data: the target's own greedy continuations of the prompts, with its features.

Drafts trained on what the target itself says accept far more than drafts trained on human text.
Sequences are stored right-padded in one tensor; `prompt_lens` marks where the target's text starts.
Their features are stored packed (rows back to back), since they are most of the memory and rows
average half the widest; each batch is padded when it is drawn.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from pipeline.train.target import extract_features

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


@torch.no_grad()
def continuations(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    eos_id: int,
    pad_id: int,
    time_budget_s: float,
    temperature: float = 0.0,
) -> tuple[list[list[int]], list[int]]:
    """(prompt + the target's continuation through the first EOS, prompt length) per prompt; prompts of
    similar length are batched together. Greedy at temperature 0, else sampled from the full distribution.

    Stops early, keeping finished batches, once `time_budget_s` is spent."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = []
    prompt_lens: list[int] = []
    start = time.monotonic()
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    )
    desc = f"self-distill (T={temperature:g})" if temperature > 0 else "self-distill (greedy)"
    bar = tqdm(range(0, len(order), batch_size), desc=desc, unit="batch")
    for lo in bar:
        if time.monotonic() - start > time_budget_s:
            bar.write(f"self-distill: time budget spent after {len(out)} sequences")
            break
        batch = [prompts[i] for i in order[lo : lo + batch_size]]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):  # left padding: every prompt ends where generation starts
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            **sampling,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        for row, p in enumerate(batch):
            cont = gen[row, width:].tolist()
            if eos_id in cont:
                cont = cont[: cont.index(eos_id) + 1]
            out.append(p + cont)
            prompt_lens.append(len(p))
    return out, prompt_lens


@dataclass
class PackedRows:
    """One vector a position of variable-length rows, stored back to back without padding."""

    flat: torch.Tensor  # [sum of lengths, D]
    starts: torch.Tensor  # [N] where each row begins in `flat`

    @classmethod
    def zeros(cls, lengths: torch.Tensor, dim: int, dtype: torch.dtype, device) -> PackedRows:
        starts = torch.cumsum(lengths, 0) - lengths
        return cls(torch.zeros(int(lengths.sum()), dim, dtype=dtype, device=device), starts.to(device))

    def positions(self, rows: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, width] index into `flat`, [R, width] whether the position is inside its row)."""
        pos = torch.arange(width, device=self.flat.device)
        inside = pos[None, :] < lengths.to(self.flat.device)[:, None]
        return torch.where(inside, self.starts[rows.to(self.flat.device)][:, None] + pos, 0), inside

    def padded(self, rows: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """[R, width, D], zero past each row's length (as a padded store would hold)."""
        index, inside = self.positions(rows, lengths, width)
        return self.flat[index].masked_fill_(~inside[..., None], 0)

    def to(self, device) -> PackedRows:
        return PackedRows(self.flat.to(device), self.starts.to(device))


@dataclass
class DistillSet:
    tokens: torch.Tensor  # [N, T] right-padded
    lengths: torch.Tensor  # [N]
    prompt_lens: torch.Tensor  # [N]
    # Final features (the LM head's input) and EAGLE-3's fused-layer inputs: [N, T, H] and [N, T, 3H] in a
    # batch, packed in a whole set (attach_features); subset() always returns them padded.
    features: torch.Tensor | PackedRows | None = None
    aux: torch.Tensor | PackedRows | None = None

    @classmethod
    def from_sequences(cls, seqs: list[list[int]], prompt_lens: list[int], pad_id: int) -> DistillSet:
        width = max(map(len, seqs))
        tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        for row, s in enumerate(seqs):
            tokens[row, : len(s)] = torch.tensor(s)
        return cls(tokens, torch.tensor([len(s) for s in seqs]), torch.tensor(prompt_lens))

    @classmethod
    def concat(cls, parts: list[DistillSet], pad_id: int) -> DistillSet:
        """The rows of every part, in order, re-padded to the widest (tokens only: features come after)."""
        seqs = [t[: int(n)].tolist() for d in parts for t, n in zip(d.tokens, d.lengths)]
        return cls.from_sequences(seqs, torch.cat([d.prompt_lens for d in parts]).tolist(), pad_id)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_generated(self) -> int:
        return int((self.lengths - self.prompt_lens).sum())

    @property
    def feature_batch(self) -> torch.Tensor:
        """`features` of a batch ([N, T, H]; subset() pads them), not a whole set's packed ones."""
        assert isinstance(self.features, torch.Tensor), "features missing or packed: take a subset()"
        return self.features

    @property
    def aux_batch(self) -> torch.Tensor:
        """`aux` of a batch ([N, T, 3H]; subset() pads it), not a whole set's packed one."""
        assert isinstance(self.aux, torch.Tensor), "aux missing or packed: take a subset()"
        return self.aux

    def to(self, device: str) -> DistillSet:
        def move(t: torch.Tensor | PackedRows | None) -> torch.Tensor | PackedRows | None:
            return None if t is None else t.to(device)

        return DistillSet(
            self.tokens.to(device),
            self.lengths.to(device),
            self.prompt_lens.to(device),
            move(self.features),
            move(self.aux),
        )

    def subset(self, rows: torch.Tensor) -> DistillSet:
        width = int(self.lengths[rows].max())

        def pick(t: torch.Tensor | PackedRows | None) -> torch.Tensor | None:
            if isinstance(t, PackedRows):
                return t.padded(rows, self.lengths[rows], width)
            return None if t is None else t[rows, :width]

        return DistillSet(
            self.tokens[rows, :width], self.lengths[rows], self.prompt_lens[rows], pick(self.features), pick(self.aux)
        )

    def save_tokens(self, path) -> None:
        """Compact, device-independent record of the sequences (uint16 ids: vocab < 65536)."""
        flat = torch.cat([self.tokens[i, : int(n)] for i, n in enumerate(self.lengths)])
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")  # another trainer may be waiting for `path`
        with open(partial, "wb") as f:
            np.savez_compressed(
                f,
                tokens=flat.cpu().numpy().astype(np.uint16),
                lengths=self.lengths.cpu().numpy(),
                prompt_lens=self.prompt_lens.cpu().numpy(),
            )
        os.replace(partial, path)

    @classmethod
    def load_tokens(cls, path, pad_id: int) -> DistillSet:
        return cls.from_sequences(*read_tokens(path), pad_id)


def read_tokens(path) -> tuple[list[list[int]], list[int]]:
    """(sequences, prompt lengths) of a file written by DistillSet.save_tokens."""
    data = np.load(path)
    flat, lengths = data["tokens"].astype(np.int64), data["lengths"]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [flat[bounds[i] : bounds[i + 1]].tolist() for i in range(len(lengths))], data["prompt_lens"].tolist()


@torch.no_grad()
def attach_features(
    data: DistillSet,
    model: LlamaForCausalLM,
    aux_layers: tuple[int, ...],
    batch_size: int,
    feature_dtype: torch.dtype,
    aux_dtype: torch.dtype,
) -> DistillSet:
    """Fills `features` (and `aux` when aux_layers is non-empty), packed, by running the frozen target
    once; rows go through it shortest first, each batch cut to its longest row, so padding costs little
    target compute."""
    device = next(model.parameters()).device
    hidden = model.config.hidden_size
    features = PackedRows.zeros(data.lengths, hidden, feature_dtype, device)
    packed_aux = PackedRows.zeros(data.lengths, len(aux_layers) * hidden, aux_dtype, device) if aux_layers else None
    data.features, data.aux = features, packed_aux
    order = torch.argsort(data.lengths)
    for lo in tqdm(range(0, len(order), batch_size), desc="target features", unit="batch"):
        pick = order[lo : lo + batch_size]
        cut = int(data.lengths[pick].max())
        final, aux = extract_features(model, data.tokens[pick, :cut].to(device), aux_layers)
        index, inside = features.positions(pick, data.lengths[pick], cut)
        features.flat[index[inside]] = final[inside].to(feature_dtype)
        if aux is not None:
            assert packed_aux is not None  # extract_features returns aux only for aux_layers
            packed_aux.flat[index[inside]] = aux[inside].to(aux_dtype)
    return data


def teacher_mask(data: DistillSet, shift: int, include_prompt: bool = False) -> torch.Tensor:
    """[N, T] bool: position p is trained when the teacher feature p + shift exists and (unless
    include_prompt) predicts a token of the target's own continuation."""
    m = torch.arange(data.tokens.shape[1], device=data.tokens.device)[None, :] + shift
    ok = m < data.lengths[:, None]
    if not include_prompt:
        ok &= m >= data.prompt_lens[:, None] - 1
    return ok


def unrolled_masks(data: DistillSet, steps: int) -> list[torch.Tensor]:
    """Per unrolled step s, [N, T-1] positions trained: step s at p belongs to the chain rooted at
    p - s, so the first s positions have no chain."""
    base = teacher_mask(data, 1)[:, : data.tokens.shape[1] - 1]
    masks = []
    for s in range(steps):
        mask = base.clone()
        mask[:, :s] = False
        masks.append(mask)
    return masks


def random_batches(data: DistillSet, batch_size: int, seed: int):
    """Endless shuffled mini-batches (epoch after epoch), each trimmed to its longest sequence."""
    gen = torch.Generator().manual_seed(seed)
    batch_size = min(batch_size, len(data.lengths))
    while True:
        perm = torch.randperm(len(data.lengths), generator=gen)
        for lo in range(0, len(perm) - batch_size + 1, batch_size):
            yield data.subset(perm[lo : lo + batch_size].to(data.lengths.device))
