"""The engine configurations the claims report compares, as ``--set`` overrides.

Each variant names the engine field it needs; a variant whose field this build of kvsim does
not have is reported as not simulated (never guessed).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.config.engine import EngineConfig

# Host memory given to swap and offload variants: a fraction of a typical 8-GPU host's RAM.
SWAP_SPACE_GIB = 64
# An offload tier sized to hold agents' contexts: most of a DGX H100's 256 GiB per GPU.
LARGE_OFFLOAD_GIB = 192


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    overrides: tuple[str, ...]
    # The EngineConfig field the variant sets (None: a setting vLLM 0.32 has).
    requires: str | None = None
    # Whether vLLM 0.32 runs this configuration (False: a what-if policy).
    vllm_exact: bool = True

    def available(self) -> bool:
        return self.requires is None or self.requires in EngineConfig.model_fields

    def missing_reason(self) -> str:
        return f"not simulated: this kvsim has no engine.{self.requires} yet"


# Agent sessions per GPU within the SLOs, one capacity search each.
SESSION_VARIANTS: tuple[Variant, ...] = (
    Variant(
        "static",
        "static allocation (max_model_len per request, HuggingFace-style)",
        ("engine.allocator=static", "engine.enable_prefix_caching=false"),
        requires="allocator",
        vllm_exact=False,
    ),
    Variant("vllm", "vLLM 0.32: paged, prefix caching, recompute", ()),
    Variant(
        "vllm_priority", "vLLM 0.32 + priority scheduling", ("engine.scheduling_policy=priority",)
    ),
    Variant(
        "swap",
        "swap preemption (vLLM V0)",
        ("engine.preemption_mode=swap", f"engine.swap_space_gib={SWAP_SPACE_GIB}"),
        requires="preemption_mode",
        vllm_exact=False,
    ),
    Variant(
        "swap_priority",
        "swap preemption + priority scheduling",
        (
            "engine.preemption_mode=swap",
            f"engine.swap_space_gib={SWAP_SPACE_GIB}",
            "engine.scheduling_policy=priority",
        ),
        requires="preemption_mode",
        vllm_exact=False,
    ),
    Variant(
        "offload",
        f"CPU offload tier of {SWAP_SPACE_GIB} GiB (vLLM's offloading connector)",
        (f"engine.kv_offload_gib={SWAP_SPACE_GIB}",),
        requires="kv_offload_gib",
        vllm_exact=False,
    ),
    Variant(
        "offload_large",
        f"CPU offload tier of {LARGE_OFFLOAD_GIB} GiB (3/4 of a DGX H100's RAM per GPU)",
        (f"engine.kv_offload_gib={LARGE_OFFLOAD_GIB}",),
        requires="kv_offload_gib",
        vllm_exact=False,
    ),
    Variant(
        "retention",
        "session-aware KV retention during tool waits (TTL from tool latency)",
        ("engine.kv_retention.policy=tool_latency",),
        requires="kv_retention",
        vllm_exact=False,
    ),
)

# KV memory waste at one load, per allocator.
ALLOCATOR_VARIANTS: tuple[Variant, ...] = (
    Variant("paged", "paged (vLLM)", ("engine.allocator=paged",), requires="allocator"),
    Variant(
        "static",
        "static: max_model_len per request",
        ("engine.allocator=static", "engine.enable_prefix_caching=false"),
        requires="allocator",
        vllm_exact=False,
    ),
    Variant(
        "orca_max",
        "Orca (Max): reserve max_model_len",
        ("engine.allocator=orca_max", "engine.enable_prefix_caching=false"),
        requires="allocator",
        vllm_exact=False,
    ),
    Variant(
        "orca_pow2",
        "Orca (Pow2): reserve the next power of two",
        ("engine.allocator=orca_pow2", "engine.enable_prefix_caching=false"),
        requires="allocator",
        vllm_exact=False,
    ),
    Variant(
        "orca_oracle",
        "Orca (Oracle): reserve the true length",
        ("engine.allocator=orca_oracle", "engine.enable_prefix_caching=false"),
        requires="allocator",
        vllm_exact=False,
    ),
)
