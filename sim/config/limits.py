"""Upper bounds on every number a scenario, model config or trace may hold, and the pydantic
settings every config model shares.

The simulator allocates per token, per block, per request and per session, so a number far
beyond any real deployment (``workload.sessions=1000000000``) would not fail, it would grow
memory until the machine gives up. Each bound here is far above what a real vLLM deployment
reaches, and is checked while parsing, before anything is allocated; the error names the
field and the bound. Non-finite numbers (``.inf``, ``.nan``) are refused everywhere.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Every config model: unknown keys are errors, parsed configs are immutable, no inf / nan.
STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

# Tokens in one prompt, output or context (2M: above every released model's context window;
# the simulator holds a request's token ids in memory).
MAX_TOKENS = 1 << 21
# Requests one open-loop workload or trace submits.
MAX_REQUESTS = 1_000_000
# Agent sessions (each is a SimPy process with its own generator).
MAX_SESSIONS = 100_000
# Turns of one session, parallel sub-calls of one fan-out.
MAX_TURNS = 100_000
MAX_FANOUT_WIDTH = 1024
# KV blocks of one GPU (each is a Python object in the simulated block pool).
MAX_NUM_GPU_BLOCKS = 1 << 22
# Requests running in one step (vLLM's max_num_seqs).
MAX_NUM_SEQS = 1 << 16
# Tensor-parallel degree.
MAX_TENSOR_PARALLEL = 1024
# Simulated time: 1 year of seconds (arrivals, tool latencies, run limits, timestamps).
MAX_SECONDS = 365 * 24 * 3600.0
# Rates: at most a million arrivals per simulated second, at least one per year.
MIN_RATE_PER_S = 1.0 / MAX_SECONDS
MAX_RATE_PER_S = 1e6
# Token vocabulary size.
MAX_VOCAB_SIZE = 1 << 30
# Model geometry: any one dimension, and the parameter count (100 trillion).
MAX_MODEL_DIM = 1 << 24
MAX_LAYERS = 10_000
MAX_PARAMS = 10**14
# Hardware: 1 PiB of HBM; bandwidths up to 1 PB/s, compute up to 1 EFLOP/s.
MAX_HBM_BYTES = 1 << 50
MAX_BANDWIDTH_BYTES_PER_S = 1e15
MAX_FLOPS_PER_S = 1e18
# Bandwidths and compute below 1 MB/s (1 MFLOP/s) are typos, and would price a step at years.
MIN_RATE_BYTES_PER_S = 1e6
# Seeds: numpy's generators take non-negative integers; 2**63 is plenty.
MAX_SEED = (1 << 63) - 1
# vLLM request priorities are ints; kept within 32 bits.
MAX_ABS_PRIORITY = 1 << 31
# Relative weights of priority classes.
MAX_WEIGHT = 1e9
# Input files: scenario and model config (10 MiB), trace and length files (1 GiB).
MAX_CONFIG_FILE_BYTES = 10 << 20
MAX_DATA_FILE_BYTES = 1 << 30
# Expanded YAML nodes: an alias may repeat a subtree, but the whole document may not expand
# beyond this (a "billion laughs" document is refused without being expanded).
MAX_YAML_NODES = 100_000

Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
PositiveTokens = Annotated[int, Field(gt=0, le=MAX_TOKENS)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
PositiveSeconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
RatePerS = Annotated[float, Field(ge=MIN_RATE_PER_S, le=MAX_RATE_PER_S)]
VocabSize = Annotated[int, Field(le=MAX_VOCAB_SIZE)]
Priority = Annotated[int, Field(ge=-MAX_ABS_PRIORITY, le=MAX_ABS_PRIORITY)]


def _numeric(annotation: Any) -> tuple[bool, bool]:
    """(is a number, is a list of numbers) for a field annotation; bool fields are neither."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _numeric(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if bool in args:
            return False, False
        found = [_numeric(a) for a in args]
        return any(f[0] for f in found), any(f[1] for f in found)
    if origin is list:
        (item,) = get_args(annotation) or (Any,)
        return False, _numeric(item)[0]
    return annotation in (int, float), False


class KvsimModel(BaseModel):
    """Base of every config model: :data:`STRICT`, and ``true``/``false`` are not numbers
    (pydantic would read ``max_model_len: true`` as 1)."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            if not (
                isinstance(value, bool)
                or (isinstance(value, list) and any(isinstance(v, bool) for v in value))
            ):
                continue
            field = cls.model_fields.get(key) if isinstance(key, str) else None
            if field is None:
                continue
            number, numbers = _numeric(field.annotation)
            if (number and isinstance(value, bool)) or (numbers and isinstance(value, list)):
                raise ValueError(f"{key} = {value}: a number is needed, not true/false")
        return data
