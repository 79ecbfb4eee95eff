"""Deny by default, and the key checked before the body: through a live server, the config
loader, the start-up warnings and `tierserve serve` itself."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server.helpers import MODEL, LiveServer, live_server, make_state
from tierserve.cli import build_parser, main
from tierserve.config import ConfigError
from tierserve.server import body_parser, fast_routes
from tierserve.server.config import ServeConfig, parse_serve_config
from tierserve.server.http_limits import http_overrides, parse_http_limits
from tierserve.server.permissive import log_permissive_settings, permissive_settings

CONFIG = {
    "server": {"allow_anonymous": True, "default_tenant": "public"},
    "tenants": {
        "gold": {"api_keys": ["sk-gold"], "max_tier": "P0", "default_tier": "P0"},
        "public": {"max_tier": "P0", "default_tier": "P2"},
    },
}
ONE_MIB = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    config = parse_serve_config({**CONFIG, "server": {**CONFIG["server"], "max_body_bytes": 2 * ONE_MIB}})
    with live_server(make_state(config)) as srv:
        yield srv


def _tier(server: LiveServer, headers: dict[str, str]) -> str:
    r = httpx.post(
        server.base_url + "/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    return r.headers["x-tierserve-tier"]


def test_anonymous_traffic_runs_at_the_default_tier_whatever_it_asks(server: LiveServer) -> None:
    assert _tier(server, {"authorization": "Bearer sk-gold", "x-request-tier": "P0"}) == "P0"
    assert _tier(server, {"x-request-tier": "P0"}) == "P2"
    assert _tier(server, {"x-request-tier": "P0", "x-tenant-id": "gold"}) == "P2"  # no key, no gold
    assert _tier(server, {}) == "P2"


def _raw(server: LiveServer, request: bytes) -> bytes:
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10) as sock:
        sock.sendall(request)
        out = b""
        while b"\r\n\r\n" not in out or len(out.partition(b"\r\n\r\n")[2]) < _length(out):
            chunk = sock.recv(65536)
            assert chunk, f"closed after {out!r}"
            out += chunk
        return out


def _length(response: bytes) -> int:
    for line in response.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def _head(key: str, length: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    ).encode()


def test_a_wrong_key_is_refused_before_the_body_is_read_or_parsed(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[int] = []
    real = fast_routes._validate

    def counting(model: fast_routes.Model, raw: bytes) -> object:
        parsed.append(len(raw))
        return real(model, raw)

    monkeypatch.setattr(fast_routes, "_validate", counting)
    # Headers only: the 401 comes without a byte of the declared 1 MiB body, and the connection closes.
    reply = _raw(server, _head("sk-wrong", ONE_MIB))
    assert reply.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in reply
    assert b"connection: close" in reply.lower()
    # A whole body that is not even JSON: still a 401, so it was never parsed.
    body = b"[" * 30_000
    reply = _raw(server, _head("sk-wrong", len(body)) + body)
    assert reply.startswith(b"HTTP/1.1 401")
    assert parsed == []
    good = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    assert _raw(server, _head("sk-gold", len(good)) + good).startswith(b"HTTP/1.1 200")
    assert parsed == [len(good)]  # the probe sees the bodies that are parsed


def test_a_refused_request_whose_body_is_still_coming_closes_its_connection(server: LiveServer) -> None:
    """A wrong key with a body under 64 KiB got its 401 at once, but the connection stayed
    open while the client trickled the body, up to the body timeout (30 s here), and such
    connections could not be evicted at the connection cap: 40 of them kept a server of
    `max_connections = 40` refusing everyone, its health checks too."""
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10) as sock:
        sock.sendall(_head("sk-wrong", 65_000) + b"{")  # the rest of the body never comes
        out = b""
        while True:  # bounded by the socket's timeout: a connection still open fails here
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    assert out.startswith(b"HTTP/1.1 401") and b"connection: close" in out.lower()


def test_refused_clients_trickling_their_bodies_do_not_fill_the_connection_cap() -> None:
    config = parse_serve_config({**CONFIG, "server": {**CONFIG["server"], "http": {"max_connections": 4}}})
    with live_server(make_state(config)) as srv:
        parts = urlsplit(srv.url)
        socks = [
            socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10) for _ in range(4)
        ]
        try:
            for sock in socks:
                sock.sendall(_head("sk-wrong", 65_000) + b"{")
                assert sock.recv(65536).startswith(b"HTTP/1.1 401")
            for sock in socks:
                with contextlib.suppress(OSError):  # closed by now, or about to be
                    sock.sendall(b" ")  # still sending, as a trickle would
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        finally:
            for sock in socks:
                sock.close()


def test_permissive_settings_are_each_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    locked = parse_serve_config(
        {"limits": {"requests_per_s": 10}, "tenants": {"a": {"api_keys": ["k"], "max_tier": "P0"}}},
        source="locked.toml",
    )
    assert permissive_settings(locked) == []
    loose = parse_serve_config(
        {
            "server": {
                "allow_anonymous": True,
                "tenant_header": True,
                "share_prefix_cache_across_tenants": True,
                "ratelimit": {"backend": "redis", "fail_mode": "open"},
            },
            "tenants": {"a": {"max_tier": "P0"}},
        },
        source="loose.toml",
    )
    caplog.set_level(logging.WARNING)
    log_permissive_settings(loose, logging.getLogger("test.permissive"))
    text = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    settings = ("allow_anonymous", "tenant_header", "share_prefix_cache", "fail_mode", "no rate limits")
    for setting in settings:
        assert sum(setting in line for line in text) == 1, (setting, text)
    assert any("OPEN" in line for line in permissive_settings(ServeConfig()))


def test_an_api_key_kept_from_the_example_config_is_warned_of() -> None:
    """deploy/example-config.toml's keys end in 'change-me': a server started from a copy
    that kept one serves anyone who has read the repository, and nothing said so."""
    example = Path(__file__).resolve().parents[2] / "deploy" / "example-config.toml"
    import tomllib

    raw = tomllib.loads(example.read_text())
    lines = permissive_settings(parse_serve_config(raw, source=str(example)))
    kept = [line for line in lines if "'change-me' placeholder" in line]
    assert len(kept) == 1 and "chat-frontend" in kept[0] and "sk-" not in kept[0]  # names, never keys
    own = {"tenants": {"a": {"api_keys": ["k-1f9c"], "max_tier": "P0"}}, "limits": {"requests_per_s": 1}}
    assert not any("placeholder" in line for line in permissive_settings(parse_serve_config(own, source="x")))


def test_serve_refuses_to_start_with_tenants_but_no_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "open.toml"
    path.write_text('[tenants.a]\nmax_tier = "P0"\n')
    assert main(["serve", "--backend", "sim", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "allow_anonymous" in err


def test_http_limit_flags_override_the_file_and_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    file_limits = parse_serve_config({"server": {"http": {"max_connections": 64, "body_timeout_s": 5}}})
    args = build_parser().parse_args(["serve", "--max-connections", "8", "--header-timeout", "2.5"])
    limits = parse_http_limits(http_overrides(args), file_limits.server.http)
    assert (limits.max_connections, limits.header_timeout_s, limits.body_timeout_s) == (8, 2.5, 5.0)
    with pytest.raises(SystemExit) as refused:  # as it parses, naming the flag
        main(["serve", "--backend", "sim", "--header-timeout", "0"])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1 and "argument --header-timeout" in err


def test_a_large_body_is_validated_off_the_event_loop(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a large body's validation is held up (on the thread the parser uses until its
    process runs), the event loop still answers others."""
    release = threading.Event()
    entered = threading.Event()
    real = body_parser.parse

    def held(kind: body_parser.Kind, raw: bytes) -> body_parser.Parsed:
        entered.set()
        release.wait(timeout=10)  # on the event loop, this would stall every other client
        return real(kind, raw)

    monkeypatch.setattr(body_parser, "parse", held)
    monkeypatch.setattr(server.state, "body_parser", body_parser.BodyParser(use_process=False))
    body = {
        "model": MODEL,
        "prompt": [65] * 1000,
        "max_tokens": 1,
        "user": "u" * (fast_routes.OFFLOAD_BYTES + 1),
    }
    result: list[int] = []
    post = threading.Thread(
        target=lambda: result.append(
            httpx.post(
                server.base_url + "/completions",
                json=body,
                headers={"authorization": "Bearer sk-gold"},
                timeout=30,
            ).status_code
        )
    )
    post.start()
    try:
        assert entered.wait(timeout=10)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert not release.is_set() and post.is_alive()  # answered while the validation was held
    finally:
        release.set()
        post.join(timeout=30)
    assert result == [200]


