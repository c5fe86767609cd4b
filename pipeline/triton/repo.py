"""Triton model repository for an engine directory, in the tensorrtllm_backend layout.

`repository_files(engine)` is a pure function from the engine's config to {relative path: text};
`write_repository` puts those files on disk atomically. Two flavours share every model but the
engine model: a `trtllm` engine runs in the C++ `tensorrtllm` backend, a `portable` engine in a
decoupled Python-backend model that drives `pipeline.engine.runner.Engine`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.engine.config import EngineDir
from pipeline.engine.scheduler import SchedulerConfig
from pipeline.engine.tree import MC_SIM_7B_63, choices_to_triton
from pipeline.errors import UserError, atomic_output_dir
from pipeline.triton import tensors as T

MODELS_SOURCE_DIR = Path(__file__).parent / "models"
ENSEMBLE, PREPROCESSING, POSTPROCESSING, ENGINE_MODEL, BLS = (
    "ensemble",
    "preprocessing",
    "postprocessing",
    "tensorrt_llm",
    "tensorrt_llm_bls",
)
DRAFT_ENGINE_MODEL = "tensorrt_llm_draft"
LOGITS_DATATYPE = "FP32"
# Defaults of the backend's fill_template examples (docs/model_config.md).
KV_CACHE_FREE_GPU_MEM_FRACTION = "0.9"
BATCH_SCHEDULER_POLICY = "guaranteed_no_evict"
CHECK_PERIOD_MS = "100"
TRTLLM_EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
# specpipe spec mode -> the C++ backend's decoding_mode; other modes keep its sampling default.
TRTLLM_DECODING_MODE = {"medusa": "medusa", "eagle": "eagle"}
DEFAULT_DECODING_MODE = "top_k_top_p"
BACKENDS = ("portable", "trtllm")
SERVING_PARAMETER = "serving"  # the engine model's SchedulerConfig options, as JSON


def _tensor(t: T.Tensor, cls: type) -> object:
    msg = cls(name=t.name, data_type=mc.DataType.Value(f"TYPE_{t.dtype}"), dims=list(t.dims))
    if isinstance(msg, mc.ModelInput):
        msg.optional = t.optional
        msg.allow_ragged_batch = t.ragged
        if t.scalar:
            msg.reshape.SetInParent()  # shape [] : one value per request
    return msg


def _model(
    name: str,
    max_batch_size: int,
    inputs: tuple[T.Tensor, ...],
    outputs: tuple[T.Tensor, ...],
    parameters: dict[str, str],
    *,
    backend: str = "python",
    decoupled: bool = False,
) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, backend=backend, max_batch_size=max_batch_size)
    config.input.extend(_tensor(t, mc.ModelInput) for t in inputs)
    config.output.extend(_tensor(t, mc.ModelOutput) for t in outputs)
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    if decoupled:
        config.model_transaction_policy.decoupled = True
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def preprocessing_config(engine: EngineDir) -> mc.ModelConfig:
    return _model(
        PREPROCESSING,
        engine.limits.max_batch_size,
        T.PREPROCESSING_INPUTS,
        T.PREPROCESSING_OUTPUTS,
        {
            "tokenizer_dir": str(engine.tokenizer_dir),
            "add_special_tokens": "true",
            "max_input_len": str(engine.limits.max_input_len),
        },
    )


def postprocessing_config(engine: EngineDir) -> mc.ModelConfig:
    return _model(
        POSTPROCESSING,
        engine.limits.max_batch_size,
        T.POSTPROCESSING_INPUTS,
        T.POSTPROCESSING_OUTPUTS,
        {"tokenizer_dir": str(engine.tokenizer_dir), "skip_special_tokens": "true"},
    )


def portable_engine_config(
    engine: EngineDir, device: str, name: str = ENGINE_MODEL, serving: dict[str, Any] | None = None
) -> mc.ModelConfig:
    """The engine model; `serving` (SchedulerConfig options: batch, queue, KV cache budget) rides along as
    one JSON parameter when given."""
    parameters = {"engine_dir": str(engine.path), "device": device, "exclude_input_in_output": "false"}
    if serving:
        parameters[SERVING_PARAMETER] = json.dumps(serving, sort_keys=True)
    return _model(name, engine.limits.max_batch_size, T.ENGINE_INPUTS, T.ENGINE_OUTPUTS, parameters, decoupled=True)


def trtllm_engine_parameters(engine_path: Path, engine: EngineDir) -> dict[str, str]:
    """The C++ backend's parameters (all string-valued), filled as its fill_template examples do."""
    mode = engine.spec.mode
    params = {
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": str(engine_path),
        "max_beam_width": "1",
        "batch_scheduler_policy": BATCH_SCHEDULER_POLICY,
        "kv_cache_free_gpu_mem_fraction": KV_CACHE_FREE_GPU_MEM_FRACTION,
        "enable_kv_cache_reuse": "false",
        "enable_chunked_context": "false",
        "exclude_input_in_output": "false",
        "normalize_log_probs": "true",
        "cancellation_check_period_ms": CHECK_PERIOD_MS,
        "stats_check_period_ms": CHECK_PERIOD_MS,
        "executor_worker_path": TRTLLM_EXECUTOR_WORKER,
        "tokenizer_dir": str(engine.tokenizer_dir),
        "decoding_mode": TRTLLM_DECODING_MODE.get(mode, DEFAULT_DECODING_MODE),
        # Tree attention does not support multi-block mode; the runtime turns it off for these modes too.
        "multi_block_mode": "false" if mode in TRTLLM_DECODING_MODE else "true",
    }
    if mode in TRTLLM_DECODING_MODE:
        params[f"{mode}_choices"] = choices_to_triton(engine.spec.choices or MC_SIM_7B_63)
    return params


