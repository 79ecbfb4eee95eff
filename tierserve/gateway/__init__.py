"""`tierserve gateway`: tiers, tenants, global limits and tier-aware routing in front of replicas."""