def test_the_start_up_access_line_says_how_each_request_finds_its_tenant() -> None:
    from types import SimpleNamespace

    from tierserve.server.state import ServerState

    def access(raw: dict[str, Any], source: str | None = "c.toml") -> str:
        config = parse_serve_config(raw, source=source)
        fake = SimpleNamespace(
            config=config, model=SimpleNamespace(name="m", max_model_len=8, context_note="")
        )
        return ServerState.describe(fake)  # type: ignore[arg-type]

    keyed = {"tenants": {"gold": {"api_keys": ["sk-gold"], "max_tier": "P0"}}}
    assert "API keys required" in access(keyed)
    mixed = access({**keyed, "server": {"allow_anonymous": True}})
    assert "API keys in c.toml name tenants" in mixed
    assert "run as tenant 'default' (x-tenant-id is ignored)" in mixed
    by_header = access({"server": {"allow_anonymous": True, "tenant_header": True}, **keyed})
    assert "x-tenant-id selects a declared tenant; other anonymous requests run as tenant" in by_header
    # An open server (no tenants: no config file, or a file without any) said "anonymous
    # requests run as tenant 'default'", or nothing of tenants, but x-tenant-id names an ad-hoc one.
    for line in (access({"limits": {"requests_per_s": 5}}), access({}, source=None)):
        assert "the ad-hoc tenant their x-tenant-id names" in line and "OPEN: no" in line