def trtllm_engine_config(name: str, engine_path: Path, engine: EngineDir) -> mc.ModelConfig:
    config = _model(
        name,
        engine.limits.max_batch_size,
        T.ENGINE_INPUTS,
        T.ENGINE_OUTPUTS,
        trtllm_engine_parameters(engine_path, engine),
        backend="tensorrtllm",
        decoupled=True,
    )
    batching = config.dynamic_batching
    batching.preferred_batch_size.append(engine.limits.max_batch_size)
    batching.max_queue_delay_microseconds = 0
    batching.default_queue_policy.max_queue_size = 0
    return config


def ensemble_config(engine: EngineDir) -> mc.ModelConfig:
    config = mc.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=engine.limits.max_batch_size)
    config.input.extend(_tensor(t, mc.ModelInput) for t in T.ENSEMBLE_INPUTS)
    config.output.extend(_tensor(t, mc.ModelOutput) for t in T.ENSEMBLE_OUTPUTS)
    steps = config.ensemble_scheduling.step
    pre = steps.add(model_name=PREPROCESSING, model_version=-1)
    for outer, inner in T.PREPROCESSING_INPUT_OF.items():
        pre.input_map[inner] = outer
    for out in T.PREPROCESSING_OUTPUTS:
        pre.output_map[out.name] = f"_{out.name}"
    llm = steps.add(model_name=ENGINE_MODEL, model_version=-1)
    for pre_out, inner in T.ENGINE_INPUT_FROM_PREPROCESSING.items():
        llm.input_map[inner] = f"_{pre_out}"
    for outer, inner in T.ENGINE_INPUT_OF.items():
        llm.input_map[inner] = outer
    llm.output_map["output_ids"] = "_TOKENS_BATCH"
    llm.output_map["sequence_length"] = "_SEQUENCE_LENGTH"
    for out in T.PASSTHROUGH_OUTPUTS:
        llm.output_map[out.name] = out.name
    post = steps.add(model_name=POSTPROCESSING, model_version=-1)
    post.input_map["TOKENS_BATCH"] = "_TOKENS_BATCH"
    post.input_map["SEQUENCE_LENGTH"] = "_SEQUENCE_LENGTH"
    post.output_map["OUTPUT"] = "text_output"
    return config


