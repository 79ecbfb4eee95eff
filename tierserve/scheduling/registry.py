"""The one list of policies: the engine, the config loader and every CLI read it."""

from __future__ import annotations

from tierserve.config import EngineConfig
from tierserve.scheduling.article import ArticlePolicy
from tierserve.scheduling.base import Policy
from tierserve.scheduling.drr import DrrPolicy, TokenDrrPolicy
from tierserve.scheduling.fcfs import FcfsPolicy
from tierserve.scheduling.hybrid import HybridPolicy
from tierserve.scheduling.sglang_priority import SglangPriorityPolicy
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
    ArticlePolicy,
    VllmPriorityPolicy,
    SglangPriorityPolicy,
)
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in _ALL}
DEFAULT_POLICY = HybridPolicy.name
# The comparison the benchmark runs by default: the baselines and the policy under test.
BENCH_POLICIES: tuple[str, ...] = (
    FcfsPolicy.name,
    VllmPriorityPolicy.name,
    SglangPriorityPolicy.name,
    ArticlePolicy.name,
    HybridPolicy.name,
)


def policy_names() -> list[str]:
    return list(POLICIES)


def create_policy(name: str, config: EngineConfig) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return cls(config)
