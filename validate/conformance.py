"""Drive vLLM's own V1 scheduler and kvsim's with the same request stream, step by step.

vLLM's ``Scheduler`` and ``KVCacheManager`` need no model to run: a ``VllmConfig`` built from
a local config.json, a ``KVCacheConfig`` with one full-attention group and ``num_blocks``,
requests carrying a block hasher, then ``schedule()`` / ``update_from_output()`` with
fabricated sampled tokens. Both sides sample the *same* token ids, so the prefix cache sees
the same content, and every step is compared on: scheduled tokens per request, the preempted
set, free blocks and prefix-hit tokens.

Imports vLLM lazily: only the validation path needs it.
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.config.engine import EngineConfig
from sim.request import Request
from sim.scheduler.scheduler import Scheduler

TINY_MODEL_DIR = Path(__file__).parent / "models" / "tiny-llama"


@dataclass(frozen=True)
class StreamRequest:
    """A request of a conformance stream: added to both engines before step ``arrival_step``."""

    request_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    priority: int = 0


@dataclass(frozen=True)
class Stream:
    """An engine config plus a request stream."""

    config: EngineConfig
    num_gpu_blocks: int
    requests: tuple[StreamRequest, ...]
    max_steps: int = 200


@dataclass(frozen=True)
class StepRecord:
    """What one step decided, in the terms both engines can report."""

    num_scheduled_tokens: tuple[tuple[str, int], ...]
    preempted_ids: frozenset[str]
    num_free_blocks: int
    num_prefix_hit_tokens: int
    num_resumed_prefix_hit_tokens: int
    # Block ids of every scheduled request after allocation: pins the free-queue order.
    block_tables: tuple[tuple[str, tuple[int, ...]], ...]
    # References beyond the first to blocks in use (BatchShape.shared_kv_tokens / block size).
    num_shared_refs: int


@dataclass
class StreamResult:
    steps: list[StepRecord] = field(default_factory=list)
    num_finished: int = 0

    @property
    def num_preemptions(self) -> int:
        return sum(len(s.preempted_ids) for s in self.steps)


def sampled_token_id(request_id: str, index: int) -> int:
    """The token both engines 'sample' for output position ``index`` (stable across processes)."""
    return 3 + zlib.crc32(f"{request_id}/{index}".encode()) % 4000


def _arrival_time(req: StreamRequest) -> float:
    # Distinct, ordered arrival times; ties would be broken by request id on both sides anyway.
    return float(req.arrival_step) + int(req.request_id.removeprefix("r")) * 1e-6


# -- kvsim ------------------------------------------------------------------------------------
def run_sim(stream: Stream) -> StreamResult:
    """Run the stream through kvsim's scheduler."""
    scheduler = Scheduler(stream.config, stream.num_gpu_blocks)
    bs = stream.config.block_size
    pending = sorted(stream.requests, key=lambda r: (r.arrival_step, r.request_id))
    result = StreamResult()
    nxt = 0
    for step in range(stream.max_steps):
        while nxt < len(pending) and pending[nxt].arrival_step <= step:
            r = pending[nxt]
            nxt += 1
            outputs = [sampled_token_id(r.request_id, i) for i in range(r.max_tokens)]
            scheduler.add_request(
                Request(
                    r.request_id,
                    r.prompt_token_ids,
                    r.max_tokens,
                    block_size=bs,
                    arrival_time_s=_arrival_time(r),
                    priority=r.priority,
                    output_token_ids=outputs,
                )
            )
        out = scheduler.schedule()
        block_tables = tuple(
            (rid, tuple(scheduler.kv_cache_manager.block_table(rid)))
            for rid in out.num_scheduled_tokens
        )
        result.num_finished += len(scheduler.update_from_output(out).finished)
        result.steps.append(
            StepRecord(
                num_scheduled_tokens=tuple(out.num_scheduled_tokens.items()),
                preempted_ids=frozenset(out.preempted_ids),
                num_free_blocks=out.num_free_blocks,
                num_prefix_hit_tokens=out.num_prefix_hit_tokens,
                num_resumed_prefix_hit_tokens=out.num_resumed_prefix_hit_tokens,
                block_tables=block_tables,
                num_shared_refs=out.shape.shared_kv_tokens // bs,
            )
        )
        if nxt == len(pending) and not scheduler.has_unfinished_requests():
            break
    return result


# -- vLLM -------------------------------------------------------------------------------------
def vllm_version() -> str:
    import vllm

    return vllm.__version__


def _quiet_vllm() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for name in ("vllm", "vllm.config"):
        logging.getLogger(name).setLevel(logging.ERROR)


