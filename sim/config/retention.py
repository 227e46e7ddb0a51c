"""Session-aware KV retention during tool waits: a what-if policy vLLM 0.32 does not run.

When an agent's turn finishes and its session is expected back (the workload says so with a
:class:`sim.workload.base.SessionHint`), the KV cache manager can keep the turn's full,
prefix-cached blocks out of the free queue (so they cannot be evicted) for a TTL, instead of
freeing them (see ``sim/kv/retention.py``). ``policy: none`` (the default) is vLLM 0.32.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sim.config.limits import MAX_SECONDS, KvsimModel

RetentionPolicy = Literal["none", "ttl", "tool_latency", "free_floor"]


class RetentionConfig(KvsimModel):
    """How long a finished turn's prefix blocks stay pinned in HBM while its session waits."""

    policy: RetentionPolicy = Field(
        "none",
        description="none: free at finish, as vLLM 0.32 (LRU prefix cache); ttl: pin for "
        "ttl_s; tool_latency: pin for the given quantile of the session's tool-latency "
        "distribution (Continuum's idea); free_floor: pin for ttl_s, but only while free "
        "blocks stay at or above free_floor of the pool, releasing the oldest pins first.",
    )
    ttl_s: float = Field(
        30.0,
        ge=0.0,
        le=MAX_SECONDS,
        description="Pin time after a turn finishes, in seconds (policies ttl and "
        "free_floor); 0 retains nothing.",
    )
    quantile: float = Field(
        0.9,
        gt=0.0,
        lt=1.0,
        description="Quantile of the session's tool latency used as the pin time (policy "
        "tool_latency).",
    )
    free_floor: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="Fraction of usable KV blocks that must stay free while anything is "
        "pinned (policy free_floor).",
    )

    def what_if(self) -> str | None:
        """One line naming the policy for the outputs, None for ``policy: none``."""
        if self.policy == "none":
            return None
        if self.policy == "ttl":
            detail = f"ttl_s={self.ttl_s:g}"
        elif self.policy == "tool_latency":
            detail = f"quantile={self.quantile:g} of the session's tool latency"
        else:
            detail = f"ttl_s={self.ttl_s:g} while free blocks >= {self.free_floor:g}"
        return f"kv_retention: {self.policy} ({detail}); not in vLLM 0.32"
