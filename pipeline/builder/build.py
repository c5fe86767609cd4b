"""A TensorRT-LLM checkpoint → an engine directory (see pipeline/engine/config.py).

portable: config.json shaped like trtllm-build's ({version, pretrained_config, build_config}), the rank
          files hard-linked, tokenizer/, draft/ and specpipe.json; the portable PyTorch engine loads it.
trtllm:   runs `trtllm-build` (the exact command lines are printed with --dry-run), then adds
          specpipe.json and tokenizer/. Both builds are atomic: a failure leaves nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.convert.checkpoint import read_config
from pipeline.convert.eagle3 import EAGLE3_ARCHITECTURE
from pipeline.engine.config import (
    DRAFT_DIR,
    SPECPIPE_FILE,
    TOKENIZER_DIR,
    TRTLLM_SPEC_MODE_FLAGS,
    DynamicTreeConfig,
    NgramConfig,
    SpecConfig,
)
from pipeline.engine.tree import Choices, chain, parse_choices, validate_choices
from pipeline.errors import UserError, atomic_output_dir

BACKENDS = ("portable", "trtllm")
TRTLLM_BUILD = "trtllm-build"
ENGINE_FORMAT_VERSION = "1.2.1"  # the TensorRT-LLM release whose engine config.json this mirrors
DEFAULT_CHOICES = "mc_sim_7b_63"
DEFAULT_TREE_DRAFT_LEN = 63  # TensorRT-LLM's max_medusa_token_len / EAGLE max_draft_len default
DEFAULT_CHAIN_DRAFT_LEN = 4  # draft-model tokens per step
DEFAULT_NUM_EAGLE_LAYERS = 4
DEFAULT_MAX_NUM_TOKENS = 8192
DEFAULT_OPT_BATCH_SIZE = 8
EAGLE_MAX_BATCH_SIZE = 512
EAGLE_MAX_DRAFT_LEN = 256
TOKENS_PER_BLOCK = 32

# Our speculative modes → TensorRT-LLM engine modes. EAGLE-3 has no TensorRT-engine mode in 1.2 (PyTorch
# backend only); the portable build records it as externally drafted tokens, the trtllm build refuses it.
TRTLLM_MODE_OF = {
    "none": "none",
    "medusa": "medusa",
    "eagle": "eagle",
    "draft_model": "draft_tokens_external",
    "ngram": "draft_tokens_external",
    "eagle3": "draft_tokens_external",
}


@dataclass(frozen=True)
class BuildOptions:
    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_draft_len: int | None = None
    choices: str | None = None
    dynamic_tree: bool = False
    dynamic_top_k: int | None = None
    dynamic_depth: int | None = None
    max_non_leaves_per_layer: int | None = None
    speculative: str | None = None  # "ngram" for a plain checkpoint
    ngram_k: int = NgramConfig.k
    ngram_min_n: int = NgramConfig.min_n
    ngram_max_n: int = NgramConfig.max_n
    acceptance: str = "lossless"

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_input_len < 1:
            raise UserError("--max-batch-size and --max-input-len must be >= 1")
        if self.max_input_len > self.max_seq_len:
            raise UserError(
                f"--max-input-len {self.max_input_len} exceeds --max-seq-len {self.max_seq_len}; raise --max-seq-len"
            )
        if self.speculative not in (None, "ngram"):
            raise UserError(
                f"--speculative {self.speculative!r}: only 'ngram' needs no draft weights; other modes come from the "
                "checkpoint"
            )
        if self.max_draft_len is not None and self.max_draft_len < 1:
            raise UserError(f"--max-draft-len {self.max_draft_len}: must be >= 1")


def non_leaves_per_depth(choices: Choices) -> dict[int, int]:
    """How many nodes at each depth (root = 0) have children."""
    parents = {tuple(p[:-1]) for p in choices}
    counts: dict[int, int] = {}
    for p in parents:
        counts[len(p)] = counts.get(len(p), 0) + 1
    return counts


def trim_choices(choices: Choices, depth: int) -> Choices:
    """The paths at most `depth` deep, first occurrence kept, in the given order.

    Dropping whole deeper paths keeps the tree prefix-closed: a kept path's prefixes are shorter still.
    """
    seen: set[tuple[int, ...]] = set()
    kept: Choices = []
    for path in choices:
        if len(path) <= depth and tuple(path) not in seen:
            seen.add(tuple(path))
            kept.append(list(path))
    return kept


def _tree_choices(opts: BuildOptions, depth: int | None, draft_len: int, max_non_leaves: int | None) -> Choices:
    choices = parse_choices(opts.choices or DEFAULT_CHOICES)
    what = "--choices" if opts.choices else f"default tree {DEFAULT_CHOICES} (pass --choices)"
    if opts.choices is None and depth is not None:
        # The default tree is 4 deep; a checkpoint with fewer heads (layers) gets its paths that fit.
        choices = trim_choices(choices, depth)
    validate_choices(choices, max_depth=depth, max_draft_len=draft_len, what=what)
    if max_non_leaves is not None:
        for d, n in sorted(non_leaves_per_depth(choices).items()):
            if n > max_non_leaves:
                raise UserError(
                    f"{what}: {n} non-leaf nodes at depth {d} exceed max_non_leaves_per_layer {max_non_leaves}"
                )
    return choices


def _dynamic_tree(
    opts: BuildOptions, depth_limit: int | None, max_non_leaves: int, limit_name: str = "num_eagle_layers"
) -> DynamicTreeConfig:
    depth = opts.dynamic_depth or depth_limit or DynamicTreeConfig.depth
    if depth_limit is not None and depth > depth_limit:
        raise UserError(f"--dynamic-depth {depth}: exceeds {limit_name} {depth_limit} of the checkpoint")
    tree = DynamicTreeConfig(
        top_k=opts.dynamic_top_k or DynamicTreeConfig.top_k, depth=depth, max_non_leaves_per_layer=max_non_leaves
    )
    if min(tree.top_k, tree.depth, tree.max_non_leaves_per_layer) < 1:
        raise UserError("--dynamic-top-k, --dynamic-depth and --max-non-leaves-per-layer must be >= 1")
    return tree


def draft_kind(ckpt_dir: Path) -> str | None:
    """'eagle3' or 'draft_model' from the draft folder's own config; None without a draft/."""
    cfg_file = ckpt_dir / DRAFT_DIR / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or [cfg.get("architecture")]
    return "eagle3" if EAGLE3_ARCHITECTURE in archs else "draft_model"


