"""Scheduler speed: engine steps per second of ``schedule()`` + ``update_from_output()``.

All cases: 256 requests with 1000-token prompts (unique per request), block size 16,
``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192, prefix caching on. Each case runs an
untimed warm-up, then times ``--steps`` steps.

- ``decode``: ample KV blocks and a ``max_tokens`` nobody reaches. After the warm-up every
  request is running and past its prefill: pure decode steps, 256 tokens each.
- ``pressure``: the same requests in a pool that holds the prompts plus 4 blocks of growth
  each. Decodes keep running out of blocks and preempt; since nobody finishes, the preempted
  are never re-admitted and the running set shrinks (no steady state, but the literal case).
- ``churn``: the same tight pool, but outputs of 256 to 1023 tokens and a closed loop that
  replaces every finished request with a new one (256 in the system at all times): the steady
  state of memory pressure, with preemption, re-admission, prefix re-hits and recompute every
  few steps. Arrivals happen outside the timed calls.

Run ``python benchmarks/bench_scheduler.py`` (``--steps`` and ``--warmup`` to change the run).
Timings only: no assertions (``design.md``: never timed assertions in tests).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from sim.config.engine import EngineConfig
from sim.request import Request
from sim.scheduler.scheduler import Scheduler

NUM_REQUESTS = 256
PROMPT_TOKENS = 1000
BLOCK_SIZE = 16
MAX_TOKENS = 30_000
MAX_MODEL_LEN = 32_768


@dataclass(frozen=True)
class CaseResult:
    name: str
    num_gpu_blocks: int
    steps: int
    wall_s: float
    num_preemptions: int
    num_scheduled_tokens: int
    mean_running: float
    num_finished: int

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    @property
    def preemptions_per_step(self) -> float:
        return self.num_preemptions / self.steps

    @property
    def tokens_per_step(self) -> float:
        return self.num_scheduled_tokens / self.steps


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(index: int, *, churn: bool) -> Request:
    base = 1_000_000 * (index + 1)  # no two requests share a block
    prompt = range(base, base + PROMPT_TOKENS)
    max_tokens = 256 + (index * 37) % 768 if churn else MAX_TOKENS
    return Request(f"r{index}", prompt, max_tokens, block_size=BLOCK_SIZE)


def run_case(name: str, num_gpu_blocks: int, warmup: int, steps: int) -> CaseResult:
    churn = name == "churn"
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=8192,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
    )
    scheduler = Scheduler(config, num_gpu_blocks)
    for i in range(NUM_REQUESTS):
        scheduler.add_request(make_request(i, churn=churn))
    next_index = NUM_REQUESTS

    schedule = scheduler.schedule
    update_from_output = scheduler.update_from_output
    perf_counter = time.perf_counter
    preemptions_before = num_tokens = running = num_finished = 0
    wall_s = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            if name == "decode":
                assert len(scheduler.running) == NUM_REQUESTS, "warm-up too short"
                assert all(r.num_output_tokens for r in scheduler.running), "prefill not done"
            preemptions_before = scheduler.num_preemptions
            num_tokens = running = num_finished = 0
            wall_s = 0.0
        start = perf_counter()
        output = schedule()
        update = update_from_output(output)
        wall_s += perf_counter() - start
        num_tokens += output.total_num_scheduled_tokens
        running += output.num_running
        num_finished += len(update.finished)
        if churn:
            for _ in update.finished:
                scheduler.add_request(make_request(next_index, churn=True))
                next_index += 1

    if not churn and num_finished:
        raise RuntimeError("a request finished during the timed run: raise MAX_TOKENS")
    return CaseResult(
        name=name,
        num_gpu_blocks=num_gpu_blocks,
        steps=steps,
        wall_s=wall_s,
        num_preemptions=scheduler.num_preemptions - preemptions_before,
        num_scheduled_tokens=num_tokens,
        mean_running=running / steps,
        num_finished=num_finished,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=300, help="untimed steps first")
    args = parser.parse_args()

    # Ample: every request can hold its whole run (prompt + every decode step) at once.
    tokens_per_request = PROMPT_TOKENS + args.warmup + args.steps + 1
    ample_blocks = 1 + NUM_REQUESTS * cdiv(tokens_per_request, BLOCK_SIZE)
    # Tight: each request's prompt plus 4 blocks of growth; decodes outgrow it within
    # a few dozen steps and then preempt continuously.
    tight_blocks = 1 + NUM_REQUESTS * (cdiv(PROMPT_TOKENS, BLOCK_SIZE) + 4)

    results = [
        run_case("decode", ample_blocks, args.warmup, args.steps),
        run_case("pressure", tight_blocks, args.warmup, args.steps),
        run_case("churn", tight_blocks, args.warmup, args.steps),
    ]

    table = Table(title="kvsim scheduler: schedule() + update_from_output() per step")
    for column in ("case", "gpu blocks", "steps", "wall s", "steps/s", "tokens/step"):
        table.add_column(column, justify="right" if column != "case" else "left")
    table.add_column("mean running", justify="right")
    table.add_column("preempt/step", justify="right")
    table.add_column("finished", justify="right")
    for r in results:
        table.add_row(
            r.name,
            f"{r.num_gpu_blocks:,}",
            f"{r.steps:,}",
            f"{r.wall_s:.2f}",
            f"{r.steps_per_s:,.0f}",
            f"{r.tokens_per_step:,.1f}",
            f"{r.mean_running:.1f}",
            f"{r.preemptions_per_step:.3f}",
            f"{r.num_finished:,}",
        )
    console = Console(width=max(Console().width, 110))
    console.print(table)
    console.print(
        f"{NUM_REQUESTS} requests x {PROMPT_TOKENS}-token prompts, block_size {BLOCK_SIZE}, "
        f"max_num_batched_tokens 8192, prefix caching on; warm-up {args.warmup} steps.\n"
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]} ({platform.python_implementation()}), "
        f"{platform.system()} {platform.release()}"
    )


if __name__ == "__main__":
    main()
