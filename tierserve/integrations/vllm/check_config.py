"""Check the plug-in's config before starting vLLM with it.

    python -m tierserve.integrations.vllm.check_config [FILE]

FILE defaults to $TIERSERVE_CONFIG. The plug-in reads its config in vLLM's engine core,
once the model is loaded, and a mistake there ends the start-up with vLLM's tracebacks;
this reads the same file the same way in a second, without vLLM, and says what the
plug-in would run (exit status 0) or the one error (one line on stderr, exit status 2).
The check that every tier has room for one request of `--max-model-len` needs vLLM's block
pool, so it still runs only at start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from tierserve.config import ConfigError, load_raw
from tierserve.integrations.vllm.plugin_config import CONFIG_ENV, PluginConfig, parse_plugin_config
from tierserve.tiers import ALL_TIERS


def describe(config: PluginConfig) -> str:
    """What the plug-in runs with `config`, in one line."""
    said = {p: t.name for p, t in config.priority_tiers.items()}
    if said:  # vLLM's default priority 0, unless mapped, runs at the default tier
        said.setdefault(0, f"{config.default_tier.name} (the default tier)")
    priorities = ", ".join(f"{p} -> {t}" for p, t in sorted(said.items()))
    if priorities:
        priorities += " (beyond the ends, the end's tier)"  # PluginConfig.tier_for_priority
    tiers = "; ".join(
        f"{t.name} floor {c.floor:g} reserve {c.reserve:g} ceiling {c.ceiling:g}"
        for t in ALL_TIERS
        for c in (config.engine.tiers[t],)
    )
    return (
        f"policy {config.policy}, default tier {config.default_tier.name}, "
        f"priorities {priorities or 'none'}; {tiers}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print("usage: python -m tierserve.integrations.vllm.check_config [FILE]", file=sys.stderr)
        return 2
    path = args[0] if args else os.environ.get(CONFIG_ENV, "")
    if not path:
        print(
            f"error: no FILE given and ${CONFIG_ENV} is not set (the plug-in would run its defaults)",
            file=sys.stderr,
        )
        return 2
    raw = None
    try:
        raw = load_raw(path)  # its errors name the file already
        config = parse_plugin_config(raw)
    except ConfigError as e:
        message = str(e)
        print(f"error: {message if raw is None else f'{path}: {message}'}", file=sys.stderr)
        return 2
    for note in config.ignored:
        print(f"note: {path}: {note}", file=sys.stderr)
    print(f"{path}: {describe(config)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
