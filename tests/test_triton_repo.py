"""Model-repository generation: golden files, protobuf parsing, reference names, both flavours.

Regenerate the golden files after an intended change with `SPECPIPE_REGEN_GOLDEN=1 pytest tests/test_triton_repo.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.engine.config import EngineDir
from pipeline.engine.tree import MC_SIM_7B_63, choices_to_triton
from pipeline.errors import UserError
from pipeline.triton import tensors as T
from pipeline.triton.repo import repository_files, write_repository

GOLDEN_DIR = Path(__file__).parent / "golden" / "triton_repo"
REGENERATE = os.environ.get("SPECPIPE_REGEN_GOLDEN") == "1"
ENGINE_DIR_PLACEHOLDER = "${engine_dir}"
BUILD = {"max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512}
# case -> (backend, speculative config, extra build_config); hand-written engine directories are a
# legitimate generator input: the generator reads only config.json and specpipe.json.
CASES = {
    "portable_plain": ("portable", {"mode": "none"}, {}),
    "portable_medusa": (
        "portable",
        {"mode": "medusa", "max_draft_len": 3, "num_medusa_heads": 2, "choices": [[0], [0, 0], [1]]},
        {"max_draft_len": 3},
    ),
    "trtllm_medusa": (
        "trtllm",
        {"mode": "medusa", "max_draft_len": 63, "num_medusa_heads": 4},
        {"max_draft_len": 63, "speculative_decoding_mode": 4},
    ),
    "trtllm_eagle": (
        "trtllm",
        {"mode": "eagle", "max_draft_len": 3, "choices": [[0], [0, 0], [1]]},
        {"max_draft_len": 3, "speculative_decoding_mode": 32},
    ),
    "trtllm_draft_model": (
        "trtllm",
        {"mode": "draft_model", "max_draft_len": 4},
        {"max_draft_len": 4, "speculative_decoding_mode": 2},
    ),
}


def make_engine_dir(root: Path, backend: str, spec: dict, build_extra: dict) -> Path:
    root.mkdir(parents=True)
    config = {
        "version": "1.2.1",
        "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "float16"},
        "build_config": {**BUILD, **build_extra},
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "specpipe.json").write_text(json.dumps({"backend": backend, "speculative": spec}))
    return root


def generated(tmp_path: Path, case: str) -> dict[str, str]:
    engine = EngineDir.load(make_engine_dir(tmp_path / case, *CASES[case]))
    return {
        rel: text.replace(str(engine.path), ENGINE_DIR_PLACEHOLDER)
        for rel, text in repository_files(engine).items()
        if rel.endswith(".pbtxt")
    }


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_golden_files(tmp_path, case):
    files = generated(tmp_path, case)
    golden = GOLDEN_DIR / case
    if REGENERATE:
        for rel, text in files.items():
            (golden / rel).parent.mkdir(parents=True, exist_ok=True)
            (golden / rel).write_text(text)
    expected = {str(p.relative_to(golden)): p.read_text() for p in golden.rglob("*.pbtxt")}
    assert files == expected, f"regenerate with SPECPIPE_REGEN_GOLDEN=1 if the change is intended ({golden})"


def test_generation_is_pure(tmp_path):
    engine = EngineDir.load(make_engine_dir(tmp_path / "e", *CASES["trtllm_medusa"]))
    assert repository_files(engine) == repository_files(engine)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_config_parses_into_model_config(tmp_path, case):
    for rel, text in generated(tmp_path, case).items():
        config = parse(text)
        assert config.name == rel.split("/")[0]
        if config.platform != "ensemble":
            assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


def _signature(config: mc.ModelConfig, field: str) -> dict[str, tuple[str, list[int]]]:
    return {t.name: (mc.DataType.Name(t.data_type), list(t.dims)) for t in getattr(config, field)}


def test_client_facing_tensors_follow_the_reference(tmp_path):
    files = generated(tmp_path, "portable_plain")
    ensemble = parse(files["ensemble/config.pbtxt"])
    inputs, outputs = _signature(ensemble, "input"), _signature(ensemble, "output")
    assert inputs["text_input"] == ("TYPE_STRING", [1]) and inputs["max_tokens"] == ("TYPE_INT32", [1])
    assert inputs["stop_words"] == ("TYPE_STRING", [-1]) and inputs["bad_words"] == ("TYPE_STRING", [-1])
    for name, dtype in (
        ("stream", "TYPE_BOOL"),
        ("temperature", "TYPE_FP32"),
        ("top_k", "TYPE_INT32"),
        ("top_p", "TYPE_FP32"),
        ("end_id", "TYPE_INT32"),
        ("pad_id", "TYPE_INT32"),
        ("return_perf_metrics", "TYPE_BOOL"),
        ("seed", "TYPE_UINT64"),
    ):
        assert inputs[name] == (dtype, [1]), name
    assert outputs["text_output"] == ("TYPE_STRING", [-1])
    assert outputs["acceptance_rate"] == ("TYPE_FP32", [1])
    assert outputs["total_accepted_draft_tokens"] == ("TYPE_INT32", [1])
    assert outputs["total_draft_tokens"] == ("TYPE_INT32", [1])
    bls = parse(files["tensorrt_llm_bls/config.pbtxt"])
    assert _signature(bls, "output") == outputs
    assert set(_signature(bls, "input")) == set(inputs) | {"num_draft_tokens", "use_draft_logits"}


def test_ensemble_wires_every_step_input_to_a_produced_tensor(tmp_path):
    files = generated(tmp_path, "portable_plain")
    ensemble = parse(files["ensemble/config.pbtxt"])
    available = {t.name for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = parse(files[f"{step.model_name}/config.pbtxt"])
        model_inputs = {t.name for t in model.input}
        model_outputs = {t.name for t in model.output}
        assert set(step.input_map) <= model_inputs, step.model_name
        assert set(step.input_map.values()) <= available, step.model_name
        assert set(step.output_map) <= model_outputs, step.model_name
        required = {t.name for t in model.input if not t.optional}
        assert required <= set(step.input_map), step.model_name
        available |= set(step.output_map.values())
    assert {t.name for t in ensemble.output} <= available


def test_portable_engine_model_is_decoupled_python_with_the_cpp_tensor_names(tmp_path):
    portable = parse(generated(tmp_path, "portable_medusa")["tensorrt_llm/config.pbtxt"])
    cpp = parse(generated(tmp_path, "trtllm_medusa")["tensorrt_llm/config.pbtxt"])
    assert portable.backend == "python" and portable.model_transaction_policy.decoupled
    assert _signature(portable, "input") == _signature(cpp, "input")
    assert _signature(portable, "output") == _signature(cpp, "output")
    assert portable.parameters["engine_dir"].string_value == ENGINE_DIR_PLACEHOLDER


def test_trtllm_flavour_carries_the_reference_parameters(tmp_path):
    config = parse(generated(tmp_path, "trtllm_medusa")["tensorrt_llm/config.pbtxt"])
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert config.backend == "tensorrtllm" and config.model_transaction_policy.decoupled
    assert params["gpt_model_path"] == ENGINE_DIR_PLACEHOLDER
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["decoding_mode"] == "medusa"
    assert params["medusa_choices"] == choices_to_triton(MC_SIM_7B_63)
    assert params["medusa_choices"].startswith("{0}, {0, 0}, {1}")
    for key in (
        "batch_scheduler_policy",
        "kv_cache_free_gpu_mem_fraction",
        "max_beam_width",
        "FORCE_CPU_ONLY_INPUT_TENSORS",
        "enable_kv_cache_reuse",
        "executor_worker_path",
    ):
        assert key in params, key
    assert list(config.dynamic_batching.preferred_batch_size) == [BUILD["max_batch_size"]]
    scalars = {t.name for t in config.input if t.HasField("reshape")}
    assert {"input_lengths", "request_output_len", "temperature", "streaming"} <= scalars

    eagle = parse(generated(tmp_path, "trtllm_eagle")["tensorrt_llm/config.pbtxt"])
    assert eagle.parameters["decoding_mode"].string_value == "eagle"
    assert eagle.parameters["eagle_choices"].string_value == "{0}, {0, 0}, {1}"


def test_draft_model_engines_get_a_draft_model_for_bls(tmp_path):
    files = generated(tmp_path, "trtllm_draft_model")
    bls = parse(files["tensorrt_llm_bls/config.pbtxt"])
    assert bls.parameters["tensorrt_llm_draft_model_name"].string_value == "tensorrt_llm_draft"
    draft = parse(files["tensorrt_llm_draft/config.pbtxt"])
    assert draft.parameters["gpt_model_path"].string_value == f"{ENGINE_DIR_PLACEHOLDER}/draft"


def test_write_repository_layout_and_errors(tmp_path):
    engine = make_engine_dir(tmp_path / "e", *CASES["portable_plain"])
    out = write_repository(engine, tmp_path / "repo")
    assert (out / "ensemble" / "1").is_dir() and not any(p.name != ".keep" for p in (out / "ensemble" / "1").iterdir())
    for model in ("preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):
        assert (out / model / "1" / "model.py").is_file(), model
    with pytest.raises(UserError, match="engine folder not found"):
        write_repository(tmp_path / "missing", tmp_path / "repo2")
    assert not (tmp_path / "repo2").exists()
    bad = make_engine_dir(tmp_path / "bad", "onnx", {"mode": "none"}, {})
    with pytest.raises(UserError, match="backend 'onnx'"):
        write_repository(bad, tmp_path / "repo3")
    assert not (tmp_path / "repo3").exists()


def test_tensor_tables_have_unique_names():
    for table in (T.ENSEMBLE_INPUTS, T.ENSEMBLE_OUTPUTS, T.ENGINE_INPUTS, T.ENGINE_OUTPUTS, T.BLS_INPUTS):
        names = [t.name for t in table]
        assert len(names) == len(set(names))
