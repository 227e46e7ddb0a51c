"""kvsim's simulator: vLLM V1's KV cache and scheduler under agent-fleet traffic."""

__version__ = "0.1.0"
