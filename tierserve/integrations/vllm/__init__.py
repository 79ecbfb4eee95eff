"""tierserve's tiers inside vLLM: a V1 scheduler plug-in.

    vllm serve MODEL --scheduler-cls tierserve.integrations.vllm.TierScheduler \\
        --logits-processors tierserve.integrations.vllm:TierArgsValidator

See docs/vllm.md. The classes are loaded on first access, after the installed vLLM's
version is checked (`versions.py`): the plug-in subclasses vLLM internals that change
between releases, and an unsupported release gets an error naming both versions. The
vLLM-free parts (config, tier labels, ledger) import without vLLM.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

_LAZY = {
    "TierScheduler": "tierserve.integrations.vllm.scheduler",
    "AsyncTierScheduler": "tierserve.integrations.vllm.scheduler",
    "TierArgsValidator": "tierserve.integrations.vllm.validator",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        hint = ""
        if not name.startswith("_"):  # a class path mistyped in --scheduler-cls or --logits-processors
            close = difflib.get_close_matches(name, _LAZY, n=1)
            hint = f" (did you mean {close[0]!r}? " if close else " ("
            hint += f"it has {', '.join(sorted(_LAZY))})"
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}{hint}")
    return getattr(importlib.import_module(module), name)


__all__ = ["AsyncTierScheduler", "TierArgsValidator", "TierScheduler"]
