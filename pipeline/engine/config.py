"""Engine-directory contract shared by the builder (writer) and the portable engine (reader).

An engine directory holds, for both backends:
  config.json     TensorRT-LLM shaped: {"version", "pretrained_config", "build_config"}
  rank{r}.safetensors (portable) or rank{r}.engine (trtllm)
  tokenizer/      the target's Hugging Face tokenizer (save_pretrained)
  draft/          a second model when the method needs one (draft model, EAGLE-3 draft)
  specpipe.json   {"backend": "portable" | "trtllm", "speculative": SpecConfig.to_dict()}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import UserError, read_json

SPEC_MODES = ("none", "medusa", "eagle", "eagle3", "draft_model", "ngram")
ACCEPTANCE_RULES = ("lossless", "typical")
SPECPIPE_FILE = "specpipe.json"
TOKENIZER_DIR = "tokenizer"
DRAFT_DIR = "draft"

# TensorRT-LLM's SpeculativeDecodingMode bit flags, as written into build_config.
TRTLLM_SPEC_MODE_FLAGS = {
    "none": 1,
    "draft_tokens_external": 2,
    "medusa": 4,
    "lookahead_decoding": 8,
    "explicit_draft_tokens": 16,
    "eagle": 32,
}


@dataclass(frozen=True)
class DynamicTreeConfig:
    """EAGLE-2: expand top_k children per node for `depth` layers, keep the best max_draft_len nodes."""

    top_k: int = 8
    depth: int = 5
    max_non_leaves_per_layer: int = 8


@dataclass(frozen=True)
class NgramConfig:
    """Prompt lookup: match the last n tokens (max_n down to min_n) and propose up to k tokens."""

    k: int = 4
    min_n: int = 1
    max_n: int = 4


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa typical acceptance (not lossless): accept x if p(x) > min(threshold, alpha * exp(-H(p)))."""

    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3


@dataclass(frozen=True)
class SpecConfig:
    mode: str = "none"
    max_draft_len: int = 0
    choices: list[list[int]] | None = None  # static tree (medusa, eagle); chains for draft_model
    dynamic_tree: DynamicTreeConfig | None = None  # eagle / eagle3 / medusa (portable) with EAGLE-2 trees
    num_medusa_heads: int = 0
    ngram: NgramConfig | None = None
    # "lossless": speculative sampling that keeps the target's distribution (greedy: exact).
    # "typical": Medusa typical acceptance for temperature > 0; faster, NOT lossless.
    acceptance: str = "lossless"
    typical_acceptance: TypicalAcceptance = field(default_factory=TypicalAcceptance)

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise UserError(f"speculative mode {self.mode!r}: unknown; choose one of {', '.join(SPEC_MODES)}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise UserError(f"acceptance {self.acceptance!r}: unknown; choose one of {', '.join(ACCEPTANCE_RULES)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecConfig:
        d = dict(d)
        if d.get("dynamic_tree"):
            d["dynamic_tree"] = DynamicTreeConfig(**d["dynamic_tree"])
        if d.get("ngram"):
            d["ngram"] = NgramConfig(**d["ngram"])
        d["typical_acceptance"] = TypicalAcceptance(**(d.get("typical_acceptance") or {}))
        return cls(**d)


@dataclass(frozen=True)
class EngineLimits:
    max_batch_size: int
    max_input_len: int
    max_seq_len: int  # prompt + generated tokens (+ draft slots) that the KV cache holds
    max_draft_len: int


@dataclass(frozen=True)
class EngineDir:
    path: Path
    backend: str
    pretrained_config: dict[str, Any]
    build_config: dict[str, Any]
    spec: SpecConfig

    @property
    def limits(self) -> EngineLimits:
        b = self.build_config
        return EngineLimits(b["max_batch_size"], b["max_input_len"], b["max_seq_len"], b.get("max_draft_len", 0))

    @property
    def tokenizer_dir(self) -> Path:
        own = self.path / TOKENIZER_DIR
        # A draft/ engine shares its target's tokenizer (the converter refuses any other vocabulary).
        return own if own.is_dir() or self.path.name != DRAFT_DIR else self.path.parent / TOKENIZER_DIR

    @property
    def draft_dir(self) -> Path:
        return self.path / DRAFT_DIR

    @classmethod
    def load(cls, path: str | Path) -> EngineDir:
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"{path}: engine folder not found; build one with `specpipe build` or `make build-engines`")
        rebuild = "rebuild the engine with `specpipe build`"
        cfg = read_json(path / "config.json", "engine config", rebuild)
        side = read_json(path / SPECPIPE_FILE, "engine metadata", rebuild)
        for key in ("pretrained_config", "build_config"):
            if key not in cfg:
                raise UserError(f"{path / 'config.json'}: missing {key!r}; rebuild the engine with `specpipe build`")
        return cls(
            path,
            side.get("backend", "portable"),
            cfg["pretrained_config"],
            cfg["build_config"],
            SpecConfig.from_dict(side.get("speculative", {})),
        )
