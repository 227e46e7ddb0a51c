"""Session-aware KV retention during tool waits: a what-if policy vLLM 0.32 does not run.

When an agent's turn finishes and its session is expected back (the workload says so with a
:class:`sim.workload.base.SessionHint`), the KV cache manager can keep the turn's full,
prefix-cached blocks out of the free queue (so they cannot be evicted) for a TTL, instead of
freeing them (see ``sim/kv/retention.py``). ``policy: none`` (the default) is vLLM 0.32.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from sim.config.limits import MAX_SECONDS, KvsimModel

RetentionPolicy = Literal["none", "ttl", "tool_latency", "free_floor"]

# The settings each policy reads; another one set to a value other than its default is an
# error (it would be ignored).
READS: dict[str, tuple[str, ...]] = {
    "none": (),
    "ttl": ("ttl_s",),
    "tool_latency": ("quantile",),
    "free_floor": ("ttl_s", "free_floor"),
}


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
        "free_floor); 0 retains nothing: the policy is then none.",
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

    @model_validator(mode="before")
    @classmethod
    def _zero_ttl_is_none(cls, data: Any) -> Any:
        # A TTL of 0 pins nothing: exactly vLLM 0.32 (policy none), so it is that, and the
        # run is no what-if (it keeps the fast path, summary and export say none).
        if isinstance(data, dict) and data.get("policy") in ("ttl", "free_floor"):
            ttl_s = data.get("ttl_s")
            reads = {"policy", *READS[data["policy"]]}
            if type(ttl_s) in (int, float) and ttl_s == 0 and set(data) <= reads:
                return {"policy": "none"}
        return data

    @model_validator(mode="after")
    def _check_read(self) -> RetentionConfig:
        fields = type(self).model_fields
        unread = sorted(
            name
            for name in self.model_fields_set - {"policy", *READS[self.policy]}
            if getattr(self, name) != fields[name].default  # the default is as good as unset
        )
        if unread:
            raise ValueError(
                f"engine.kv_retention.{unread[0]} is set but policy {self.policy} does not "
                f"read it (policy {self.policy} reads "
                f"{', '.join(READS[self.policy]) or 'nothing'}): remove it or pick the policy "
                "that uses it"
            )
        return self

    @model_serializer(mode="wrap")
    def _dump_read(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Only what the policy reads, so a dumped scenario loads back (see _check_read).
        data = handler(self)
        return {k: v for k, v in data.items() if k == "policy" or k in READS[self.policy]}

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
