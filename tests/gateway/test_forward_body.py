"""What the gateway keeps of a body and what it sends on: the client's body with the fields
it rewrites spliced on, and a large body read in the body parser's process."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.gateway.fakes import FAKE_MODEL, FakeUpstream, fake_upstream, gateway
from tierserve.gateway.body import REWRITTEN, ForwardBody, Refused, read_body
from tierserve.server.errors import invalid_body
from tierserve.server.fast_routes import OFFLOAD_BYTES

PREFIX_CHARS = 64


def _read(body: object, kind: str = "completion") -> ForwardBody:
    read = read_body(kind, json.dumps(body).encode(), PREFIX_CHARS)  # type: ignore[arg-type]
    assert not isinstance(read, Refused), read
    return read[0]


def test_what_is_read_of_the_validated_body_is_what_the_server_reads() -> None:
    """A summary, not the validated body: taking a chat body's messages back from the body
    parser's process rebuilt them on the event loop (about 100 ms for 20,000 messages)."""
    read = read_body("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', 8)
    assert not isinstance(read, Refused)
    summary = read[1]
    assert (summary.model, summary.priority, summary.stream) == ("m", None, False)
    assert summary.reserved_output(100) == (100, "messages")  # all of it the server's default
    raw = b'{"model": "m", "prompt": [1], "max_completion_tokens": 5, "stream": true, "priority": 1}'
    read = read_body("completion", raw, 8)
    assert not isinstance(read, Refused)
    summary = read[1]
    assert summary.requested_max_tokens == 5 and summary.stream and summary.priority == 1
    assert summary.reserved_output(5) == (0, "max_completion_tokens")


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_number_json_cannot_hold_is_refused_not_sent_on(number: str) -> None:
    """An undeclared field's NaN (which Python's json reads) went to the upstream as `NaN`,
    not JSON; 1e400 became `Infinity`."""
    raw = f'{{"model": "m", "prompt": "x", "extra": {number}}}'.encode()
    read = read_body("completion", raw, 8)
    assert isinstance(read, Refused) and "not JSON" in read.message, read


def test_the_body_is_stored_compact_with_text_as_utf8() -> None:
    forward = _read({"model": "m", "prompt": "héllo, 世界", "max_tokens": 2})
    assert forward.rest == '{"model":"m","prompt":"héllo, 世界","max_tokens":2}'.encode()


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "hi", "max_tokens": 3},
        {"model": "m", "prompt": [1, 2, 3], "priority": 2, "vllm_xargs": {"a": 1}, "cache_salt": "s"},
        {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": False}, "n": 1},
    ],
)
def test_the_body_sent_on_is_the_clients_with_the_rewritten_fields(body: dict[str, Any]) -> None:
    forward = _read(body)
    assert set(forward.fields) == set(body) & set(REWRITTEN)
    assert json.loads(forward.encode(forward.fields)) == body  # nothing rewritten: the body as sent
    rewritten = {"priority": 2, "vllm_xargs": {"tier": "P2"}}
    assert json.loads(forward.encode(rewritten)) == {
        **{k: v for k, v in body.items() if k not in REWRITTEN},
        **rewritten,
    }
    assert forward.model == "m" and forward.num_prompt_tokens >= 1


def test_an_empty_rest_takes_the_fields_without_a_comma() -> None:
    forward = ForwardBody(b"{}", {}, "", "", 1)
    assert forward.encode({}) == b"{}" and json.loads(forward.encode({"priority": 1})) == {"priority": 1}


def test_refusals_say_what_the_servers_say() -> None:
    """Validated first, as `tierserve serve` validates: its words for bad JSON, not Python's."""
    assert (
        invalid_body(_errors(b"{")).message
        == "Invalid JSON body: EOF while parsing an object at line 1 column 1"
    )
    assert invalid_body(_errors(b"[1]")).message == "Input should be an object"
    # An object (the gateway adds tier and tenant to it), as the server's models require.
    xargs = read_body("completion", b'{"model": "m", "prompt": "x", "vllm_xargs": [1]}', PREFIX_CHARS)
    assert isinstance(xargs, Refused) and xargs.errors[0]["loc"] == ["vllm_xargs"]
    wrong = read_body("completion", b'{"model": "m", "prompt": "x", "max_tokens": "many"}', PREFIX_CHARS)
    assert isinstance(wrong, Refused) and wrong.errors[0]["loc"] == ["max_tokens"]