def test_the_start_up_line_says_what_caps_the_context() -> None:
    """A 4,096-position model on a 256 MiB CPU cache said "context 1024", and nothing of why."""
    from types import SimpleNamespace

    from tierserve.server.config import ServeConfig
    from tierserve.server.state import ServerState

    capped = SimpleNamespace(name="m", max_model_len=1024, context_note=" (the KV cache holds 1024 tokens)")
    line = ServerState.describe(SimpleNamespace(config=ServeConfig(), model=capped))  # type: ignore[arg-type]
    assert line.startswith("model 'm' (context 1024, the KV cache holds 1024 tokens); access: ")
    whole = SimpleNamespace(name="m", max_model_len=4096, context_note="")
    assert ServerState.describe(SimpleNamespace(config=ServeConfig(), model=whole)).startswith(  # type: ignore[arg-type]
        "model 'm' (context 4096); access: "
    )


DOCS = ("/openapi.json", "/docs", "/redoc")


def test_the_api_docs_are_served_on_a_server_that_needs_no_key(server: LiveServer) -> None:
    for path in DOCS:
        assert httpx.get(server.url + path).status_code == 200, path


@pytest.mark.parametrize(("api_docs", "status"), [(None, 404), (True, 200)])
def test_a_server_that_requires_keys_serves_its_api_docs_only_when_told(
    api_docs: bool | None, status: int
) -> None:
    raw: dict[str, Any] = {"tenants": {"gold": {"api_keys": ["sk-gold"], "max_tier": "P0"}}}
    if api_docs is not None:
        raw["server"] = {"api_docs": api_docs}
    config = parse_serve_config(raw, source="keys.toml")
    with live_server(make_state(config)) as srv:
        for path in DOCS:
            assert httpx.get(srv.url + path).status_code == status, path
        assert httpx.get(srv.url + "/health").status_code == 200
    warned = [line for line in permissive_settings(config) if "api_docs" in line]
    assert len(warned) == (1 if api_docs else 0)


def test_api_docs_can_be_turned_off_on_an_open_server() -> None:
    config = parse_serve_config({"server": {"api_docs": False}})
    assert not config.serves_api_docs
    assert parse_serve_config({}).serves_api_docs
    with pytest.raises(ConfigError, match=r"server\.api_docs"):
        parse_serve_config({"server": {"api_docs": "yes"}})


def test_a_tier_closed_by_a_queue_cap_of_0_is_named_at_start_up(tmp_path: Path) -> None:
    """`[limits.queue_cap] P0 = 0` refuses every P0 request; it used to start without a word,
    and an idle server then answered P0 with 503s that read like an outage."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    path = tmp_path / "closed.toml"
    path.write_text("[limits]\nrequests_per_s = 10\n[limits.queue_cap]\nP0 = 0\nP3 = 5\n")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = ["serve", "--backend", "sim", "--config", str(path), "--port", str(port)]
    server = subprocess.Popen(
        [sys.executable, "-m", "tierserve.cli", *command], stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    try:
        assert server.stderr is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("tierserve ready" in line for line in lines):
            line = server.stderr.readline()
            if not line:
                break
            lines.append(line)
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)
    closed = [line.split(": ", 1)[1].strip() for line in lines if "queue_cap" in line]
    assert closed == ["limits.queue_cap.P0 = 0: every P0 request is refused (400 tier_closed)"], lines


def test_a_tier_closed_by_a_queue_cap_of_0_is_a_400_not_a_503_to_retry() -> None:
    """Every request of the tier was a 503 `queue_full` with a Retry-After: the OpenAI client
    retries those, for a request that can never run (a ceiling of 0 gave a 400 already)."""
    config = parse_serve_config({**CONFIG, "limits": {"queue_cap": {"P0": 0}}})
    with live_server(make_state(config)) as srv:
        asked = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        url, gold = srv.base_url + "/completions", {"authorization": "Bearer sk-gold"}
        closed = httpx.post(url, json=asked, headers={**gold, "x-request-tier": "P0"})
        served = httpx.post(url, json=asked, headers={**gold, "x-request-tier": "P1"})
    assert closed.status_code == 400 and closed.json()["error"]["code"] == "tier_closed"
    assert "limits.queue_cap.P0 = 0" in closed.json()["error"]["message"]
    assert "retry-after" not in closed.headers and served.status_code == 200
