"""The whole training run: self-distill, extract features once, train each draft, evaluate, save.

One call does everything so a single GPU lease covers it; each method has its own time budget and a
method that fails is reported and skipped so the others still come back.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tarfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from torch import nn

from pipeline.errors import UserError, atomic_output_dir
from pipeline.train import draft_model, eagle, eagle3, medusa
from pipeline.train.data import PromptSet
from pipeline.train.distill import DistillSet, attach_features, continuations, random_batches, read_tokens
from pipeline.train.eval import ChainStats, chain_stats, format_table
from pipeline.train.loop import TrainSettings, plot_log, train
from pipeline.train.target import FrozenHead, eagle3_layers, layer_shape

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

METHODS = ("medusa", "eagle", "draft", "eagle3")
FOLDERS = {"medusa": "smollm2-medusa", "eagle": "smollm2-eagle", "draft": "smollm2-draft", "eagle3": "smollm2-eagle3"}
SAVE_DTYPE = torch.float16
AUX_DTYPE = torch.bfloat16  # EAGLE-3 inputs: 3 x hidden per token, the largest tensor kept on the GPU
EVAL_DEPTH = 5
LOG_FILE = "train_log.json"
TOKENS_FILE = "distill_tokens.npz"
PLOT_FILE = "loss.png"


@dataclass(frozen=True)
class RunSettings:
    methods: tuple[str, ...]
    max_new_tokens: int
    gen_batch: int
    gen_budget_s: float
    feature_batch: int
    train: dict[str, TrainSettings]
    medusa_heads: int = 5
    medusa_layers: int = 1
    medusa_hard_weight: float = 0.0  # share of the Medusa loss on the target's greedy token (medusa_loss)
    eagle_steps: int = 3
    eagle_layers: int = 1  # decoder layers of the EAGLE-1/2 draft
    eagle3_steps: int = 3
    draft_layers: tuple[int, ...] = (0, 29)
    # Extra train rows: each train prompt continued again, sampled. The target's distribution stays the
    # label at every position, so sampled text adds contexts the target really writes in, beyond the
    # few thousand usable ShareGPT first turns.
    sample_copies: int = 0
    sample_temperature: float = 0.8
    seed: int = 0
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    # method -> a draft folder this run wrote before (or a committed one): training continues from its weights
    init_from: dict[str, Path] = field(default_factory=dict)


@dataclass
class MethodResult:
    method: str
    ok: bool
    log: dict = field(default_factory=dict)
    chain: dict = field(default_factory=dict)
    error: str = ""


def distill(
    target: LlamaForCausalLM, prompts: PromptSet, s: RunSettings, out: Path, tokens_file: Path | None
) -> tuple[DistillSet, DistillSet, dict]:
    """(train, held-out) sequences with features, on the target's device. The teacher-forced rows join
    the train set only: the held-out set stays the target's own text, what the drafts meet when serving.

    With `tokens_file` (written by an earlier run) its sequences are reused: its first rows are the
    held-out ones, and train prompts it has no sequence for (matched by their tokens) are continued
    now, greedily, so a bigger prompt set extends an old file instead of generating it all again."""
    t0 = time.monotonic()
    held = len(prompts.held_out)
    gen = lambda rows, budget, t=0.0: continuations(
        target, rows, s.max_new_tokens, s.gen_batch, prompts.eos_token_id, prompts.pad_token_id, budget, t
    )
    if tokens_file is not None:
        seqs, lens = read_tokens(tokens_file)
        covered = {tuple(q[:n]) for q, n in zip(seqs[held:], lens[held:])}
        missing = [p for p in prompts.train if tuple(p) not in covered]
    else:
        seqs, lens = gen(prompts.held_out, float("inf"))
        missing = prompts.train
    if missing:
        more, more_lens = gen(missing, s.gen_budget_s)
        seqs, lens = seqs + more, lens + more_lens
        for _ in range(s.sample_copies if tokens_file is None else 0):
            left = s.gen_budget_s - (time.monotonic() - t0)
            if left > 0:
                more, more_lens = gen(prompts.train, left, s.sample_temperature)
                seqs, lens = seqs + more, lens + more_lens
        DistillSet.from_sequences(seqs, lens, prompts.pad_token_id).save_tokens(out / TOKENS_FILE)
    wanted = {tuple(p) for p in prompts.train}  # a tokens file may hold more (--tiny uses a few prompts)
    train_rows = [i for i in range(held, len(seqs)) if tuple(seqs[i][: lens[i]]) in wanted]
    pick = lambda rows: DistillSet.from_sequences(
        [seqs[i] for i in rows], [lens[i] for i in rows], prompts.pad_token_id
    )
    held_set, self_train = pick(range(held)), pick(train_rows)
    forced = (
        DistillSet.from_sequences(prompts.teacher_forced, prompts.teacher_forced_prompt_lens, prompts.pad_token_id)
        if prompts.teacher_forced
        else None
    )
    train_set = DistillSet.concat([self_train, forced], prompts.pad_token_id) if forced else self_train
    gen_s = time.monotonic() - t0
    aux = eagle3_layers(target.config.num_hidden_layers) if "eagle3" in s.methods else ()
    device = next(target.parameters()).device
    for d in (held_set, train_set):
        attach_features(d, target, aux, s.feature_batch, torch.float32, AUX_DTYPE)
    stats = {
        "train_sequences": len(train_set.lengths),
        "held_out_sequences": len(held_set.lengths),
        "train_tokens": train_set.num_tokens,
        "train_generated_tokens": self_train.num_generated,
        "train_self_distilled_sequences": len(self_train.lengths),
        "train_self_distilled_tokens": self_train.num_tokens,
        "train_teacher_forced_sequences": len(forced.lengths) if forced else 0,
        "train_teacher_forced_tokens": forced.num_tokens if forced else 0,
        "train_teacher_forced_reply_tokens": forced.num_generated if forced else 0,
        "train_width": int(train_set.tokens.shape[1]),
        "held_out_tokens": held_set.num_tokens,
        "generate_seconds": round(gen_s, 1),
        "features_seconds": round(time.monotonic() - t0 - gen_s, 1),
    }
    return train_set.to(str(device)), held_set.to(str(device)), stats


@contextlib.contextmanager
def mixed_precision(device: str):
    """bf16 autocast on the GPU (the drafts are small; the LM-head products dominate); plain fp32 on CPU."""
    if device.startswith("cuda"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yield
    else:
        yield


def chunked_chain(
    hits_fn: Callable[[DistillSet], tuple[torch.Tensor, torch.Tensor]], data: DistillSet, rows: int
) -> ChainStats:
    correct, valid = [], []
    for lo in range(0, len(data.lengths), rows):
        c, v = hits_fn(data.subset(torch.arange(lo, min(lo + rows, len(data.lengths)), device=data.lengths.device)))
        correct.append(c[v])
        valid.append(torch.ones(int(v.sum()), dtype=torch.bool, device=v.device))
    return chain_stats(torch.cat(correct), torch.cat(valid))


def build_method(method: str, target: LlamaForCausalLM, frozen: FrozenHead, s: RunSettings):
    """(module, trainable parameters, loss(batch), depth hits(data), save(folder))."""
    shape = layer_shape(target.config)
    vocab, max_pos = target.config.vocab_size, target.config.max_position_embeddings
    device = next(target.parameters()).device
    last_layer = target.model.layers[target.config.num_hidden_layers - 1]
    if method == "medusa":
        heads = medusa.build_heads(shape.hidden, s.medusa_heads, s.medusa_layers).to(device)
        return (
            heads,
            list(heads.parameters()),
            lambda b: medusa.medusa_loss(heads, frozen, b, s.medusa_hard_weight),
            lambda d: medusa.medusa_depth_hits(heads, frozen, d),
            lambda f: medusa.save_medusa(heads, f, s.base_model, s.medusa_layers, vocab, SAVE_DTYPE),
        )
    if method == "eagle":
        # random init: the target's layers write far larger values
        ed = eagle.EagleDraft(shape, s.eagle_layers).to(device)
        return (
            ed,
            list(ed.parameters()),
            lambda b: eagle.eagle_loss(ed, frozen, b, s.eagle_steps),
            lambda d: eagle.eagle_depth_hits(ed, frozen, d, EVAL_DEPTH),
            lambda f: eagle.save_eagle(ed, f, vocab, max_pos, SAVE_DTYPE),
        )
    if method == "eagle3":
        e3 = eagle3.Eagle3Draft(shape).to(device)
        e3.init_from(last_layer, target.model.norm)
        fused = eagle3_layers(target.config.num_hidden_layers)
        return (
            e3,
            list(e3.parameters()),
            lambda b: eagle3.eagle3_loss(e3, frozen, b, s.eagle3_steps),
            lambda d: eagle3.eagle3_depth_hits(e3, frozen, d, EVAL_DEPTH),
            lambda f: eagle3.save_eagle3(e3, f, vocab, max_pos, fused, SAVE_DTYPE),
        )
    dm = draft_model.build_draft_model(target, s.draft_layers)
    return (
        dm,
        draft_model.trainable(dm),
        lambda b: draft_model.draft_loss(dm, frozen, b),
        lambda d: draft_model.draft_depth_hits(dm, frozen, d, EVAL_DEPTH),
        lambda f: draft_model.save_draft_model(dm, f, s.draft_layers, SAVE_DTYPE),
    )


WEIGHT_FILES = {"medusa": medusa.WEIGHTS_FILE, "eagle": eagle.WEIGHTS_FILE, "eagle3": eagle3.WEIGHTS_FILE}


def load_init(method: str, module: nn.Module, folder: Path) -> None:
    """Continue from a saved draft of the same shape: its file holds the module's whole state dict."""
    if method not in WEIGHT_FILES:
        raise UserError(f"--init-from {method}=...: only {', '.join(WEIGHT_FILES)} drafts can be continued")
    path = folder / WEIGHT_FILES[method]
    if not path.is_file():
        raise UserError(
            f"--init-from {method}={folder}: no {WEIGHT_FILES[method]} there; pass a folder this "
            f"script wrote (for example drafts/{FOLDERS[method]})"
        )
    saved = load_file(str(path))
    want = module.state_dict()
    first_new = added_layers(module, saved)
    new = {k for k in want if first_new is not None and k.startswith("layers.") and int(k.split(".")[1]) >= first_new}
    wrong = sorted(set(saved) ^ (set(want) - new)) + [k for k in saved if k in want and saved[k].shape != want[k].shape]
    if wrong:
        raise UserError(
            f"--init-from {method}={folder}: its tensors do not fit this run's draft (first: {wrong[0]}); "
            "train the same shape (for Medusa, --medusa-layers as in its config.json; an EAGLE draft may "
            "only grow, --eagle-layers at least its config.json's num_hidden_layers)"
        )
    module.load_state_dict(saved, strict=first_new is None)
    if first_new is not None:
        assert isinstance(module, eagle.EagleDraft)
        module.start_as_identity(first_new)
        print(f"--init-from {method}: layers from {first_new} on added, starting as identity", flush=True)


