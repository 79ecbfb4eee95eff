"""The OpenAI-compatible API against a live uvicorn server, called with the official client."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from tests.server.helpers import MODEL, REPLY, SLASHED_PATHS, LiveServer, live_server, make_state
from tierserve.server.admission import ThroughputMeter
from tierserve.server.config import parse_serve_config
from tierserve.tiers import Tier

CONTEXT = 4096
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    config = parse_serve_config({"server": {"max_body_bytes": 64 * 1024}, "limits": {"queue_cap": {"P3": 1}}})
    with live_server(make_state(config, max_model_len=CONTEXT)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="anything", max_retries=0)


def test_chat_completion_returns_the_text_and_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert r.choices[0].message.content == REPLY[:12]
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len("user: hi\nassistant:") + 1  # + BOS
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def _chat_stream(
    client: openai.OpenAI, max_tokens: int, stream_options: dict[str, bool]
) -> list[ChatCompletionChunk]:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=max_tokens,
        stream=True,
        stream_options=stream_options,  # type: ignore[arg-type]
    )
    return list(stream)


def test_chat_stream_sends_role_text_finish_usage_and_done(client: openai.OpenAI) -> None:
    chunks = _chat_stream(client, 9, {"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY[:9]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client: openai.OpenAI) -> None:
    """vLLM's extension: each chunk's usage counts the tokens sent up to it."""
    chunks = _chat_stream(client, 6, {"include_usage": True, "continuous_usage_stats": True})
    assert all(c.usage is not None for c in chunks)
    assert chunks[0].usage is not None and chunks[0].usage.completion_tokens == 0  # the role
    sent = 0
    for c in chunks[1:-1]:
        assert c.usage is not None and c.choices
        sent += len(c.choices[0].delta.content or "")  # one character a token in this model
        assert c.usage.completion_tokens == sent
        assert c.usage.total_tokens == c.usage.prompt_tokens + sent
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


def test_continuous_usage_stats_needs_include_usage(client: openai.OpenAI) -> None:
    assert all(c.usage is None for c in _chat_stream(client, 4, {"continuous_usage_stats": True}))


def test_completion_takes_max_completion_tokens(client: openai.OpenAI) -> None:
    """OpenAI names it for chat only and vLLM drops it on completions; dropped, the answer
    ran to max_tokens. Honoured, it wins over max_tokens, as on chat."""
    r = client.completions.create(
        model=MODEL, prompt="Say hello", max_tokens=9, extra_body={"max_completion_tokens": 3}
    )
    assert r.choices[0].text == REPLY[:3] and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_completion_non_streaming_and_streaming(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Say hello", max_tokens=5, seed=3, temperature=0.5, top_p=0.9
    )
    assert r.object == "text_completion" and r.choices[0].text == REPLY[:5]
    assert r.usage is not None and r.usage.prompt_tokens == len("Say hello") + 1
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=7, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == REPLY[:7]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_answer_before_it(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        stop=["quick", "never"],
    )
    assert r.choices[0].message.content == REPLY[: REPLY.index("quick")]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == REPLY.index("quick") + len("quick")
    chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=200, stop="fox", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == REPLY[: REPLY.index("fox")]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_keeps_the_cached_prompt_tokens_in_the_usage(client: openai.OpenAI) -> None:
    """The cached count came only with the engine's final delta, which a request ended at a
    stop string never reads: its usage said 0 cached tokens, streamed and not."""
    prompt = "A shared prefix, long enough to fill several KV blocks of the cache. " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)  # now cached
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=200, stop="quick")
    assert r.choices[0].finish_reason == "stop"
    details = r.usage.prompt_tokens_details if r.usage else None
    assert details is not None and details.cached_tokens and details.cached_tokens >= 200
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=200,
            stop="quick",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == details.cached_tokens


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.response.json()["error"]["code"] == "model_not_found"


def test_tier_comes_from_the_header_or_the_body(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers={"x-request-tier": "realtime"}
    )
    assert raw.headers["x-tierserve-tier"] == "P0"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"priority": 2}
    )
    assert raw.headers["x-tierserve-tier"] == "P2"
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert raw.headers["x-tierserve-tier"] == "P1"  # the open tenant's default


def test_health_and_ready(server: LiveServer) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models"])
def test_head_is_answered_as_get_without_a_body(server: LiveServer, path: str) -> None:
    """Load balancers probe with HEAD; every GET route answered it 405."""
    got, head = httpx.get(server.url + path), httpx.head(server.url + path)
    assert head.status_code == got.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    if path != "/metrics":  # the same length: a body that does not change between the two
        assert head.headers["content-length"] == got.headers["content-length"]
    assert httpx.head(server.url + "/v1/completions").status_code == 405  # POST only, as for GET


@pytest.mark.parametrize(("method", "path"), SLASHED_PATHS)
def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_host_header(
    server: LiveServer, method: str, path: str
) -> None:
    """Starlette redirected (307) to a Location built from the client's Host header."""
    r = httpx.request(method, server.url + path, json=CHAT, headers={"host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["code"] == "not_found"


def test_queue_cap_refuses_with_503_retry_after_and_queue_depth(
    server: LiveServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = {Tier.P0: 0, Tier.P1: 0, Tier.P2: 0, Tier.P3: 1}  # P3's cap is 1
    monkeypatch.setattr(server.state.engine, "queued_by_tier", lambda: queued)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"x-request-tier": "P3"},
        )
    assert e.value.status_code == 503
    assert int(e.value.response.headers["retry-after"]) >= 1
    error = e.value.response.json()["error"]
    assert error["code"] == "queue_full" and error["current_queue_depth"] == 1 and error["retry_after"] >= 1


def test_estimated_wait_beyond_the_deadline_is_refused_early(
    server: LiveServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = server.state
    now = state.clock.now()
    meter = ThroughputMeter(window_s=10.0)
    for i in range(40):  # 4 starts per second over the last 10 s
        meter.record(now - 10 + (i + 1) * 0.25)
    monkeypatch.setattr(state.admission, "_meter", meter)
    queued = {Tier.P0: 0, Tier.P1: 30, Tier.P2: 0, Tier.P3: 0}
    monkeypatch.setattr(state.engine, "queued_by_tier", lambda: queued)
    # The engine's last pass left none of them waiting (a burst since): all are admitted.
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    # It left some waiting: the engine is full, and 30 ahead at 4 a second is too long.
    monkeypatch.setattr(state.engine, "waiting_by_tier", lambda: {**queued, Tier.P1: 1})
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    error = e.value.response.json()["error"]
    assert error["code"] == "deadline" and error["current_queue_depth"] == 30
    assert error["retry_after"] == pytest.approx(30 / 4 - 5.0, rel=0.2)
    # A realtime request has nobody ahead of it and goes through.
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        extra_headers={"x-request-tier": "P0"},
    )
    assert r.choices[0].finish_reason == "length"


def _post(server: LiveServer, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})


