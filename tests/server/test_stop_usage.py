"""A completion ended at a stop string: what its usage counts, and `vllm:generation_tokens`
with it. The engine makes a token or more after the stop string completes, before the
server's `finish` reaches it (24-26 made for 23 used, at the stand-in's 2 ms step); as in
vLLM, those are never sent, charged or counted as generated."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.helpers import MODEL, REPLY, LiveServer, live_server, make_state
from tierserve.server.config import parse_serve_config

STOP = "quick"
USED = REPLY.index(STOP) + len(STOP)  # one token a byte: up to the stop string's last token


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    config = parse_serve_config({"server": {"metrics_max_age_s": 0}})
    with live_server(make_state(config)) as srv:
        yield srv


def _generated(server: LiveServer) -> float:
    text = httpx.get(server.url + "/metrics").text
    found = re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert found is not None
    return float(found.group(1))


def _used(client: openai.OpenAI, stream: bool) -> int:
    if not stream:
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=200, stop=STOP)
        assert r.choices[0].text == REPLY[: REPLY.index(STOP)] and r.usage is not None
        return r.usage.completion_tokens
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=200,
            stop=STOP,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None
    return usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_usage_and_generated_tokens_count_up_to_the_stop_string(server: LiveServer, stream: bool) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="anything", max_retries=0)
    for _ in range(3):
        before = _generated(server)
        used = _used(client, stream)
        server.wait_engine_idle()  # whatever the engine made past the stop string is made now
        assert used == USED  # the stop string's tokens included, as vLLM counts them
        assert _generated(server) - before == used