def added_layers(module: nn.Module, saved: dict[str, torch.Tensor]) -> int | None:
    """An EAGLE draft may grow deeper than the saved one: the index of its first layer the saved draft lacks
    (None: the same depth, or not an EAGLE draft)."""
    if not isinstance(module, eagle.EagleDraft):
        return None
    depth = 1 + max((int(k.split(".")[1]) for k in saved if k.startswith("layers.")), default=-1)
    return depth if 0 < depth < len(module.layers) else None


def pack(folder: Path, pack_dir: Path) -> None:
    """One tar per draft folder, so a lease that returns few files still brings every draft back."""
    pack_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(pack_dir / f"{folder.name}.tar", "w") as tar:
        tar.add(folder, arcname=folder.name)


def train_method(
    method: str,
    target: LlamaForCausalLM,
    frozen: FrozenHead,
    train_set: DistillSet,
    held: DistillSet,
    s: RunSettings,
    out: Path,
    pack_dir: Path | None,
) -> MethodResult:
    ts = s.train[method]
    device = str(next(target.parameters()).device)
    torch.manual_seed(ts.seed)
    module, params, loss_fn, hits_fn, save = build_method(method, target, frozen, s)
    if method in s.init_from:
        load_init(method, module, s.init_from[method])

    def loss(batch: DistillSet) -> torch.Tensor:
        with mixed_precision(device):
            return loss_fn(batch)

    log = train(params, loss, random_batches(train_set, ts.batch_size, ts.seed), held, ts, method)
    with mixed_precision(device):
        chain = chunked_chain(hits_fn, held, ts.batch_size)
    result = MethodResult(method, True, log=asdict(log), chain=asdict(chain))
    with atomic_output_dir(out / FOLDERS[method]) as folder:
        save(folder)
        plot_log(log, f"{FOLDERS[method]}: loss", folder / PLOT_FILE)
        (folder / LOG_FILE).write_text(
            json.dumps({"settings": asdict(ts), "log": asdict(log), "held_out_chain": asdict(chain)}) + "\n"
        )
    if pack_dir is not None:
        pack(out / FOLDERS[method], pack_dir)
    return result


