"""Open-loop traffic: requests arrive at sampled times whether or not earlier ones finished."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Literal

import numpy as np
from pydantic import Field

from sim.config.limits import MAX_REQUESTS, MAX_TOKENS, MAX_VOCAB_SIZE, KvsimModel
from sim.request import Request
from sim.workload.base import RequestMeta, RequestSink, WorkloadRun
from sim.workload.distributions import (
    DEFAULT_PRIORITY_CLASSES,
    ArrivalProcess,
    FixedLength,
    LengthDist,
    PoissonArrivals,
    PriorityClasses,
    sample_priority_classes,
)
from sim.workload.tokens import DEFAULT_VOCAB_SIZE, MIN_TOKEN_ID, Context, TokenSource


class OpenLoopWorkload(KvsimModel):
    """Independent requests at sampled arrival times (the classic serving benchmark).

    A request's prompt is ``shared_prefix_tokens`` common tokens followed by a unique part of
    ``prompt_tokens`` tokens (as vLLM's random dataset adds its prefix length to the input
    length). Lengths are clipped so prompt + output never exceeds the engine's max_model_len:
    the unique part is cut first, then the output.
    """

    kind: Literal["open_loop"] = "open_loop"
    num_requests: int = Field(gt=0, le=MAX_REQUESTS, description="Requests to submit.")
    arrival: ArrivalProcess = Field(
        PoissonArrivals(rate_per_s=1.0), description="When requests arrive."
    )
    prompt_tokens: LengthDist = Field(
        FixedLength(value=1024), description="Unique prompt tokens per request (after the prefix)."
    )
    output_tokens: LengthDist = Field(
        FixedLength(value=128), description="Output tokens each request generates."
    )
    shared_prefix_tokens: int = Field(
        0,
        ge=0,
        le=MAX_TOKENS,
        description="Tokens of a prefix common to every prompt (a system prompt).",
    )
    priority_classes: PriorityClasses = Field(
        list(DEFAULT_PRIORITY_CLASSES), description="Traffic classes; each request draws one."
    )
    vocab_size: int = Field(
        DEFAULT_VOCAB_SIZE,
        gt=MIN_TOKEN_ID,
        le=MAX_VOCAB_SIZE,
        description="Token ids are drawn below this.",
    )

    def expected_num_requests(self) -> int | None:
        """Exactly ``num_requests``."""
        return self.num_requests

    def start(self, sink: RequestSink, rng: np.random.Generator) -> WorkloadRun:
        """Plan every request's time, lengths and class now; submit them from one process."""
        # Children, not ``rng`` itself: the token stream must not depend on who else draws
        # from the run's generator while the simulation runs.
        plan_rng, token_rng = rng.spawn(2)
        n = self.num_requests
        times_s = self.arrival.arrival_times(plan_rng, n)
        prompt_lens = self.prompt_tokens.sample(plan_rng, n)
        output_lens = self.output_tokens.sample(plan_rng, n)
        class_ids = sample_priority_classes(plan_rng, self.priority_classes, n)
        fitted_prompts, fitted_outputs = _clip_to_model_len(
            self.shared_prefix_tokens, prompt_lens, output_lens, sink.max_model_len
        )
        clipped = (fitted_prompts < prompt_lens) | (fitted_outputs < output_lens)
        run = WorkloadRun(n)  # clipped requests are counted as submitted: a cut run sends fewer
        sink.env.process(
            self._submit_all(
                sink,
                run,
                TokenSource(token_rng, self.vocab_size),
                times_s,
                fitted_prompts,
                fitted_outputs,
                class_ids,
                clipped,
            )
        )
        return run

    def _submit_all(
        self,
        sink: RequestSink,
        run: WorkloadRun,
        tokens: TokenSource,
        times_s: np.ndarray,
        prompt_lens: np.ndarray,
        output_lens: np.ndarray,
        class_ids: np.ndarray,
        clipped: np.ndarray,
    ) -> Generator[Any, Any, None]:
        env = sink.env
        prefix = Context(sink.block_size, tokens.take(self.shared_prefix_tokens))
        for i, (t_s, prompt_len, output_len, class_id, cut) in enumerate(
            zip(
                times_s.tolist(),
                prompt_lens.tolist(),
                output_lens.tolist(),
                class_ids.tolist(),
                clipped.tolist(),
                strict=True,
            )
        ):
            if t_s > env.now:
                yield env.timeout(t_s - env.now)
            if cut:
                run.requests_clipped += 1
            unique = tokens.take(prompt_len)
            outputs = tokens.take(output_len)
            cls = self.priority_classes[class_id]
            request = Request(
                f"req-{i}",
                prefix.token_ids + unique,
                max_tokens=output_len,
                block_size=sink.block_size,
                arrival_time_s=env.now,
                priority=cls.priority,
                output_token_ids=outputs,
                prompt_block_hashes=prefix.block_hashes_with(unique),
            )
            sink.submit(request, RequestMeta(priority_class=cls.name))


def _clip_to_model_len(
    prefix_len: int, prompt_lens: np.ndarray, output_lens: np.ndarray, max_model_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Cut the unique prompt part, then the output, so every request fits ``max_model_len``."""
    if prefix_len + 2 > max_model_len:
        raise ValueError(
            f"shared_prefix_tokens={prefix_len} leaves no room for a prompt token and an output "
            f"token within max_model_len={max_model_len}"
        )
    prompt_lens = np.clip(prompt_lens, 1, np.maximum(1, max_model_len - prefix_len - output_lens))
    output_lens = np.minimum(output_lens, max_model_len - prefix_len - prompt_lens)
    return prompt_lens, output_lens
