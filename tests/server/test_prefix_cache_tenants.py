"""The prefix cache keeps each tenant's prompts to itself: `cached_tokens` (and a faster first
token) told one tenant, block by block, which prompts another had sent. vLLM's `cache_salt`
separates requests further, within a tenant."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.helpers import MODEL, LiveServer, live_server, make_state
from tierserve.server.config import parse_serve_config

CONFIG = {
    "server": {"allow_anonymous": True},
    "tenants": {
        "a": {"api_keys": ["sk-a"], "max_tier": "P0"},
        "b": {"api_keys": ["sk-b"], "max_tier": "P0"},
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(make_state(parse_serve_config(CONFIG))) as srv:
        yield srv


def _prompt() -> str:
    """A prompt of many KV blocks that no other test sends."""
    return f"{uuid.uuid4().hex} Patient record: diagnosis code and notes. " * 4


def _post(server: LiveServer, key: str | None, body: dict[str, Any], chat: bool = False) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 1, **body}, headers=headers)


def _cached(server: LiveServer, key: str | None, prompt: str, chat: bool = False, **body: Any) -> int:
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    r = _post(server, key, body, chat)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_tenant_gets_no_cached_tokens_for_another_tenants_prompt(server: LiveServer) -> None:
    prompt = _prompt()
    assert _cached(server, "sk-a", prompt) == 0
    assert _cached(server, "sk-b", prompt) == 0  # was most of the prompt: a's blocks
    assert _cached(server, None, prompt) == 0
    assert _cached(server, "sk-a", prompt) >= 200  # a's own blocks are still its to reuse
    assert _cached(server, "sk-b", prompt) >= 200


def test_requests_without_a_key_share_among_themselves(server: LiveServer) -> None:
    prompt = _prompt()
    assert _cached(server, None, prompt, chat=True) == 0
    assert _cached(server, None, prompt, chat=True) >= 200
    assert _cached(server, "sk-a", prompt, chat=True) == 0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_cache_salt_keeps_blocks_to_requests_of_the_same_salt(server: LiveServer, chat: bool) -> None:
    prompt = _prompt()
    assert _cached(server, "sk-a", prompt, chat, cache_salt="s1") == 0
    assert _cached(server, "sk-a", prompt, chat) == 0
    assert _cached(server, "sk-a", prompt, chat, cache_salt="s2") == 0
    assert _cached(server, "sk-b", prompt, chat, cache_salt="s1") == 0  # the tenant still counts
    assert _cached(server, None, prompt, chat, cache_salt="s1") == 0
    assert _cached(server, "sk-a", prompt, chat, cache_salt="s1") >= 200
    assert _cached(server, None, prompt, chat, cache_salt="s1") >= 200
    # A salt that spells another tenant's key of the cache is still only a salt.
    assert _cached(server, None, prompt, chat, cache_salt='["a", null]') == 0


@pytest.mark.parametrize("salt", ["", 7, ["s"], {"s": 1}, True, "s" * 1025])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(
    server: LiveServer, salt: object, chat: bool
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    r = _post(server, "sk-a", {**body, "cache_salt": salt}, chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