class VllmSchedulerFactory:
    """Builds vLLM schedulers for configs; the expensive ``VllmConfig`` is cached per config."""

    def __init__(self) -> None:
        _quiet_vllm()
        self._configs: dict[tuple[Any, ...], Any] = {}
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self._hasher_fn = sha256
        self._get_request_block_hasher = get_request_block_hasher

    def _vllm_config(self, cfg: EngineConfig) -> Any:
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

        key = (
            cfg.block_size,
            cfg.max_num_batched_tokens,
            cfg.max_num_seqs,
            cfg.max_model_len,
            cfg.enable_chunked_prefill,
            cfg.long_prefill_token_threshold,
            cfg.enable_prefix_caching,
            cfg.scheduling_policy,
            cfg.watermark,
        )
        vc = self._configs.get(key)
        if vc is None:
            model = ModelConfig(
                model=str(TINY_MODEL_DIR),
                skip_tokenizer_init=True,
                max_model_len=cfg.max_model_len,
                dtype="bfloat16",
            )
            sched = SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                policy=cfg.scheduling_policy,
                watermark=cfg.watermark,
                is_encoder_decoder=False,
            )
            cache = CacheConfig(
                block_size=cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching
            )
            vc = VllmConfig(
                scheduler_config=sched,
                model_config=model,
                cache_config=cache,
                device_config=DeviceConfig("cpu"),
            )
            self._configs[key] = vc
        return vc

    def make(self, cfg: EngineConfig, num_gpu_blocks: int) -> Any:
        import torch
        from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        vc = self._vllm_config(cfg)
        vc.cache_config.num_gpu_blocks = num_gpu_blocks
        spec = FullAttentionSpec(
            block_size=cfg.block_size, num_kv_heads=1, head_size=16, dtype=torch.float32
        )
        kv_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        return VllmScheduler(
            vllm_config=vc,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=cfg.block_size,
            log_stats=True,
        )

    def block_hasher(self, block_size: int) -> Any:
        return self._get_request_block_hasher(block_size, self._hasher_fn)


def run_vllm(stream: Stream, factory: VllmSchedulerFactory) -> StreamResult:
    """Run the stream through vLLM's own scheduler, fabricating the model's sampled tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VllmRequest

    from validate.recording_scheduler import held_and_shared_refs

    scheduler = factory.make(stream.config, stream.num_gpu_blocks)
    hasher = factory.block_hasher(stream.config.block_size)
    pending = sorted(stream.requests, key=lambda r: (r.arrival_step, r.request_id))
    result = StreamResult()
    nxt = 0
    for step in range(stream.max_steps):
        while nxt < len(pending) and pending[nxt].arrival_step <= step:
            r = pending[nxt]
            nxt += 1
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
            scheduler.add_request(
                VllmRequest(
                    request_id=r.request_id,
                    prompt_token_ids=list(r.prompt_token_ids),
                    sampling_params=params,
                    pooling_params=None,
                    arrival_time=_arrival_time(r),
                    priority=r.priority,
                    block_hasher=hasher,
                )
            )
        out = scheduler.schedule()
        # Stats are recorded at admission, during schedule(): read them before the update.
        stats = scheduler.kv_cache_manager.make_prefix_cache_stats()
        free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        _, num_shared_refs = held_and_shared_refs(scheduler)
        req_ids = list(out.num_scheduled_tokens)
        block_tables = tuple(
            (rid, tuple(scheduler.kv_cache_manager.get_block_ids(rid)[0])) for rid in req_ids
        )
        sampled = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append([sampled_token_id(rid, req.num_output_tokens)])
            else:
                sampled.append([])
        runner_out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        engine_out = scheduler.update_from_output(out, runner_out)
        for outputs in engine_out.values():
            result.num_finished += sum(1 for o in outputs.outputs if o.finished)
        result.steps.append(
            StepRecord(
                num_scheduled_tokens=tuple(out.num_scheduled_tokens.items()),
                preempted_ids=frozenset(out.preempted_req_ids or ()),
                num_free_blocks=free_blocks,
                num_prefix_hit_tokens=stats.hits if stats else 0,
                num_resumed_prefix_hit_tokens=stats.preempted_hits if stats else 0,
                block_tables=block_tables,
                num_shared_refs=num_shared_refs,
            )
        )
        if nxt == len(pending) and not scheduler.has_unfinished_requests():
            break
    return result


def first_divergence(sim: StreamResult, real: StreamResult) -> str | None:
    """Describe the first step where the two runs differ, or None if they agree throughout."""
    for i, (a, b) in enumerate(zip(sim.steps, real.steps, strict=False)):
        if a != b:
            fields = [
                f"{name}: kvsim={getattr(a, name)!r} vllm={getattr(b, name)!r}"
                for name in StepRecord.__dataclass_fields__
                if getattr(a, name) != getattr(b, name)
            ]
            return f"step {i}: " + "; ".join(fields)
    if len(sim.steps) != len(real.steps):
        return f"kvsim ran {len(sim.steps)} steps, vllm {len(real.steps)}"
    if sim.num_finished != real.num_finished:
        return f"finished: kvsim={sim.num_finished} vllm={real.num_finished}"
    return None