def spec_from_checkpoint(config: dict[str, Any], ckpt_dir: Path, opts: BuildOptions) -> SpecConfig:
    """The speculative setup an engine gets: the checkpoint decides the method, the flags its shape."""
    arch = config["architecture"]
    kind = {"MedusaForCausalLM": "medusa", "EagleForCausalLM": "eagle"}.get(arch) or draft_kind(ckpt_dir) or "none"
    if opts.speculative == "ngram" and kind != "none":
        raise UserError(f"--speculative ngram: the checkpoint already carries a {kind} draft; use a plain checkpoint")
    if opts.dynamic_tree and kind not in ("medusa", "eagle", "eagle3"):
        raise UserError(f"--dynamic-tree: only Medusa and EAGLE checkpoints draft trees (this one is {kind})")
    if opts.choices and kind not in ("medusa", "eagle", "eagle3"):
        raise UserError(f"--choices: only Medusa and EAGLE checkpoints draft trees (this one is {kind})")
    acceptance = opts.acceptance
    if kind == "medusa":
        draft_len = opts.max_draft_len or config.get("max_draft_len") or DEFAULT_TREE_DRAFT_LEN
        heads = config["num_medusa_heads"]
        if opts.dynamic_tree:
            width = opts.max_non_leaves_per_layer or DynamicTreeConfig.max_non_leaves_per_layer
            tree = _dynamic_tree(opts, heads, width, "num_medusa_heads")
            choices = _tree_choices(opts, heads, draft_len, None) if opts.choices else None
            return SpecConfig("medusa", draft_len, choices, tree, num_medusa_heads=heads, acceptance=acceptance)
        return SpecConfig(
            "medusa",
            draft_len,
            _tree_choices(opts, heads, draft_len, None),
            num_medusa_heads=heads,
            acceptance=acceptance,
        )
    if kind in ("eagle", "eagle3"):
        draft_len = opts.max_draft_len or config.get("max_draft_len") or DEFAULT_TREE_DRAFT_LEN
        depth = config.get("num_eagle_layers") if kind == "eagle" else None
        max_non_leaves = opts.max_non_leaves_per_layer or config.get("max_non_leaves_per_layer")
        if opts.dynamic_tree:
            tree = _dynamic_tree(opts, depth, max_non_leaves or DynamicTreeConfig.max_non_leaves_per_layer)
            # With --choices: the static tree batched steps cut their tiers from (else the default one).
            choices = _tree_choices(opts, depth, draft_len, max_non_leaves) if opts.choices else None
            return SpecConfig(kind, draft_len, choices, tree, acceptance=acceptance)
        return SpecConfig(kind, draft_len, _tree_choices(opts, depth, draft_len, max_non_leaves), acceptance=acceptance)
    if kind == "draft_model":
        draft_len = opts.max_draft_len or DEFAULT_CHAIN_DRAFT_LEN
        return SpecConfig("draft_model", draft_len, chain(draft_len), acceptance=acceptance)
    if opts.speculative == "ngram":
        ngram = NgramConfig(k=opts.ngram_k, min_n=opts.ngram_min_n, max_n=opts.ngram_max_n)
        if ngram.k < 1 or not 1 <= ngram.min_n <= ngram.max_n:
            raise UserError(
                f"--ngram-k {ngram.k} / --ngram-min-n {ngram.min_n} / --ngram-max-n {ngram.max_n}: need k >= 1 and "
                "1 <= min_n <= max_n"
            )
        return SpecConfig("ngram", ngram.k, chain(ngram.k), ngram=ngram, acceptance=acceptance)
    return SpecConfig("none", acceptance=acceptance)


