"""ocache: a prefix/KV cache proxy in front of llama-server (resident, disk and session tiers)."""

__version__ = "0.1.0"
