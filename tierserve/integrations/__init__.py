"""tierserve's scheduling inside other serving engines (vLLM)."""