def tree_summary(spec: SpecConfig, opts: BuildOptions) -> str | None:
    """One line naming the draft tree an engine verifies, its depth and node count; None without one."""
    if spec.dynamic_tree is not None:
        tree = spec.dynamic_tree
        line = f"tree: dynamic (EAGLE-2), top-k {tree.top_k}, depth {tree.depth}, up to {spec.max_draft_len} nodes"
        if not spec.choices:
            return line
        return f"{line}; batched steps' {_static_summary(spec, opts)}"
    if not spec.choices:
        return None
    return f"tree: {_static_summary(spec, opts)}"


def _static_summary(spec: SpecConfig, opts: BuildOptions) -> str:
    assert spec.choices
    depth, nodes = max(len(p) for p in spec.choices), len(spec.choices)
    if spec.mode in ("draft_model", "ngram"):
        name = "chain"
    elif opts.choices is None:
        default_depth = max(len(p) for p in parse_choices(DEFAULT_CHOICES))
        unit = "heads" if spec.mode == "medusa" else "layers"
        name = DEFAULT_CHOICES + (f" trimmed to the checkpoint's {depth} {unit}" if depth < default_depth else "")
    else:
        literal = opts.choices.lstrip().startswith(("[", "{"))
        name = "--choices list" if literal else opts.choices  # a preset, chain:N or a file
    return f"{name}, depth {depth}, {nodes} nodes"


def plugin_config(dtype: str) -> dict[str, Any]:
    """trtllm-build's plugin defaults with `--gemm_plugin auto`, 'auto' resolved to the model dtype."""
    return {
        "dtype": dtype,
        "bert_attention_plugin": "auto",
        "gpt_attention_plugin": dtype,
        "gemm_plugin": dtype,
        "nccl_plugin": dtype,
        "moe_plugin": dtype,
        "mamba_conv1d_plugin": dtype,
        "lora_plugin": None,
        "context_fmha": True,
        "remove_input_padding": True,
        "paged_kv_cache": True,
        "use_paged_context_fmha": True,
        "use_fp8_context_fmha": True,
        "paged_state": True,
        "tokens_per_block": TOKENS_PER_BLOCK,
        "use_fused_mlp": True,
        "multiple_profiles": False,
        "streamingllm": False,
        "reduce_fusion": False,
        "user_buffer": False,
        "norm_quant_fusion": False,
        "fuse_fp4_quant": False,
        "pp_reduce_scatter": False,
    }


