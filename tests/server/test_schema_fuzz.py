"""Schema-driven fuzzing (schemathesis + hypothesis): no generated request gets a 500.

Two thirds of the generated bodies get the served model's name, so that fuzzing reaches past
the model check into validation, tiering, admission and the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.helpers import MODEL, LiveServer, live_server, make_state
from tierserve.server.config import parse_serve_config


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # A short context keeps every valid generation short.
    config = parse_serve_config({"server": {"max_body_bytes": 16384}})
    with live_server(make_state(config, max_model_len=128, step_s=0.0005)) as srv:
        yield srv


def _operations(server: LiveServer) -> dict[str, Any]:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]  # type: ignore[union-attr]
    return {op.label: op for op in operations}


def _with_model(pair: tuple[Any, int]) -> Any:
    case, keep = pair
    if not keep and isinstance(case.body, dict):
        case.body["model"] = MODEL
    return case


@pytest.mark.parametrize(
    ("label", "examples"),
    [
        ("POST /v1/chat/completions", 25),
        ("POST /v1/completions", 25),
        ("GET /v1/models", 3),
        ("GET /health", 2),
        ("GET /ready", 2),
        ("GET /metrics", 2),
    ],
)
def test_no_generated_request_gets_a_server_error(server: LiveServer, label: str, examples: int) -> None:
    operation = _operations(server)[label]
    statuses: list[int] = []

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.tuples(operation.as_strategy(), st.integers(0, 2)).map(_with_model))
    def check(case: Any) -> None:
        response = case.call(base_url=server.url, timeout=30)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) >= {"message", "type", "param", "code"}

    check()
    assert server.state.engine.running and server.state.engine.num_step_errors == 0
    if label.startswith("POST"):  # the fuzzing got past the model check, both ways
        assert 200 in statuses and 400 in statuses
