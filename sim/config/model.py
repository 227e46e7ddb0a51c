"""Model geometry: the numbers from a model's config.json that size its weights and KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sim.config.limits import MAX_LAYERS, MAX_MODEL_DIM, MAX_PARAMS, MAX_TOKENS, KvsimModel
from sim.config.loading import is_dir, is_file, load_json_object
from sim.errors import KvsimConfigError, format_validation_error, short_repr

Dtype = Literal["bfloat16", "float16", "float32"]

DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}

# Model types whose config.json has no ``attention_bias`` key but whose q/k/v projections
# carry a bias (Qwen2 and Qwen2.5 do; Qwen3 dropped it).
_QKV_BIAS_MODEL_TYPES = frozenset({"qwen2"})


class ModelGeometry(KvsimModel):
    """Shape of a dense (or MoE, via ``num_active_params``) decoder-only transformer."""

    name: str = Field(max_length=200, description="Name shown in reports, e.g. 'Llama-3.1-8B'.")
    num_hidden_layers: int = Field(
        gt=0, le=MAX_LAYERS, description="Decoder layers; each holds its own KV."
    )
    hidden_size: int = Field(gt=0, le=MAX_MODEL_DIM, description="Width of the residual stream.")
    num_attention_heads: int = Field(gt=0, le=MAX_MODEL_DIM, description="Query heads per layer.")
    num_key_value_heads: int = Field(
        gt=0, le=MAX_MODEL_DIM, description="KV heads per layer (fewer than query heads under GQA)."
    )
    head_dim: int = Field(gt=0, le=MAX_MODEL_DIM, description="Width of one attention head.")
    intermediate_size: int = Field(
        gt=0, le=MAX_MODEL_DIM, description="Width of the MLP (gate/up projections)."
    )
    vocab_size: int = Field(
        gt=0, le=MAX_MODEL_DIM, description="Rows of the embedding and of the logits."
    )
    dtype: Dtype = Field("bfloat16", description="Dtype of the weights and of the KV cache.")
    num_params: int = Field(
        gt=0, le=MAX_PARAMS, description="Total parameter count (all experts for MoE)."
    )
    num_active_params: int | None = Field(
        None,
        gt=0,
        le=MAX_PARAMS,
        description="Parameters used per token (MoE); None means all of num_params.",
    )
    tie_word_embeddings: bool = Field(
        False, description="lm_head shares the embedding matrix (no separate lm_head weights)."
    )
    max_position_embeddings: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,
        description="Longest sequence the model was trained for (config.json's "
        "max_position_embeddings); vLLM refuses a larger max_model_len. None: unknown.",
    )
    source_path: str | None = Field(
        None, description="The config.json this geometry was read from (None for presets)."
    )

    @model_validator(mode="after")
    def _check_geometry(self) -> ModelGeometry:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}; each KV head must serve a "
                "whole group of query heads"
            )
        if self.num_active_params is not None and self.num_active_params > self.num_params:
            raise ValueError(
                f"num_active_params={self.num_active_params} exceeds num_params={self.num_params}"
            )
        return self

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one weight or KV element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def active_params(self) -> int:
        """Parameters touched per token (``num_active_params``, else ``num_params``)."""
        return self.num_active_params if self.num_active_params is not None else self.num_params

    def kv_heads_per_rank(self, tensor_parallel_size: int = 1) -> int:
        """KV heads each GPU stores; vLLM replicates KV heads when TP exceeds their number."""
        self.check_tensor_parallel(tensor_parallel_size)
        return max(1, self.num_key_value_heads // tensor_parallel_size)

    def kv_bytes_per_token(self, tensor_parallel_size: int = 1) -> int:
        """Bytes of K and V for one token over all layers, on one GPU."""
        heads = self.kv_heads_per_rank(tensor_parallel_size)
        return self.num_hidden_layers * 2 * heads * self.head_dim * self.dtype_bytes

    def weight_bytes(self, tensor_parallel_size: int = 1) -> int:
        """Weight bytes held by one GPU (all weights, including embeddings, split evenly)."""
        self.check_tensor_parallel(tensor_parallel_size)
        return self.num_params * self.dtype_bytes // tensor_parallel_size

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """Raise if vLLM could not shard this model over ``tensor_parallel_size`` GPUs."""
        tp = tensor_parallel_size
        if tp < 1:
            raise KvsimConfigError(f"tensor_parallel_size={tp} must be at least 1")
        # vLLM's own startup check: query heads are split evenly, KV heads either split
        # evenly or replicated a whole number of times.
        if self.num_attention_heads % tp != 0:
            raise KvsimConfigError(
                f"model {self.name} has num_attention_heads={self.num_attention_heads}, "
                f"which is not divisible by tensor_parallel_size={tp}"
            )
        kv = self.num_key_value_heads
        if kv % tp != 0 and tp % kv != 0:
            raise KvsimConfigError(
                f"model {self.name} has num_key_value_heads={kv}, which neither divides nor "
                f"is divisible by tensor_parallel_size={tp}"
            )


# Geometry copied from each model's config.json on the Hugging Face hub; num_params is the
# safetensors total the hub reports (estimate_num_params reproduces each one exactly).
MODEL_PRESETS: dict[str, ModelGeometry] = {
    m.name: m
    for m in (
        ModelGeometry(
            name="Llama-3.1-8B",
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            dtype="bfloat16",
            num_params=8_030_261_248,
            max_position_embeddings=131_072,
        ),
        ModelGeometry(
            name="Llama-3.1-70B",
            num_hidden_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=128256,
            dtype="bfloat16",
            num_params=70_553_706_496,
            max_position_embeddings=131_072,
        ),
        ModelGeometry(
            name="Qwen2.5-7B",
            num_hidden_layers=28,
            hidden_size=3584,
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=18944,
            vocab_size=152064,
            dtype="bfloat16",
            num_params=7_615_616_512,
            max_position_embeddings=131_072,
        ),
        ModelGeometry(
            name="Qwen2.5-32B",
            num_hidden_layers=64,
            hidden_size=5120,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=27648,
            vocab_size=152064,
            dtype="bfloat16",
            num_params=32_763_876_352,
            max_position_embeddings=131_072,
        ),
        ModelGeometry(
            name="Mistral-7B",
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=32768,
            dtype="bfloat16",
            num_params=7_248_023_552,
            max_position_embeddings=32_768,
        ),
        ModelGeometry(
            name="Llama-2-13B",
            num_hidden_layers=40,
            hidden_size=5120,
            num_attention_heads=40,
            num_key_value_heads=40,
            head_dim=128,
            intermediate_size=13824,
            vocab_size=32000,
            dtype="float16",
            num_params=13_015_864_320,
            max_position_embeddings=4_096,
        ),
    )
}


def estimate_num_params(
    *,
    num_hidden_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    attention_bias: bool = False,
) -> int:
    """Parameter count of a dense Llama-style decoder (gated MLP, RMSNorm without bias)."""
    q_width = num_attention_heads * head_dim
    kv_width = num_key_value_heads * head_dim
    attention = hidden_size * (q_width + 2 * kv_width) + q_width * hidden_size
    if attention_bias:
        attention += q_width + 2 * kv_width  # q/k/v biases; o_proj has none
    mlp = 3 * hidden_size * intermediate_size  # gate, up, down
    norms = 2 * hidden_size  # input and post-attention RMSNorm weights
    per_layer = attention + mlp + norms
    embeddings = vocab_size * hidden_size
    lm_head = 0 if tie_word_embeddings else vocab_size * hidden_size
    return embeddings + num_hidden_layers * per_layer + hidden_size + lm_head


class HfConfigFields(BaseModel):
    """The fields of a Hugging Face config.json that kvsim reads, with their types checked
    before any arithmetic on them (other keys are ignored, as vLLM ignores what it does not
    use)."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False, strict=True)

    num_hidden_layers: int = Field(gt=0, le=MAX_LAYERS, description="Decoder layers.")
    hidden_size: int = Field(gt=0, le=MAX_MODEL_DIM, description="Residual stream width.")
    num_attention_heads: int = Field(gt=0, le=MAX_MODEL_DIM, description="Query heads.")
    num_key_value_heads: int | None = Field(
        None, gt=0, le=MAX_MODEL_DIM, description="KV heads; None: as many as query heads."
    )
    head_dim: int | None = Field(
        None, gt=0, le=MAX_MODEL_DIM, description="Head width; None: hidden_size // heads."
    )
    intermediate_size: int = Field(gt=0, le=MAX_MODEL_DIM, description="MLP width.")
    vocab_size: int = Field(gt=0, le=MAX_MODEL_DIM, description="Vocabulary rows.")
    tie_word_embeddings: bool = Field(False, description="lm_head shares the embeddings.")
    dtype: str | None = Field(None, description="Weight dtype (transformers >= 4.56).")
    torch_dtype: str | None = Field(None, description="Weight dtype (older transformers).")
    num_params: int | None = Field(None, gt=0, le=MAX_PARAMS, description="Total parameters.")
    num_active_params: int | None = Field(
        None, gt=0, le=MAX_PARAMS, description="Parameters used per token (MoE)."
    )
    attention_bias: bool | None = Field(None, description="q/k/v projections carry a bias.")
    model_type: str | None = Field(None, description="Architecture family, e.g. 'llama'.")
    max_position_embeddings: int | None = Field(
        None, gt=0, description="Longest trained sequence (vLLM's max_model_len bound)."
    )