def build_config(opts: BuildOptions, spec: SpecConfig, pretrained: dict[str, Any]) -> dict[str, Any]:
    """BuildConfig fields as trtllm-build writes them, with its speculative adjustments."""
    trt_mode = TRTLLM_MODE_OF[spec.mode]
    max_seq_len = opts.max_seq_len + spec.max_draft_len
    if spec.mode == "eagle":
        max_seq_len += pretrained.get("num_eagle_layers", DEFAULT_NUM_EAGLE_LAYERS)
        if opts.max_batch_size > EAGLE_MAX_BATCH_SIZE or spec.max_draft_len > EAGLE_MAX_DRAFT_LEN:
            raise UserError(
                f"EAGLE engines need --max-batch-size <= {EAGLE_MAX_BATCH_SIZE} and max_draft_len <= "
                f"{EAGLE_MAX_DRAFT_LEN}"
            )
    return {
        "max_input_len": opts.max_input_len,
        "max_seq_len": max_seq_len,
        "opt_batch_size": DEFAULT_OPT_BATCH_SIZE,
        "max_batch_size": opts.max_batch_size,
        "max_beam_width": 1,
        "max_num_tokens": max(DEFAULT_MAX_NUM_TOKENS, opts.max_batch_size * (spec.max_draft_len + 1)),
        "opt_num_tokens": None,
        "max_prompt_embedding_table_size": 0,
        "kv_cache_type": "PAGED",
        "gather_context_logits": False,
        "gather_generation_logits": False,
        "strongly_typed": True,
        "force_num_profiles": None,
        "profiling_verbosity": "layer_names_only",
        "enable_debug_output": False,
        "max_draft_len": spec.max_draft_len,
        "speculative_decoding_mode": TRTLLM_SPEC_MODE_FLAGS[trt_mode],
        "use_refit": False,
        "input_timing_cache": None,
        "output_timing_cache": "model.cache",
        "lora_config": {"lora_dir": [], "lora_ckpt_source": "hf", "max_lora_rank": 64, "lora_target_modules": []},
        "weight_sparsity": False,
        "weight_streaming": False,
        "plugin_config": plugin_config(pretrained["dtype"]),
        "use_strip_plan": False,
        "max_encoder_input_len": 1024,
        "monitor_memory": False,
        "use_mrope": False,
    }


def trtllm_commands(ckpt_dir: Path, out_dir: Path, opts: BuildOptions, spec: SpecConfig) -> list[list[str]]:
    """The trtllm-build command lines: the target, plus a plain draft engine for draft-model speculation."""
    if spec.mode == "medusa" and spec.dynamic_tree:
        raise UserError(
            "--dynamic-tree with Medusa runs in the portable engine only: TensorRT-LLM 1.2's Medusa "
            "decodes a static tree (medusa_choices); drop --dynamic-tree or use --backend portable"
        )
    if spec.mode == "eagle3":
        raise UserError(
            "EAGLE-3 has no TensorRT engine in TensorRT-LLM 1.2: serve it with the PyTorch backend's "
            f"Eagle3DecodingConfig(speculative_model='{ckpt_dir / DRAFT_DIR}') or use --backend portable"
        )

    def command(src: Path, dst: Path, max_seq_len: int) -> list[str]:
        return [
            TRTLLM_BUILD,
            "--checkpoint_dir",
            str(src),
            "--output_dir",
            str(dst),
            "--max_batch_size",
            str(opts.max_batch_size),
            "--max_input_len",
            str(opts.max_input_len),
            "--max_seq_len",
            str(max_seq_len),
            "--gemm_plugin",
            "auto",
        ]

    target = command(ckpt_dir, out_dir, opts.max_seq_len)
    if spec.mode != "none":
        target += ["--speculative_decoding_mode", TRTLLM_MODE_OF[spec.mode], "--max_draft_len", str(spec.max_draft_len)]
    commands = [target]
    if spec.mode == "draft_model":
        # The draft also caches the k tokens it proposes beyond the accepted sequence.
        commands.append(command(ckpt_dir / DRAFT_DIR, out_dir / DRAFT_DIR, opts.max_seq_len + spec.max_draft_len))
    return commands


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def _copy_tree(src: Path, dst: Path) -> None:
    for file in sorted(src.rglob("*")):
        if file.is_file():
            _link_or_copy(file, dst / file.relative_to(src))


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2))


