"""Check the plug-in's config before starting vLLM with it.

    python -m tierserve.integrations.vllm.check_config [FILE]
    python -m tierserve.integrations.vllm.check_config --additional-config JSON

FILE defaults to $TIERSERVE_CONFIG; `--additional-config` checks what `vllm serve
--additional-config` would be given instead (`{"tierserve": {...}}`, read as the plug-in reads
it). The plug-in reads its config in vLLM's engine core,
once the model is loaded, and a mistake there ends the start-up with vLLM's tracebacks;
this reads the same file the same way in a second, without vLLM, and says what the
plug-in would run (exit status 0) or the one error (one line on stderr, exit status 2).
The check that every tier has room for one request of `--max-model-len` needs vLLM's block
pool, so it still runs only at start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from tierserve.config import ConfigError, load_raw
from tierserve.integrations.vllm.plugin_config import (
    CONFIG_ENV,
    PluginConfig,
    load_plugin_config,
    parse_plugin_config,
)
from tierserve.tiers import ALL_TIERS

USAGE = "usage: python -m tierserve.integrations.vllm.check_config [FILE | --additional-config JSON]"


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
        f"policy {config.policy}{_options_set(config)}, default tier {config.default_tier.name}, "
        f"priorities {priorities or 'none'}; {tiers}"
    )


def _options_set(config: PluginConfig) -> str:
    """The running policy's `[policy.NAME]` settings that differ from its defaults, e.g.
    " (step_bound_x_p0 0.5)": a user could not tell that a setting was read."""
    options = config.engine.policy_options.get(config.policy)
    if options is None:
        return ""
    defaults = type(options)()
    changed = [
        f"{f.name} {getattr(options, f.name):g}"
        if isinstance(getattr(options, f.name), float)
        else f"{f.name} {getattr(options, f.name)}"
        for f in dataclasses.fields(options)
        if getattr(options, f.name) != getattr(defaults, f.name)
    ]
    return f" ({', '.join(changed)})" if changed else ""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    inline = [a for a in args if a.startswith("--additional-config=")]
    if inline:  # --additional-config=JSON, as argparse users write it
        args = [a for a in args if a not in inline] + ["--additional-config", inline[0].split("=", 1)[1]]
    if "--additional-config" in args:
        if len(args) != 2 or args[0] != "--additional-config":
            print(f"error: give a FILE or --additional-config JSON, not both\n{USAGE}", file=sys.stderr)
            return 2
        return _check_inline(args[1])
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print(USAGE, file=sys.stderr)
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
    return _said(path, config)


def _check_inline(text: str) -> int:
    """`--additional-config JSON`: read as vLLM hands it to the plug-in, beside
    $TIERSERVE_CONFIG where it is set (its errors name the source: a misplaced table or a
    misspelt key too)."""
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        print(f"error: --additional-config: invalid JSON: {e}", file=sys.stderr)
        return 2
    if not isinstance(extra, dict):
        print(f"error: --additional-config: expected a JSON object, got {text!r:.60}", file=sys.stderr)
        return 2
    try:  # with $TIERSERVE_CONFIG set too, the plug-in refuses the pair, and so does this
        config = load_plugin_config(extra)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _said(config.source, config)  # INLINE_SOURCE, or the defaults where no key is there


def _said(source: str, config: PluginConfig) -> int:
    for note in config.ignored:
        print(f"note: {source}: {note}", file=sys.stderr)
    print(f"{source}: {describe(config)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
