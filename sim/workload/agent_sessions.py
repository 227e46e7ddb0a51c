"""Closed-loop agent sessions: each turn re-sends the whole, growing context.

A session starts with a system prompt and tool schemas shared by every session, then the user's
message. Each turn submits the context so far, waits for the output, appends it, waits for the
tool (sim time), appends the tool result and goes again, so turn k+1's prompt is turn k's prompt
plus turn k's output plus the new tool result, token for token. That is the traffic whose
prefix-cache hit rate and KV growth the simulator exists to study.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from sim.config.limits import (
    MAX_FANOUT_WIDTH,
    MAX_SESSIONS,
    MAX_TOKENS,
    MAX_TURNS,
    MAX_VOCAB_SIZE,
    KvsimModel,
)
from sim.request import Request
from sim.workload.base import RequestMeta, RequestSink, SessionHint, WorkloadRun
from sim.workload.distributions import (
    DEFAULT_PRIORITY_CLASSES,
    ArrivalProcess,
    FixedLength,
    LatencyDist,
    LengthDist,
    LogNormalLatency,
    LogNormalLength,
    PoissonArrivals,
    PriorityClass,
    PriorityClasses,
    UniformLength,
    sample_priority_classes,
)
from sim.workload.tokens import DEFAULT_VOCAB_SIZE, MIN_TOKEN_ID, Context, TokenSource


class FanoutConfig(KvsimModel):
    """Sub-agents: some turns launch ``width`` parallel calls on the turn's full context."""

    probability: float = Field(ge=0, le=1, description="Chance that a turn fans out.")
    width: int = Field(
        ge=1, le=MAX_FANOUT_WIDTH, description="Parallel sub-agent calls in a fan-out turn."
    )
    task_tokens: LengthDist = Field(
        FixedLength(value=64), description="Unique tokens each sub-call adds after the context."
    )
    output_tokens: LengthDist = Field(
        FixedLength(value=256), description="Output tokens of each sub-call."
    )


