"""Which steps build new matmul kernels: the first step of each token count an engine runs.

vLLM-CPU runs the larger linear layers through oneDNN (``onednn_mm``; vLLM's
``csrc/cpu/dnnl_helper.cpp``), which builds a matmul primitive per row count M, the step's
token count, and caches it (vLLM keeps 32 per weight shape, oneDNN's own primitive cache
1,024 in all). Measured on vLLM-CPU (2026-12-06, two six-round validation sessions on an
AVX-512/AMX Xeon, ~45,000 prefill steps): a step whose token count the process had not run
before took 3 ms longer than a repeat of it at 65-128 tokens, ~6 ms at 129-256 and 7-9 ms
at 257-512, while at 64 tokens or fewer a first step cost no more than a repeat (oneDNN
reuses its small-M kernels), nor did the first step at the token budget (vLLM's start-up
dummy run has built it). A repeat after 32 other counts (vLLM's cache had dropped it) took
~1 ms longer than other repeats, against ~6.5 ms for a first step: oneDNN's cache still held
it; that millisecond is not priced.

The cost model prices such a step (``CostParams.kernel_build_s`` plus
``kernel_build_per_token_s`` per token; both fitted by calibration, 0 by default: a GPU
captures its graphs at start-up). This module holds the one rule that says which steps they
are, for the simulated engine (as it runs) and the fit (over a measured run's steps).
"""

from __future__ import annotations

from collections.abc import Iterable


class KernelBuilds:
    """The token counts an engine process has built kernels for, starting from the budget."""

    __slots__ = ("_built", "min_tokens")

    def __init__(self, min_tokens: int, max_num_batched_tokens: int) -> None:
        """``min_tokens``: steps of this many tokens or fewer never build (their kernels are
        shared); ``max_num_batched_tokens``: built at start-up."""
        self.min_tokens = min_tokens
        self._built = {max_num_batched_tokens}

    def is_new(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` would build kernels now (nothing is recorded)."""
        return num_tokens > self.min_tokens and num_tokens not in self._built

    def run(self, num_tokens: int) -> bool:
        """Record a step of ``num_tokens`` as run; True when it built kernels."""
        if self.is_new(num_tokens):
            self._built.add(num_tokens)
            return True
        return False


def kernel_build_steps(
    token_counts: Iterable[int], min_tokens: int, max_num_batched_tokens: int
) -> list[bool]:
    """For each step of one engine process's run, in order (its tokens: prefill chunks plus
    one per decode; 0 for an empty step): whether it built kernels."""
    builds = KernelBuilds(min_tokens, max_num_batched_tokens)
    return [builds.run(n) for n in token_counts]  # 0 tokens: never above min_tokens
