"""Shared test helpers."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

from tierserve.request import Request, SamplingParams
from tierserve.tiers import Tier

_ids = itertools.count()


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


def shared_data_dir() -> Path | None:
    """../shared/data next to the repository (CI lays it there), if present."""
    here = Path(__file__).resolve().parents[1]
    for candidate in (here.parent / "shared" / "data", Path("/work/shared/data")):
        if candidate.is_dir():
            return candidate
    return None


@pytest.fixture
def shared_data() -> Path:
    path = shared_data_dir()
    if path is None:
        pytest.skip("../shared/data is not present")
    return path
