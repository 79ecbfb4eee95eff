"""The tier passed down to each kind of engine, in its own terms.

vLLM: the body's `priority`, lower runs sooner (tier value as is), and `vllm_xargs`
carrying tier and tenant for tierserve's vLLM plug-in. SGLang: `priority`, higher runs
sooner; tiers are spaced one more than its preemption threshold apart, so a more urgent
tier can always preempt a less urgent one. tierserve: the `x-request-tier` header.
Plain OpenAI endpoints get nothing. The client's own `priority` (tierserve's 0..3) is
never forwarded as is: it has been resolved into the tier already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierserve.tiers import ALL_TIERS, Tier


@dataclass(frozen=True, slots=True)
class Downstream:
    body: dict[str, Any]
    headers: dict[str, str]


def sglang_priority(tier: Tier, preemption_threshold: int) -> int:
    """P3 -> 0, each more urgent tier `threshold + 1` higher."""
    return (len(ALL_TIERS) - 1 - int(tier)) * (preemption_threshold + 1)


def pass_down(
    kind: str, body: dict[str, Any], tier: Tier, tenant: str, *, sglang_threshold: int = 10
) -> Downstream:
    """The body and extra headers to send to an upstream of `kind` (the input is not changed)."""
    out = {k: v for k, v in body.items() if k != "priority"}
    headers: dict[str, str] = {}
    if kind == "vllm":
        out["priority"] = int(tier)
        xargs = dict(out.get("vllm_xargs") or {})
        xargs.update({"tier": tier.name, "tenant": tenant})
        out["vllm_xargs"] = xargs
    elif kind == "sglang":
        out["priority"] = sglang_priority(tier, sglang_threshold)
    elif kind == "tierserve":
        headers["x-request-tier"] = tier.name
    return Downstream(out, headers)