def bls_config(engine: EngineDir, draft_model_name: str) -> mc.ModelConfig:
    return _model(
        BLS,
        engine.limits.max_batch_size,
        T.BLS_INPUTS,
        T.BLS_OUTPUTS,
        {
            "accumulate_tokens": "false",
            "tensorrt_llm_model_name": ENGINE_MODEL,
            "tensorrt_llm_draft_model_name": draft_model_name,
            "multimodal_encoders_name": "",
        },
        decoupled=True,
    )


def _pbtxt(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def _model_source(name: str) -> str:
    return (MODELS_SOURCE_DIR / f"{name}.py").read_text()


REPOSITORY_README = (Path(__file__).parent / "REPOSITORY_README.md").read_text()


def repository_files(engine: EngineDir, device: str = "cpu", serving: dict[str, Any] | None = None) -> dict[str, str]:
    """Every file of the repository as {relative path: text}; empty text for `ensemble/1/.keep`."""
    if engine.backend not in BACKENDS:
        raise UserError(
            f"{engine.path / 'specpipe.json'}: backend {engine.backend!r} is unknown; "
            f"expected one of {', '.join(BACKENDS)}"
        )
    files = {
        "README.md": REPOSITORY_README,  # Triton loads only model folders; this file travels with them
        f"{ENSEMBLE}/config.pbtxt": _pbtxt(ensemble_config(engine)),
        f"{ENSEMBLE}/1/.keep": "",  # Triton needs the version folder; the ensemble has no model file
        f"{PREPROCESSING}/config.pbtxt": _pbtxt(preprocessing_config(engine)),
        f"{PREPROCESSING}/1/model.py": _model_source(PREPROCESSING),
        f"{POSTPROCESSING}/config.pbtxt": _pbtxt(postprocessing_config(engine)),
        f"{POSTPROCESSING}/1/model.py": _model_source(POSTPROCESSING),
        f"{BLS}/1/model.py": _model_source(BLS),
    }
    # A draft-model engine also gets its draft as a model: the BLS model drafts with it and verifies
    # with the target (draft_input_ids), as TensorRT-LLM's BLS does; the ensemble path needs neither.
    draft_model_name = DRAFT_ENGINE_MODEL if engine.spec.mode == "draft_model" else ""
    if engine.backend == "trtllm":
        files[f"{ENGINE_MODEL}/config.pbtxt"] = _pbtxt(trtllm_engine_config(ENGINE_MODEL, engine.path, engine))
        files[f"{ENGINE_MODEL}/1/.keep"] = ""
        if draft_model_name:
            files[f"{DRAFT_ENGINE_MODEL}/config.pbtxt"] = _pbtxt(
                trtllm_engine_config(DRAFT_ENGINE_MODEL, engine.draft_dir, engine)
            )
            files[f"{DRAFT_ENGINE_MODEL}/1/.keep"] = ""
    else:
        files[f"{ENGINE_MODEL}/config.pbtxt"] = _pbtxt(portable_engine_config(engine, device, serving=serving))
        files[f"{ENGINE_MODEL}/1/model.py"] = _model_source(ENGINE_MODEL)
        if draft_model_name:
            draft = EngineDir.load(engine.draft_dir)
            files[f"{DRAFT_ENGINE_MODEL}/config.pbtxt"] = _pbtxt(
                portable_engine_config(draft, device, DRAFT_ENGINE_MODEL)
            )
            files[f"{DRAFT_ENGINE_MODEL}/1/model.py"] = _model_source(ENGINE_MODEL)
    files[f"{BLS}/config.pbtxt"] = _pbtxt(bls_config(engine, draft_model_name))
    return dict(sorted(files.items()))


def write_repository(
    engine_dir: str | Path, output: str | Path, device: str = "cpu", serving: dict[str, Any] | None = None
) -> Path:
    engine = EngineDir.load(Path(engine_dir).resolve())
    if serving:
        SchedulerConfig.from_options(serving)  # a bad option fails here, not when the server loads the model
    files = repository_files(engine, device, serving)
    with atomic_output_dir(output) as tmp:
        for rel, text in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return Path(output)
