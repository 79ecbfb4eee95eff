"""The plug-in's log lines go out through vLLM's own handler."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")


def test_the_plugins_lines_reach_vllms_handler() -> None:
    # A logger outside vLLM's "vllm" hierarchy had no handler under `vllm serve`: the
    # start-up line (policy, floors, ceilings) never showed, and warnings came unformatted.
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    from tierserve.integrations.vllm import scheduler

    configure_logging_if_needed(LoggingConfig())  # as `vllm serve` and `LLM(...)` do at start

    reached: list[logging.Handler] = []
    current: logging.Logger | None = scheduler.logger
    while current is not None:
        reached += current.handlers
        if not current.propagate:
            break
        current = current.parent
    vllm_handlers = logging.getLogger("vllm").handlers
    assert vllm_handlers and any(h in vllm_handlers for h in reached)
    assert scheduler.logger.isEnabledFor(logging.INFO)
