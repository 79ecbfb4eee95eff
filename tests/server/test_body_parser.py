"""Large bodies parsed in a process of their own: what crosses back is cheap to take, the
answers are the ones a small body gets, and a dead worker costs no request."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.server.helpers import MODEL, LiveServer, live_server, make_state
from tierserve.server import fast_routes
from tierserve.server.body_parser import WORKER_NICENESS, BodyInvalid, BodyParser, parse
from tierserve.server.config import ServeConfig, ServerSettings
from tierserve.server.protocol import ChatCompletionRequest, CompletionRequest

CONTEXT = 512


def _raw(**body: Any) -> bytes:
    return json.dumps({"model": MODEL, **body}).encode()


def test_a_token_id_prompt_comes_back_as_one_array_and_other_prompts_as_they_were() -> None:
    ids = list(range(200, 200 + 50_000))
    body, errors = parse("completion", _raw(prompt=ids, max_tokens=4))
    assert errors is None and isinstance(body, CompletionRequest)
    assert isinstance(body.prompt, np.ndarray) and body.prompt.tolist() == ids
    # One buffer to unpickle, not 50,000 int objects.
    back = pickle.loads(pickle.dumps(body))
    assert isinstance(back.prompt, np.ndarray) and back.prompt.dtype == np.int64
    # Ids beyond int64 stay a list (prepare.py then names them outside the vocabulary).
    huge, _ = parse("completion", _raw(prompt=[1, 10**30]))
    assert isinstance(huge, CompletionRequest) and huge.prompt == [1, 10**30]
    nested, _ = parse("completion", _raw(prompt=[ids[:10]]))
    assert isinstance(nested, CompletionRequest) and isinstance(nested.prompt, list)
    assert isinstance(nested.prompt[0], np.ndarray) and nested.prompt[0].tolist() == ids[:10]
    text, _ = parse("completion", _raw(prompt="hello"))
    assert isinstance(text, CompletionRequest) and text.prompt == "hello"
    chat, _ = parse("chat", _raw(messages=[{"role": "user", "content": "hi"}]))
    assert isinstance(chat, ChatCompletionRequest) and chat.messages[0].text() == "hi"


def test_an_invalid_body_comes_back_as_its_first_error_in_plain_data() -> None:
    body, errors = parse("completion", _raw(prompt=[1, 2, 3])[:-5])  # cut short: invalid JSON
    assert body is None and errors is not None
    assert errors[0]["type"] == "json_invalid" and isinstance(errors[0]["ctx"]["error"], str)
    body, errors = parse("completion", _raw(prompt=[1, 2], max_tokens="many"))
    assert body is None and errors is not None
    assert errors[0]["loc"] == ["max_tokens"] and "input" not in errors[0]
    pickle.loads(pickle.dumps(errors))  # crosses the process boundary


def _worker_pid(parser: BodyParser) -> int:
    pool = parser._pool
    assert pool is not None
    (pid,) = pool._processes  # type: ignore[attr-defined]  # one worker
    return int(pid)


def test_a_job_that_waits_for_the_worker_is_not_run_on_a_thread_meanwhile() -> None:
    """A parse on a thread holds the interpreter lock, and so the event loop: the gateway's
    large replies wait for the worker to start instead."""

    async def main() -> None:
        parser = BodyParser()
        read = await parser.run(parse, "completion", _raw(prompt="x"), wait_for_worker=True)
        assert read[0] is not None and parser.num_parsed_in_process == 1
        await parser.aclose()

    asyncio.run(main())


def test_the_worker_parses_in_another_process_and_a_dead_one_is_replaced() -> None:
    async def main() -> None:
        parser = BodyParser()
        raw = _raw(prompt=list(range(1000)))
        first = await parser.parse("completion", raw)  # the worker starts meanwhile
        assert isinstance(first, CompletionRequest) and parser.num_parsed_in_process == 0
        deadline = time.monotonic() + 60
        while not parser.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert parser.running
        body = await parser.parse("completion", raw)
        assert parser.num_parsed_in_process == 1 and _worker_pid(parser) != os.getpid()
        assert parser._pool is not None  # at the lowest CPU priority, beside the server
        assert parser._pool.submit(os.nice, 0).result(timeout=10) == WORKER_NICENESS
        # Ctrl-C reaches the whole process group; the server shuts the worker down after it
        # drains (the worker took it as a KeyboardInterrupt and printed a traceback).
        assert parser._pool.submit(signal.getsignal, signal.SIGINT).result(timeout=10) is signal.SIG_IGN
        assert isinstance(body, CompletionRequest) and isinstance(body.prompt, np.ndarray)
        with pytest.raises(BodyInvalid) as invalid:
            await parser.parse("completion", raw[:-3])
        assert invalid.value.errors[0]["type"] == "json_invalid"
        os.kill(_worker_pid(parser), signal.SIGKILL)
        await asyncio.sleep(0.2)
        again = await parser.parse("completion", raw)  # answered on a thread while it restarts
        assert isinstance(again, CompletionRequest)
        while parser.num_parsed_in_process < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            await parser.parse("completion", raw)
        assert parser.num_parsed_in_process >= 3  # a new worker took over
        await parser.aclose()
        assert not parser.running

    asyncio.run(main())


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(make_state(max_model_len=CONTEXT)) as srv:
        yield srv


def _post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + "/completions", json=body, timeout=30)


@pytest.mark.parametrize(
    "prompt",
    [
        [65] * 600,  # beyond the context
        [65, 999_999],  # a token id outside the vocabulary
        [65, 10**30],  # ... and beyond int64
        [[65] * 600],  # one prompt of ids, nested
        [],  # empty
        [[]],  # one empty prompt of ids
    ],
)
def test_a_large_body_gets_the_answer_a_small_one_gets(server: LiveServer, prompt: list[Any]) -> None:
    small = _post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    padding = "u" * (fast_routes.OFFLOAD_BYTES + 1)  # same body, over the offload size
    answers = []
    for _ in range(2):  # the first on a thread while the worker starts, then in the worker
        answers.append(_post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 1, "user": padding}))
        deadline = time.monotonic() + 60
        while not server.state.body_parser.running and time.monotonic() < deadline:
            time.sleep(0.05)
    assert server.state.body_parser.running
    for large in answers:
        assert (large.status_code, large.json()) == (small.status_code, small.json())
    assert small.status_code == 400


def test_a_large_valid_prompt_is_served_whole(server: LiveServer) -> None:
    padding = "u" * (fast_routes.OFFLOAD_BYTES + 1)
    before = server.state.body_parser.num_parsed_in_process
    r = _post(server, {"model": MODEL, "prompt": [65] * 300, "max_tokens": 2, "user": padding})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 300
    assert server.state.body_parser.num_parsed_in_process == before + 1


_SERVER = """
import os, sys, time
from tierserve.server.body_parser import BodyParser
parser = BodyParser()
parser.start()
print(*parser._pool._processes, flush=True)
time.sleep(120)
"""


# A server killed while its worker still starts up: the worker then found pid 1 as its
# parent, took it for its server, and ran for ever (an attack trial, 2026-12-07).
_SERVER_DIES_AT_START = """
import os
from tierserve.server.body_parser import _spawn_pool, parse
pool = _spawn_pool()
pool.submit(parse, "completion", b'{"model": "m", "prompt": [0]}')
print(*pool._processes, flush=True)
os._exit(9)
"""


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a parent to reap it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("script", [_SERVER, _SERVER_DIES_AT_START], ids=["started", "starting"])
def test_the_worker_exits_when_its_server_is_killed_outright(script: str) -> None:
    """A server killed with SIGKILL never shuts its pool down; the worker, which holds both
    ends of its job queue, waited for a job for ever (found still running minutes later)."""
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        worker = int(server.stdout.readline())
        assert _alive(worker)
    finally:
        server.kill()
        server.wait(timeout=10)
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphaned = _alive(worker)
    if orphaned:  # leave no worker behind a failed run
        os.kill(worker, signal.SIGKILL)
    assert not orphaned


def test_the_large_body_gate_takes_its_share_and_queue_from_the_config() -> None:
    # A gate that rests 99 times a parse's duration after it, with room for one body: of
    # two large bodies sent together after a first, one waits and the other gets 503 `busy`.
    # Under the defaults (10 %, 16 waiting) all three are served.
    settings = ServerSettings(large_body_share=0.01, large_body_queue=1)
    padding = "u" * (fast_routes.OFFLOAD_BYTES + 1)
    body = {"model": MODEL, "prompt": [65, 66], "max_tokens": 1, "user": padding}

    async def three(base_url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            first = await http.post("/completions", json=body)
            rest = await asyncio.gather(*(http.post("/completions", json=body) for _ in range(2)))
        return [first.status_code, *sorted(r.status_code for r in rest)]

    for config, expected in ((ServeConfig(server=settings), [200, 200, 503]), (ServeConfig(), [200] * 3)):
        with live_server(make_state(config, max_model_len=CONTEXT)) as srv:
            assert asyncio.run(three(srv.base_url)) == expected


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        ("completion", {"prompt": ["x", 1]}, "prompt.1: Input should be a valid string"),
        ("completion", {"prompt": [*range(99), "x"]}, "prompt.99: Input should be a valid integer"),
        (
            "completion",
            {"prompt": 5},
            "prompt: Input should be a string, an array of strings, an array of integers (token ids), "
            "or an array of arrays of integers (token ids)",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": 5},
            "tool_choice: Input should be a string or an object",
        ),
        ("completion", {"prompt": [[1, "a"]]}, "prompt.0.1: Input should be a valid integer"),
        (
            "chat",
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content: Input should be a string or an array of content parts",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages.0.content.0.type: Field required",
        ),
    ],
)
def test_a_union_fields_error_names_what_it_takes_or_where_the_input_went_wrong(
    kind: Any, body: dict[str, Any], message: str
) -> None:
    """The first member's error alone was reported: `["x", 1]` read `prompt.0: Input should be
    a valid integer` (its element 0 is a valid string), and a content part without its `type`
    read `content: Input should be a valid string`. The member whose first bad element comes
    latest is the one meant: a token id gone wrong among thousands is named by its place."""
    from tierserve.server.errors import invalid_body

    parsed, errors = parse(kind, _raw(**body))
    assert parsed is None and errors and invalid_body(errors).message == message


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (CompletionRequest, {"prompt": [1.5] * 20_000}),
        (CompletionRequest, {"prompt": ["a"] * 10 + [1] * 20_000}),
        (CompletionRequest, {"prompt": [[1.5] * 20_000]}),
        (CompletionRequest, {"prompt": "x", "stop": [1] * 20_000}),
        (CompletionRequest, {"prompt": "x", "stop_token_ids": ["a"] * 20_000}),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}] * 20_000}]},
        ),
        (ChatCompletionRequest, {"messages": [{"role": "nobody"}] * 20_000}),
    ],
    ids=["floats", "strings-then-ids", "nested-floats", "stop", "stop-ids", "content-parts", "messages"],
)
def test_a_field_of_many_bad_elements_is_refused_at_its_first(model: Any, body: dict[str, Any]) -> None:
    """Validated as every form of its union, each element checked, a 60 KB prompt of floats
    collected some 45,000 errors and held the event loop 120 ms (a 1 MB one 2.6 s in the body
    parser, and the parser's gate then shut large bodies out for 23 s), before any rate
    limit saw it. Its one form is validated now, up to its first bad element."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        model.model_validate_json(_raw(**body))
    assert refused.value.error_count() == 1
