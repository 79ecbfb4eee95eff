"""The OpenAI-compatible HTTP server: tenants, tiers, rate limits, admission, metrics (docs/serving.md)."""