CHAT = {"model": MODEL, "messages": MESSAGES}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}, "max_tokens"),  # no coercion, as OpenAI
        ("/v1/chat/completions", {**CHAT, "max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
        ("/v1/completions", {"model": MODEL, "prompt": [True, False]}, "prompt.0"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": CONTEXT}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": CONTEXT}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "n": 2}, "n"),
        ("/v1/chat/completions", {**CHAT, "temperature": 3}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {**CHAT, "priority": 7}, "priority"),
        ("/v1/chat/completions", {**CHAT, "stop": ["a"] * 20}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True}, "logprobs"),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
        ),
        ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -2}, "top_k"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "x" * CONTEXT}]},
            "messages",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * CONTEXT}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, "best_of"),
    ],
)
def test_bad_input_is_400_naming_the_field(server: LiveServer, path: str, body: object, param: str) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split(".")[0] in error["message"]
    assert set(error) >= {"message", "type", "param", "code"}


def test_invalid_json_is_400(server: LiveServer) -> None:
    r = _post(server, "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert e.value.code == "model_not_found" and e.value.param == "model"


def test_bad_tier_header_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            extra_headers={"x-request-tier": "urgent"},
        )
    assert e.value.param == "x-request-tier"


def test_oversized_body_is_413_declared_or_streamed(server: LiveServer) -> None:
    big = json.dumps({**CHAT, "user": "x" * 70_000})
    r = _post(server, "/v1/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192].encode()

    r = httpx.post(
        server.url + "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["param"] is None


def test_unknown_route_and_method_use_the_error_envelope(server: LiveServer) -> None:
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_the_schema_documents_the_tier_and_tenant_headers(server: LiveServer) -> None:
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for route in ("/v1/chat/completions", "/v1/completions"):
        post = paths[route]["post"]
        headers = {p["name"] for p in post["parameters"] if p["in"] == "header"}
        assert headers == {"x-request-tier", "x-tenant-id"}, route
        assert "requestBody" in post, route


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("body", "code"),
    [(b"", "invalid_json"), (b"[1, 2]", None), (b'"text"', None), (b"null", None), (b"{}", None)],
)
def test_a_body_that_is_no_request_is_400(
    server: LiveServer, path: str, body: bytes, code: str | None
) -> None:
    """The generation routes validate bodies themselves (fast_routes.py): the same 400s."""
    r = _post(server, path, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == code and error["message"]


def test_a_bug_under_a_generation_route_is_a_500_in_the_envelope_and_the_server_lives_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The generation routes run ahead of FastAPI's router: an unexpected error still
    reaches the app's 500 handler, and the next request is served."""
    state = make_state()
    calls = {"n": 0}
    resolve = state.tenants.resolve

    def broken_once(*args: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug")
        return resolve(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(state.tenants, "resolve", broken_once)
    with live_server(state) as srv:
        r = _post(srv, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        r = _post(srv, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY[:2]


def test_sampling_fields_reach_the_engine_and_inert_ones_are_accepted(server: LiveServer) -> None:
    from tierserve.server.prepare import prepare
    from tierserve.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "user": "someone",
        }
    )
    params = prepare(server.state, body, Tier.P1).sampling
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 40, 7)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    off = prepare(server.state, ChatCompletionRequest.model_validate({**CHAT, "top_k": -1}), Tier.P1)
    assert off.sampling.top_k == 0 and not off.sampling.penalized
    r = _post(server, "/v1/chat/completions", {**CHAT, "presence_penalty": 1.0, "tools": []})
    assert r.status_code == 200, r.text


def test_the_models_sampling_defaults_fill_in_what_a_request_leaves_out(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As vLLM reads a model's generation_config.json: its settings for the fields a request
    does not give, the request's own where it does; the API's defaults for the rest."""
    from tierserve.request import SamplingDefaults
    from tierserve.server.prepare import prepare
    from tierserve.server.protocol import ChatCompletionRequest

    def sampling(**fields: object) -> tuple[float, float, int, float]:
        params = prepare(
            server.state, ChatCompletionRequest.model_validate({**CHAT, **fields}), Tier.P1
        ).sampling
        return params.temperature, params.top_p, params.top_k, params.repetition_penalty

    assert sampling() == (1.0, 1.0, 0, 1.0)  # OpenAI's temperature; the rest off
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    model = dataclasses.replace(server.state.model, sampling_defaults=defaults)
    monkeypatch.setattr(server.state, "model", model)
    assert sampling() == (0.7, 0.8, 20, 1.05)
    assert sampling(temperature=0, top_p=1, top_k=-1, repetition_penalty=1) == (0.0, 1.0, 0, 1.0)
    assert sampling(repetition_penalty=1.2) == (0.7, 0.8, 20, 1.2)
    r = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "repetition_penalty": 1.3})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "repetition_penalty": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text


def test_seed_minus_one_is_no_seed_as_vllm_reads_it(server: LiveServer) -> None:
    """Clients send seed=-1 for "random"; it was the fixed seed 2**64-1, the same output each
    time. Another negative seed is a seed (vLLM takes any int)."""
    from tierserve.server.prepare import prepare
    from tierserve.server.protocol import ChatCompletionRequest

    for seed, expected in ((-1, None), (0, 0), (-2, -2), (2**64 - 1, 2**64 - 1)):
        body = ChatCompletionRequest.model_validate({**CHAT, "seed": seed})
        assert prepare(server.state, body, Tier.P1).sampling.seed == expected
    for seed in (-1, -2, -(2**63)):
        r = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "seed": seed})
        assert r.status_code == 200, r.text
    r = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "seed": -(2**63) - 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_text_parts_are_joined_one_a_line_as_vllm_joins_them(server: LiveServer) -> None:
    from tierserve.server.prepare import prepare
    from tierserve.server.protocol import ChatCompletionRequest

    def prompt(content: object) -> list[int]:
        body = ChatCompletionRequest.model_validate(
            {**CHAT, "messages": [{"role": "user", "content": content}]}
        )
        return prepare(server.state, body, Tier.P1).prompt_token_ids

    parts = [{"type": "text", "text": "Summarise:"}, {"type": "text", "text": "the text"}]
    assert prompt(parts) == prompt("Summarise:\nthe text")


def test_a_prompt_beyond_its_tiers_share_of_the_cache_is_a_context_length_400() -> None:
    """The tier's ceiling is its context: the same error code as the model's context."""
    config = parse_serve_config({"tiers": {"P0": {"floor": 0.0, "reserve": 0.0, "ceiling": 0.05}}})
    with live_server(make_state(config, max_model_len=CONTEXT)) as srv:
        tokens = srv.state.ceiling_blocks[Tier.P0] * srv.state.block_size
        body = {"model": MODEL, "prompt": [5] * tokens, "max_tokens": 1}
        r = httpx.post(srv.base_url + "/completions", json=body, headers={"x-request-tier": "P0"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"tier P0 may hold at most {tokens} tokens" in error["message"]


def test_a_refusal_for_the_models_context_says_why_the_context_is_what_it_is() -> None:
    """A model whose context its sliding window caps: the 400 said "the model's context is
    24", for a model of 131,072 positions, and nothing of the window."""
    note = " (its sliding_window: attention past the window is not supported)"
    with live_server(make_state(max_model_len=CONTEXT, context_note=note)) as srv:
        long_prompt = {"model": MODEL, "prompt": [5] * CONTEXT, "max_tokens": 1}
        too_long = httpx.post(srv.base_url + "/completions", json=long_prompt).json()["error"]
        long_output = {"model": MODEL, "prompt": [5, 6], "max_tokens": CONTEXT}
        too_much = httpx.post(srv.base_url + "/completions", json=long_output).json()["error"]
    assert too_long["code"] == too_much["code"] == "context_length_exceeded"
    assert f"the model's context is {CONTEXT}{note} (room is needed" in too_long["message"]
    assert too_much["message"].endswith(f"exceeds the model's context of {CONTEXT} tokens{note}")


def test_a_tier_turned_off_by_a_ceiling_of_0_is_closed_and_named_at_start_up() -> None:
    """Its every request read "the prompt is N tokens; tier P3 may hold at most 0 tokens",
    a context error for any prompt; and nothing said at start-up that the tier was off."""
    from tierserve.server.permissive import closed_tiers

    config = parse_serve_config({"tiers": {"P3": {"floor": 0.0, "reserve": 0.0, "ceiling": 0.0}}})
    assert closed_tiers(config) == []  # the gateway's: it holds no KV cache to close a tier by
    with live_server(make_state(config, max_model_len=CONTEXT)) as srv:
        said = closed_tiers(config, srv.state.ceiling_blocks)
        body = {"model": MODEL, "prompt": [5] * (CONTEXT + 1), "max_tokens": 1}  # past the context too
        r = httpx.post(srv.base_url + "/completions", json=body, headers={"x-request-tier": "P3"})
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1}
        ok = httpx.post(srv.base_url + "/completions", json=body, headers={"x-request-tier": "P2"})
    assert said == [
        "tiers.P3.ceiling = 0 comes to no KV block: every P3 request is refused (400 tier_closed)"
    ]
    assert r.status_code == 400 and r.json()["error"]["code"] == "tier_closed", r.text
    assert "Tier P3 is not served here" in r.json()["error"]["message"]
    assert ok.status_code == 200, ok.text


def test_what_closes_a_tier_is_its_blocks_not_its_configured_ceiling() -> None:
    """fcfs shares one pool: a ceiling of 0 closed nothing, yet start-up said P3 was refused;
    a ceiling of 0.0005 came to 0 blocks and closed P3 without a word."""
    from tierserve.server.permissive import closed_tiers

    config = parse_serve_config({"tiers": {"P3": {"floor": 0.0, "reserve": 0.0, "ceiling": 0.0}}})
    with live_server(make_state(config, max_model_len=CONTEXT, policy="fcfs")) as srv:
        said = closed_tiers(config, srv.state.ceiling_blocks)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1}
        r = httpx.post(srv.base_url + "/completions", json=body, headers={"x-request-tier": "P3"})
    assert said == [] and r.status_code == 200, r.text
    tiny = parse_serve_config({"tiers": {"P3": {"floor": 0.0, "reserve": 0.0, "ceiling": 0.0005}}})
    with live_server(make_state(tiny, max_model_len=CONTEXT)) as srv:
        said = closed_tiers(tiny, srv.state.ceiling_blocks)
    assert said == [
        "tiers.P3.ceiling = 0.0005 comes to no KV block: every P3 request is refused (400 tier_closed)"
    ]


def test_an_output_beyond_its_tiers_share_of_the_cache_is_a_context_length_400() -> None:
    """`prompt + max_tokens` past the tier's ceiling: the same code as past the model's context."""
    config = parse_serve_config({"tiers": {"P0": {"floor": 0.0, "reserve": 0.0, "ceiling": 0.05}}})
    with live_server(make_state(config, max_model_len=CONTEXT)) as srv:
        tokens = srv.state.ceiling_blocks[Tier.P0] * srv.state.block_size
        assert tokens < CONTEXT  # the tier's ceiling, not the context, is what this passes
        body = {"model": MODEL, "prompt": [5] * (tokens - 4), "max_completion_tokens": 8}
        r = httpx.post(srv.base_url + "/completions", json=body, headers={"x-request-tier": "P0"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", error
    assert error["param"] == "max_completion_tokens"
    assert f"the {tokens} tokens of KV cache tier P0 may hold" in error["message"]


def test_a_404_for_a_model_does_not_echo_a_long_id(server: LiveServer) -> None:
    """A 20 KB id in the path came back whole in the 404."""
    r = httpx.get(server.url + "/v1/models/" + "x" * 20_000)
    assert r.status_code == 404 and len(r.content) < 500 and "xxx..." in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ([("content-type", "text/plain")], 415),  # what a web page may send anywhere unasked
        ([("content-type", "application/x-www-form-urlencoded")], 415),  # a form's, and curl -d's
        ([("content-type", "multipart/form-data; boundary=x")], 415),
        ([("content-type", "application/json"), ("content-type", "text/plain")], 415),
        ([("origin", "https://elsewhere.example")], 415),  # a page's untyped body (fetch, no-cors)
        ([("sec-fetch-site", "cross-site")], 415),
        ([("content-type", "application/json")], 200),
        ([("content-type", "Application/JSON; charset=utf-8")], 200),
        ([("content-type", "application/vnd.tierserve+json")], 200),
        ([], 200),  # no type, and not from a browser: taken as JSON (scripts leave it out)
        ([("sec-fetch-site", "same-origin")], 200),
    ],
)
def test_a_body_that_is_not_json_by_its_type_is_a_415(
    server: LiveServer, headers: list[tuple[str, str]], status: int
) -> None:
    """A page a user of an open server on their own machine opened could POST text/plain (or
    an untyped body) to it cross-origin, unasked, and start generations."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    r = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
    assert r.status_code == status, r.text
    if status == 415:
        assert r.json()["error"]["code"] == "unsupported_content_type"


def test_reply_ids_carry_64_random_bits_of_their_process(server: LiveServer) -> None:
    """OpenAI's ids are unique; with 3 random bytes per process, 1,000 server starts gave two
    of them the same prefix, and so the same ids, 3 % of the time."""
    first, second = (server.state.new_request_id("chatcmpl") for _ in range(2))
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}[0-9a-f]{9}", first) and first != second
    assert first[:25] == second[:25]  # the process's prefix, then a counter
