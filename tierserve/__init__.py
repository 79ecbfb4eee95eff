"""tierserve: priority-tiered scheduling for LLM inference, from HTTP down to KV blocks."""

__version__ = "0.1.0"
