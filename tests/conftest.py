"""Shared test helpers."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

from tierserve.data_dir import HOW_TO_GET, find_data_dir
from tierserve.request import Request, SamplingParams
from tierserve.tiers import Tier

_ids = itertools.count()

# The Redis tests use db 15 of a server on 127.0.0.1:6379 and are skipped, with this line, without one.
NO_REDIS = (
    "no Redis server on 127.0.0.1:6379: start one with `redis-server --daemonize yes` "
    "(Debian/Ubuntu: apt-get install redis-server) or `docker run -d -p 6379:6379 redis`"
)


def make_request(
    num_prompt: int = 32,
    max_tokens: int = 8,
    tier: Tier = Tier.P1,
    arrival: float = 0.0,
    tokens: list[int] | None = None,
    request_id: str | None = None,
    **sampling: object,
) -> Request:
    prompt = tokens if tokens is not None else [(next(_ids) * 7919 + i) % 50000 for i in range(num_prompt)]
    return Request(
        request_id or f"req-{next(_ids)}",
        prompt,
        SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        tier=tier,
        arrival_time=arrival,
    )


@pytest.fixture
def shared_data() -> Path:
    """The data folder ($TIERSERVE_DATA, else shared/data beside the repository); the test is
    skipped, saying how to get the data, when it is not there."""
    path = find_data_dir()
    if path is None:
        pytest.skip(HOW_TO_GET)
    return path
