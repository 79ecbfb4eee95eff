"""Queue policies, chosen by name from one registry (`registry.POLICIES`)."""

from __future__ import annotations

from tierserve.scheduling.base import Policy, RunningPass
from tierserve.scheduling.registry import (
    BENCH_POLICIES,
    DEFAULT_POLICY,
    POLICIES,
    create_policy,
    policy_names,
)

__all__ = [
    "BENCH_POLICIES",
    "DEFAULT_POLICY",
    "POLICIES",
    "Policy",
    "RunningPass",
    "create_policy",
    "policy_names",
]