def run_all(
    target: LlamaForCausalLM,
    prompts: PromptSet,
    s: RunSettings,
    out: Path,
    tokens_file: Path | None = None,
    pack_dir: Path | None = None,
) -> dict:
    """Trains every method in `s.methods`; writes one folder per method and summary.json under `out`."""
    torch.manual_seed(s.seed)
    out.mkdir(parents=True, exist_ok=True)
    frozen = FrozenHead.of(target)
    for method, folder in s.init_from.items():  # a wrong folder fails now, not after the distillation
        load_init(method, build_method(method, target, frozen, s)[0], folder)
    train_set, held, data_stats = distill(target, prompts, s, out, tokens_file)
    print("data:", json.dumps(data_stats))
    results: dict[str, MethodResult] = {}
    for method in s.methods:
        try:
            results[method] = train_method(method, target, frozen, train_set, held, s, out, pack_dir)
        except Exception:  # one trainer's bug must not cost the other drafts of the same GPU lease
            traceback.print_exc()
            results[method] = MethodResult(method, False, error=traceback.format_exc(limit=3))
        if str(next(target.parameters()).device).startswith("cuda"):
            torch.cuda.empty_cache()
    summary = {"data": data_stats, "methods": {k: asdict(v) for k, v in results.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if pack_dir is not None:
        for name in ("summary.json", TOKENS_FILE):
            if (out / name).is_file():
                shutil.copy(out / name, pack_dir / name)
    table = {k: ChainStats(**v.chain) for k, v in results.items() if v.ok}
    if table:
        print(format_table(table))
    for k, v in results.items():
        last = f"train {v.log['train_loss'][-1]:.4f}, held-out {v.log['eval_loss'][-1]:.4f}" if v.ok else "FAILED"
        steps = f"{v.log['steps_done']} steps in {v.log['seconds']:.0f} s" if v.ok else v.error.splitlines()[-1]
        print(f"{k:<8} {last}; {steps}")
    return summary