def _errors(raw: bytes) -> tuple[dict[str, Any], ...]:
    read = read_body("completion", raw, PREFIX_CHARS)
    assert isinstance(read, Refused) and read.errors, read
    return read.errors


def test_a_content_part_whose_text_is_null_is_read_not_a_crash() -> None:
    """Its prompt text read `None` into a join: a 500 at the gateway where the server says 400."""
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}
    forward = _read(body, kind="chat")
    assert json.loads(forward.encode(forward.fields)) == body


def _large_prompt(num_ids: int) -> list[int]:
    return [(i * 7919) % 30000 for i in range(num_ids)]


def test_a_large_body_is_read_off_the_event_loop_and_sent_on_whole() -> None:
    """A body over the offload size is parsed and validated in the body parser's process
    (54 ms of the event loop for 1 MiB of token ids before), and the upstream gets the
    client's prompt to the last id; a large invalid body gets the small one's 400."""
    prompt = _large_prompt(40_000)
    body = {"model": FAKE_MODEL, "prompt": prompt, "max_tokens": 4, "priority": 3}
    assert len(json.dumps(body)) > OFFLOAD_BYTES
    upstream = FakeUpstream("ok")
    with fake_upstream(upstream) as url, gateway([url]) as (gw, state):
        replies = [httpx.post(gw.url + "/v1/completions", json=body, timeout=60)]
        deadline = time.monotonic() + 120  # the worker starts in the background (imports)
        while not state.body_parser.running and time.monotonic() < deadline:
            time.sleep(0.2)
        replies.append(httpx.post(gw.url + "/v1/completions", json=body, timeout=60))
        bad = {**body, "max_tokens": "many"}
        refused = httpx.post(gw.url + "/v1/completions", json=bad, timeout=60)
        small_refused = httpx.post(gw.url + "/v1/completions", json={**bad, "prompt": [1]}, timeout=60)
        not_json = httpx.post(gw.url + "/v1/completions", content=b"{" + b" " * OFFLOAD_BYTES, timeout=60)
        in_process = state.body_parser.num_parsed_in_process
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert all(h["content-type"] == "application/json" for h in upstream.headers)
    assert in_process >= 2  # the second body and the refused one, at least
    assert len(upstream.bodies) == 2
    for sent in upstream.bodies:
        assert sent["prompt"] == prompt and sent["max_tokens"] == 4
        assert sent["vllm_xargs"]["tier"] in ("P0", "P1", "P2", "P3")
    assert refused.status_code == small_refused.status_code == 400
    assert refused.json()["error"] == small_refused.json()["error"]
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"


def test_large_bodies_past_the_queue_are_refused_busy() -> None:
    """The server's `large_body_queue` bounds the large bodies waiting for the parser's
    process; the gateway queued them without bound."""
    from tierserve.server.body_gate import BodyGate

    body = {"model": FAKE_MODEL, "prompt": _large_prompt(40_000), "max_tokens": 4}
    with fake_upstream(FakeUpstream("ok")) as url, gateway([url]) as (gw, state):
        assert state.body_gate is not None
        state.body_gate = BodyGate(share=1.0, max_waiting=0)  # none may wait
        refused = httpx.post(gw.url + "/v1/completions", json=body, timeout=60)
        small = httpx.post(gw.url + "/v1/completions", json={**body, "prompt": [1, 2]}, timeout=60)
        metrics = httpx.get(gw.url + "/metrics").text
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "busy"
    assert refused.headers["retry-after"] == "1" and small.status_code == 200
    assert 'tierserve_http_errors_total{reason="busy"} 1.0' in metrics