class AgentSessionsWorkload(KvsimModel):
    """Agent sessions whose context grows every turn, separated by tool waits."""

    kind: Literal["agent_sessions"] = "agent_sessions"
    sessions: int = Field(gt=0, le=MAX_SESSIONS, description="Number of sessions.")
    session_arrival: ArrivalProcess = Field(
        PoissonArrivals(rate_per_s=1.0), description="When sessions start."
    )
    turns: LengthDist = Field(
        FixedLength(value=10),
        description="Turns per session (published: median 43 in vLLM's agent study, SWE-bench "
        "10.9, BFCL 6.3).",
    )
    system_prompt_tokens: int = Field(
        2000, ge=0, le=MAX_TOKENS, description="System prompt tokens, identical in every session."
    )
    tool_schema_tokens: int = Field(
        1500,
        ge=0,
        le=MAX_TOKENS,
        description="Tool schema tokens after the system prompt, shared by all.",
    )
    user_message_tokens: LengthDist = Field(
        LogNormalLength(median=200, sigma=0.8, min=16, max=4000),
        description="Tokens of the user's first message (turn 0).",
    )
    tool_result_tokens: LengthDist = Field(
        LogNormalLength(median=1000, sigma=1.0, min=16, max=8000),
        description="Tokens of the tool result appended before each later turn.",
    )
    output_tokens: LengthDist = Field(
        LogNormalLength(median=200, sigma=0.8, min=8, max=2048),
        description="Output tokens of each turn's request.",
    )
    tool_latency: LatencyDist = Field(
        LogNormalLatency(median_s=1.5, p95_s=20.0),
        description="Sim time between a turn's last token and the next turn's submission.",
    )
    fanout: FanoutConfig | None = Field(None, description="Sub-agent fan-out; None: never.")
    priority_classes: PriorityClasses = Field(
        list(DEFAULT_PRIORITY_CLASSES), description="Traffic classes; each session draws one."
    )
    max_context_tokens: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,
        description="A session ends when its next prompt + output would exceed this (or the "
        "engine's max_model_len, whichever is smaller).",
    )
    vocab_size: int = Field(
        DEFAULT_VOCAB_SIZE,
        gt=MIN_TOKEN_ID,
        le=MAX_VOCAB_SIZE,
        description="Token ids are drawn below this.",
    )

    @model_validator(mode="after")
    def _check_turns(self) -> AgentSessionsWorkload:
        """At most MAX_TURNS turns a session: a bound beyond it is refused; draws beyond it
        (a lognormal without ``max``, an empirical file) are cut to it in ``start``."""
        turns = self.turns
        highest = (
            turns.value
            if isinstance(turns, FixedLength)
            else turns.high
            if isinstance(turns, UniformLength)
            else max(turns.min, turns.max or 0)
            if isinstance(turns, LogNormalLength)
            else max(turns.values or [0])
        )
        if highest > MAX_TURNS:
            raise ValueError(
                f"turns: a session of up to {highest:,} turns is beyond kvsim's limit of "
                f"{MAX_TURNS:,} turns per session"
            )
        return self

    @model_validator(mode="after")
    def _check_context_cap(self) -> AgentSessionsWorkload:
        shared = self.system_prompt_tokens + self.tool_schema_tokens
        if self.max_context_tokens is not None and shared >= self.max_context_tokens:
            raise ValueError(
                f"system_prompt_tokens + tool_schema_tokens = {shared} leaves no room under "
                f"max_context_tokens={self.max_context_tokens}"
            )
        return self

    def expected_num_requests(self) -> int | None:
        """Sum of the sessions' turns, known before a run only if turns are fixed (a run's
        own count is its :class:`WorkloadRun`); None with fan-out. Sessions cut short by
        max_context_tokens submit fewer."""
        if self.fanout is not None:
            return None
        if isinstance(self.turns, FixedLength):
            return self.sessions * self.turns.value
        return None

    def start(self, sink: RequestSink, rng: np.random.Generator) -> WorkloadRun:
        """Plan sessions (start time, turns, class) and spawn one SimPy process per session."""
        # One child generator per session: a session's tokens, lengths and tool latencies do
        # not depend on how the engine interleaves sessions, so two engine configs run with the
        # same seed see the same sessions.
        prefix_rng, plan_rng, *session_rngs = rng.spawn(2 + self.sessions)
        start_times_s = self.session_arrival.arrival_times(plan_rng, self.sessions)
        num_turns = np.minimum(self.turns.sample(plan_rng, self.sessions), MAX_TURNS)
        class_ids = sample_priority_classes(plan_rng, self.priority_classes, self.sessions)
        shared = TokenSource(prefix_rng, self.vocab_size).take(
            self.system_prompt_tokens + self.tool_schema_tokens
        )
        # Hashed once; every session forks it, so the shared prefix is identical token for token.
        prefix = Context(sink.block_size, shared)
        # Turn counts are only known once drawn (sessions cut short by max_context_tokens
        # submit fewer); a fan-out's sub-calls are not counted in advance.
        run = WorkloadRun(
            None if self.fanout is not None else int(num_turns.sum()),
            sessions_planned=self.sessions,
            context_cap_tokens=self._context_cap(sink),
        )
        for session_id in range(self.sessions):
            sink.env.process(
                self._session(
                    sink,
                    session_id,
                    float(start_times_s[session_id]),
                    int(num_turns[session_id]),
                    self.priority_classes[int(class_ids[session_id])],
                    prefix,
                    session_rngs[session_id],
                    run,
                )
            )
        return run

    def _context_cap(self, sink: RequestSink) -> int:
        """The most tokens a turn's prompt and output may hold: a session whose next turn
        would pass it ends."""
        if self.max_context_tokens is None:
            return sink.max_model_len
        return min(sink.max_model_len, self.max_context_tokens)

    def _session(
        self,
        sink: RequestSink,
        session_id: int,
        start_s: float,
        num_turns: int,
        cls: PriorityClass,
        prefix: Context,
        rng: np.random.Generator,
        run: WorkloadRun,
    ) -> Generator[Any, Any, None]:
        env = sink.env
        tokens = TokenSource(rng, self.vocab_size)
        cap = self._context_cap(sink)
        if start_s > env.now:
            yield env.timeout(start_s - env.now)
        # Forked once the session starts: a session not started yet holds no copy.
        context = prefix.copy()
        run.sessions_started += 1
        run.open_sessions.add(session_id)
        for turn in range(num_turns):
            piece_dist = self.user_message_tokens if turn == 0 else self.tool_result_tokens
            piece = tokens.take(piece_dist.sample_one(rng))
            fanout = self.fanout
            is_fanout = fanout is not None and rng.random() < fanout.probability
            if is_fanout:
                tasks = [tokens.take(n) for n in fanout.task_tokens.sample(rng, fanout.width)]
                outputs = [tokens.take(n) for n in fanout.output_tokens.sample(rng, fanout.width)]
            else:
                tasks = [[]]
                outputs = [tokens.take(self.output_tokens.sample_one(rng))]
            longest = max(len(task) + len(out) for task, out in zip(tasks, outputs, strict=True))
            if len(context) + len(piece) + longest > cap:
                # The context no longer fits: the session ends, as an agent's would.
                run.sessions_cut_by_context += 1
                run.turns_not_sent += num_turns - turn
                break
            context.append(piece)
            done = []
            returns = turn + 1 < num_turns
            for j, (task, out) in enumerate(zip(tasks, outputs, strict=True)):
                request_id = (
                    f"s{session_id}-t{turn}-f{j}" if is_fanout else f"s{session_id}-t{turn}"
                )
                request = Request(
                    request_id,
                    context.token_ids + task if task else context.token_ids,
                    # A plain turn hands its context over: the request's output tokens go
                    # straight into it (no copy of the prompt per turn).
                    adopt_prompt=not is_fanout,
                    max_tokens=len(out),
                    block_size=sink.block_size,
                    arrival_time_s=env.now,
                    priority=cls.priority,
                    output_token_ids=out,
                    prompt_block_hashes=(
                        context.block_hashes_with(task) if task else context.block_hashes
                    ),
                    # The next turn re-sends a plain turn whole; of a fan-out only the
                    # context, kept once (by the first sub-call).
                    session_hint=SessionHint(
                        session_id,
                        returns and j == 0,
                        len(context) if is_fanout else None,
                        self.tool_latency,
                    ),
                )
                meta = RequestMeta(
                    session_id=session_id,
                    turn=turn,
                    priority_class=cls.name,
                    subcall=j if is_fanout else None,
                )
                done.append(sink.submit(request, meta))
            yield env.all_of(done)
            # The context grows by what the engine really emitted: the planned tokens in the
            # simulator, the model's own tokens when replayed on real vLLM. A plain turn's
            # request wrote them into the context itself; sub-call outputs come back in call
            # order, like the results of a parallel call.
            if is_fanout:
                for event in done:
                    context.append(event.value.output_token_ids)
                del event
            else:
                request.release()  # it keeps a view of its tokens; the context grows on
                context.hash_new_blocks()
            # Nothing of the finished turn is kept through the tool call: a fan-out's
            # requests hold a copy of the whole context.
            del done, request, tasks, outputs
            if turn + 1 < num_turns:
                yield env.timeout(float(self.tool_latency.sample(rng, 1)[0]))
        run.open_sessions.discard(session_id)
