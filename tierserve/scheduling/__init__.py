"""Queue policies, chosen by name."""

from __future__ import annotations

from tierserve.config import EngineConfig
from tierserve.scheduling.base import Policy
from tierserve.scheduling.drr import DrrPolicy, TokenDrrPolicy
from tierserve.scheduling.fcfs import FcfsPolicy
from tierserve.scheduling.hybrid import HybridPolicy
from tierserve.scheduling.strict import StrictPolicy
from tierserve.scheduling.vllm_priority import VllmPriorityPolicy
from tierserve.scheduling.wfq import WfqPolicy

_ALL: tuple[type[Policy], ...] = (
    FcfsPolicy,
    StrictPolicy,
    DrrPolicy,
    TokenDrrPolicy,
    WfqPolicy,
    HybridPolicy,
    VllmPriorityPolicy,
)
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in _ALL}


def create_policy(name: str, config: EngineConfig) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return cls(config)


__all__ = ["POLICIES", "Policy", "create_policy"]