def write_portable(ckpt_dir: Path, out: Path, opts: BuildOptions, spec: SpecConfig, pretrained: dict[str, Any]) -> None:
    """Fill `out` with a portable engine; a draft-model draft/ becomes a plain portable engine itself."""
    out.mkdir(parents=True, exist_ok=True)
    _write_json(
        out / "config.json",
        {
            "version": ENGINE_FORMAT_VERSION,
            "pretrained_config": pretrained,
            "build_config": build_config(opts, spec, pretrained),
        },
    )
    world = pretrained["mapping"]["tp_size"] * pretrained["mapping"]["pp_size"]
    for rank in range(world):
        src = ckpt_dir / f"rank{rank}.safetensors"
        if not src.is_file():
            raise UserError(f"{src}: missing; the checkpoint's mapping says {world} ranks; re-run `specpipe convert`")
        _link_or_copy(src, out / src.name)
    if (ckpt_dir / TOKENIZER_DIR).is_dir():
        _copy_tree(ckpt_dir / TOKENIZER_DIR, out / TOKENIZER_DIR)
    draft = ckpt_dir / DRAFT_DIR
    if spec.mode == "draft_model":
        plain = BuildOptions(opts.max_batch_size, opts.max_input_len, opts.max_seq_len + spec.max_draft_len)
        write_portable(draft, out / DRAFT_DIR, plain, SpecConfig("none"), read_config(draft))
    elif draft.is_dir():
        _copy_tree(draft, out / DRAFT_DIR)
    _write_json(out / SPECPIPE_FILE, {"backend": "portable", "speculative": spec.to_dict()})


def run_trtllm(ckpt_dir: Path, out: Path, opts: BuildOptions, spec: SpecConfig) -> None:
    for cmd in trtllm_commands(ckpt_dir, out, opts, spec):
        print("+ " + shlex.join(cmd), flush=True)
        result = subprocess.run(cmd, check=False)
        if result.returncode:
            raise UserError(f"{TRTLLM_BUILD} failed with exit code {result.returncode} for {cmd[2]}; see its log above")
    if (ckpt_dir / TOKENIZER_DIR).is_dir():
        _copy_tree(ckpt_dir / TOKENIZER_DIR, out / TOKENIZER_DIR)
    _write_json(out / SPECPIPE_FILE, {"backend": "trtllm", "speculative": spec.to_dict()})


def build_engine(
    checkpoint: str | Path,
    output: str | Path,
    backend: str = "portable",
    opts: BuildOptions = BuildOptions(),
    dry_run: bool = False,
) -> Path:
    """Build one engine directory from a checkpoint; with dry_run only print what would be done."""
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    ckpt_dir, out = Path(checkpoint), Path(output)
    pretrained = read_config(ckpt_dir)
    spec = spec_from_checkpoint(pretrained, ckpt_dir, opts)
    if backend == "trtllm":
        commands = trtllm_commands(ckpt_dir, out, opts, spec)
        if dry_run:
            for cmd in commands:
                print(shlex.join(cmd))
            return out
        if shutil.which(TRTLLM_BUILD) is None:
            raise UserError(
                f"{TRTLLM_BUILD} not found on PATH: TensorRT-LLM is not installed; run inside the NGC "
                "TensorRT-LLM container or use --backend portable"
            )
        with atomic_output_dir(out) as tmp:
            run_trtllm(ckpt_dir, tmp, opts, spec)
        return out
    if dry_run:
        print(
            json.dumps(
                {
                    "output": str(out),
                    "build_config": build_config(opts, spec, pretrained),
                    "speculative": spec.to_dict(),
                },
                indent=2,
            )
        )
        return out
    with atomic_output_dir(out) as tmp:
        write_portable(ckpt_dir, tmp, opts, spec, pretrained)
    return out
