import json

import pytest
from pydantic import ValidationError

from sim.config.model import (
    MODEL_PRESETS,
    ModelGeometry,
    estimate_num_params,
    load_model_config_json,
    resolve_model,
)

# Fields of Llama-3.1-8B's config.json on the Hugging Face hub (the ones kvsim reads).
LLAMA_3_1_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

# Qwen2.5-7B's config.json: no head_dim, no attention_bias (Qwen2 always has q/k/v biases).
QWEN2_5_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 152064,
}


def make_geometry(**overrides):
    fields = MODEL_PRESETS["Llama-3.1-8B"].model_dump() | overrides
    return ModelGeometry(**fields)


@pytest.mark.parametrize(
    ("name", "kv_bytes_per_token"),
    [("Llama-3.1-8B", 131_072), ("Llama-3.1-70B", 327_680), ("Llama-2-13B", 819_200)],
)
def test_kv_bytes_per_token_of_anchor_models(name, kv_bytes_per_token):
    assert MODEL_PRESETS[name].kv_bytes_per_token() == kv_bytes_per_token


def test_kv_heads_are_split_by_tp_then_replicated():
    model = MODEL_PRESETS["Llama-3.1-70B"]  # 8 KV heads
    assert model.kv_bytes_per_token(4) == 327_680 // 4
    assert model.kv_bytes_per_token(8) == 327_680 // 8
    # 16 ranks share 8 KV heads: each rank still stores one whole head.
    assert model.kv_heads_per_rank(16) == 1
    assert model.kv_bytes_per_token(16) == 327_680 // 8


def test_tp_that_does_not_divide_heads_raises():
    with pytest.raises(ValueError, match=r"num_attention_heads=64.*tensor_parallel_size=3"):
        MODEL_PRESETS["Llama-3.1-70B"].kv_bytes_per_token(3)


def test_weight_bytes_per_gpu():
    model = MODEL_PRESETS["Llama-3.1-70B"]
    assert model.dtype_bytes == 2
    assert model.weight_bytes() == 141_107_412_992
    assert model.weight_bytes(4) == 35_276_853_248


def test_llama_2_is_float16():
    assert MODEL_PRESETS["Llama-2-13B"].dtype == "float16"
    assert all(m.dtype == "bfloat16" for n, m in MODEL_PRESETS.items() if n != "Llama-2-13B")


def test_active_params_default_to_num_params():
    model = MODEL_PRESETS["Llama-3.1-8B"]
    assert model.active_params == 8_030_261_248
    assert make_geometry(num_active_params=1_000).active_params == 1_000


def test_heads_not_divisible_by_kv_heads_is_rejected_with_numbers():
    with pytest.raises(ValidationError, match=r"num_attention_heads=32.*num_key_value_heads=6"):
        make_geometry(num_key_value_heads=6)


def test_active_params_above_total_is_rejected():
    with pytest.raises(ValidationError, match=r"num_active_params=9.*num_params=8"):
        make_geometry(num_params=8, num_active_params=9)


def test_unknown_field_and_dtype_are_rejected():
    with pytest.raises(ValidationError):
        make_geometry(num_experts=8)
    with pytest.raises(ValidationError):
        make_geometry(dtype="fp8")


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_param_formula_matches_every_preset(name):
    model = MODEL_PRESETS[name]
    estimate = estimate_num_params(
        num_hidden_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        intermediate_size=model.intermediate_size,
        vocab_size=model.vocab_size,
        tie_word_embeddings=model.tie_word_embeddings,
        attention_bias=name.startswith("Qwen"),
    )
    assert abs(estimate - model.num_params) <= 0.01 * model.num_params
    assert estimate == model.num_params


def write_config(tmp_path, config, folder="model"):
    path = tmp_path / folder / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


def test_load_llama_config_json_matches_preset(tmp_path):
    path = write_config(tmp_path, LLAMA_3_1_8B_CONFIG, folder="Llama-3.1-8B")
    model = load_model_config_json(path)
    assert model.source_path == str(path.resolve())
    assert model.model_copy(update={"source_path": None}) == MODEL_PRESETS["Llama-3.1-8B"]


def test_load_qwen_config_json_counts_qkv_biases(tmp_path):
    model = load_model_config_json(write_config(tmp_path, QWEN2_5_7B_CONFIG), name="qwen")
    preset = MODEL_PRESETS["Qwen2.5-7B"]
    assert model.name == "qwen"
    assert model.head_dim == 128  # hidden_size // num_attention_heads
    assert abs(model.num_params - preset.num_params) <= 0.01 * preset.num_params
    assert model.num_params == 7_615_616_512


def test_load_config_json_defaults(tmp_path):
    config = {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
        "num_params": 12_345,
    }
    model = load_model_config_json(write_config(tmp_path, config, folder="tiny"))
    assert model.name == "tiny"
    assert model.num_key_value_heads == 8
    assert model.head_dim == 64
    assert model.dtype == "bfloat16"
    assert model.num_params == 12_345  # taken from the file, not estimated


def test_load_config_json_reads_new_dtype_key(tmp_path):
    config = dict(LLAMA_3_1_8B_CONFIG, dtype="float16")
    del config["torch_dtype"]
    assert load_model_config_json(write_config(tmp_path, config)).dtype == "float16"


def test_load_config_json_rejects_unknown_dtype_and_missing_fields(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(dict(LLAMA_3_1_8B_CONFIG, torch_dtype="int8")))
    with pytest.raises(ValueError, match="'int8'"):
        load_model_config_json(tmp_path / "a.json")
    (tmp_path / "b.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="num_hidden_layers: Field required"):
        load_model_config_json(tmp_path / "b.json")


def test_resolve_model_by_preset_name_is_case_insensitive():
    assert resolve_model("llama-3.1-70b") is MODEL_PRESETS["Llama-3.1-70B"]
    assert resolve_model("Llama-3.1-70B") is MODEL_PRESETS["Llama-3.1-70B"]


def test_resolve_model_by_file_or_folder(tmp_path):
    path = write_config(tmp_path, LLAMA_3_1_8B_CONFIG, folder="m")
    assert resolve_model(path).num_params == 8_030_261_248
    assert resolve_model(str(path.parent)).num_params == 8_030_261_248


def test_resolve_unknown_model_lists_presets():
    with pytest.raises(ValueError) as info:
        resolve_model("foo")
    message = str(info.value)
    assert message.startswith("model 'foo' is neither a preset (Llama-3.1-8B, ")
    assert message.endswith("nor a path to a config.json")
    for name in MODEL_PRESETS:
        assert name in message
