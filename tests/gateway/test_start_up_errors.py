"""`tierserve gateway` fails at start-up with one line on stderr and exit status 2, never a
traceback: a bad upstream URL (named by its setting) and a port already in use."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from tests.test_cli_errors import run_cli

UPSTREAM = 'url = "http://127.0.0.1:8000"'


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1:notaport", "upstreams[0].url: expected http(s)://host:port"),
        ("http://127.0.0.1:99999", "a port of 1-65535, got 'http://127.0.0.1:99999'"),
        ("http://127.0.0.1:0", "a port of 1-65535"),
        ("http://:8000", "upstreams[0].url"),
        ("http://127.0.0.1:8000/v1", "without /v1"),
    ],
)
def test_a_bad_upstream_url_is_one_line_naming_the_setting(
    url: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'[[upstreams]]\nkind = "tierserve"\nurl = "{url}"\n')
    code, err = run_cli(["gateway", "--config", str(config)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert words in err and "Traceback" not in err


def test_a_port_in_use_is_one_line_before_the_upstreams_are_polled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'[[upstreams]]\nkind = "tierserve"\n{UPSTREAM}\n')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = run_cli(["gateway", "--config", str(config), "--port", str(port)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "make run" not in err  # `make run PORT=...` starts `serve`, never the gateway


def test_a_gateway_with_no_upstream_up_says_it_is_not_ready(caplog: pytest.LogCaptureFixture) -> None:
    """It logged "tierserve gateway ready: 0/1 upstreams healthy" while /ready answered 503."""
    import httpx

    from tests.gateway.fakes import gateway
    from tierserve.server.embedded import loopback_socket

    with loopback_socket() as sock:  # a port nothing listens on (bound, never accepting)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with caplog.at_level(logging.INFO, logger="tierserve.gateway"), gateway([url]) as (gw, _):
            assert httpx.get(gw.url + "/ready").status_code == 503
    said = [r for r in caplog.records if "upstreams healthy" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "not ready" in said[0].getMessage()