def load_model_config_json(path: str | Path, name: str | None = None) -> ModelGeometry:
    """Read a Hugging Face config.json into a ModelGeometry.

    Missing ``num_key_value_heads`` means multi-head attention, missing ``head_dim`` means
    ``hidden_size // num_attention_heads``, missing dtype means bfloat16. ``num_params`` is
    taken from the file when present (kvsim's shipped configs carry it), else estimated with
    :func:`estimate_num_params`. ``name`` defaults to the folder holding the file. A file
    that is not a JSON object, or whose fields have the wrong type or an impossible value,
    raises KvsimConfigError naming the file and the field.
    """
    path = Path(path)
    source = f"model config {path}"
    raw = load_json_object(path, "model config")
    try:
        fields = HfConfigFields.model_validate(raw)
    except ValidationError as exc:
        raise KvsimConfigError(format_validation_error(exc, source)) from None
    num_heads = fields.num_attention_heads
    head_dim = fields.head_dim or fields.hidden_size // num_heads
    if head_dim < 1:
        raise KvsimConfigError(
            f"{source}: hidden_size={fields.hidden_size} // num_attention_heads={num_heads} "
            "is 0; give head_dim"
        )
    geometry = {
        "num_hidden_layers": fields.num_hidden_layers,
        "hidden_size": fields.hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": fields.num_key_value_heads or num_heads,
        "head_dim": head_dim,
        "intermediate_size": fields.intermediate_size,
        "vocab_size": fields.vocab_size,
        "tie_word_embeddings": fields.tie_word_embeddings,
    }
    # transformers >= 4.56 writes "dtype"; older files say "torch_dtype".
    dtype_key = "dtype" if fields.dtype else "torch_dtype"
    dtype = fields.dtype or fields.torch_dtype or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise KvsimConfigError(
            f"{source}: {dtype_key} = {short_repr(dtype)}: kvsim knows {', '.join(DTYPE_BYTES)}"
        )
    num_params = fields.num_params
    if num_params is None:
        attention_bias = fields.attention_bias
        if attention_bias is None:
            attention_bias = fields.model_type in _QKV_BIAS_MODEL_TYPES
        num_params = estimate_num_params(**geometry, attention_bias=attention_bias)
    default_name = path.parent.name if path.name == "config.json" else path.stem
    max_position_embeddings = fields.max_position_embeddings
    if max_position_embeddings is not None:
        # Beyond kvsim's token bound, the model's own bound never binds.
        max_position_embeddings = min(max_position_embeddings, MAX_TOKENS)
    try:
        return ModelGeometry(
            name=name or default_name or str(path),
            dtype=dtype,
            num_params=num_params,
            num_active_params=fields.num_active_params,
            max_position_embeddings=max_position_embeddings,
            source_path=str(path.resolve()),
            **geometry,
        )
    except ValidationError as exc:
        raise KvsimConfigError(format_validation_error(exc, source)) from None


def resolve_model(name_or_path: str | Path | ModelGeometry) -> ModelGeometry:
    """A preset (case-insensitive name), a config.json, or a folder holding one."""
    if isinstance(name_or_path, ModelGeometry):
        return name_or_path
    by_lower_name = {key.lower(): model for key, model in MODEL_PRESETS.items()}
    preset = by_lower_name.get(str(name_or_path).lower())
    if preset is not None:
        return preset
    path = Path(name_or_path)
    if is_dir(path) and is_file(path / "config.json"):
        return load_model_config_json(path / "config.json")
    if is_file(path):
        return load_model_config_json(path)
    raise KvsimConfigError(
        f"model {short_repr(str(name_or_path))} is neither a preset "
        f"({', '.join(MODEL_PRESETS)}) nor a path to a config.json"
    )
