"""The engine in a process of its own: where it runs, streams and aborts across the pipe,
metrics from both processes, and what the server does when the engine process dies."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.helpers import (
    MODEL,
    REPLY,
    end_counts,
    engine_pid,
    free_socket,
    live_server,
    make_state,
    pool_free_and_total,
    wait_until_ready,
)
from tierserve.server import engine_client
from tierserve.server.config import ServeConfig, ServerSettings
from tierserve.server.engine_client import EngineClient

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def test_the_engine_runs_in_a_process_other_than_the_servers() -> None:
    with live_server(make_state()) as srv:
        pid = srv.inspect(engine_pid)
        assert pid != os.getpid() and pid == srv.state.engine.pid
        r = httpx.post(srv.base_url + "/chat/completions", json={**CHAT, "max_tokens": 5}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY[:5]


async def _stream(url: str, max_tokens: int, hang_up_after: int | None) -> tuple[str, int]:
    """Stream a chat completion; hang up after `hang_up_after` data lines. Returns how it ended
    ("done" or "hung_up") and the data lines read."""
    body = {**CHAT, "max_tokens": max_tokens, "stream": True}
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", url + "/chat/completions", json=body) as r,
    ):
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            n += 1
            if line == "data: [DONE]":
                return "done", n
            if hang_up_after is not None and n >= hang_up_after:
                return "hung_up", n
    return "cut", n


def test_streams_and_aborts_across_the_pipe_give_every_kv_block_back() -> None:
    with live_server(make_state(step_s=0.002)) as srv:

        async def run() -> list[tuple[str, int]]:
            jobs = [_stream(srv.base_url, 2000 if i % 2 else 40, 5 if i % 2 else None) for i in range(16)]
            return await asyncio.gather(*jobs)

        ends = asyncio.run(run())
        assert [e for e, _ in ends] == ["hung_up" if i % 2 else "done" for i in range(16)]
        srv.wait_engine_idle(timeout_s=10)
        free, total = srv.inspect(pool_free_and_total)
        finished, aborted, rejected = srv.inspect(end_counts)
        assert free == total  # the pool is whole: every aborted request gave its blocks back
        assert (finished, aborted, rejected) == (8, 8, 0)
        metrics = httpx.get(srv.url + "/metrics").text
        # the engine process's counters and the server's, in one exposition
        assert 'tierserve_requests_total{finish_reason="abort",priority="P1"} 8.0' in metrics
        assert "tierserve_client_disconnects_total 8.0" in metrics


def test_an_engine_process_that_dies_fails_its_requests_with_503_and_the_server_exits_1() -> None:
    state = make_state(step_s=0.005)
    engine = state.engine
    assert isinstance(engine, EngineClient)
    with live_server(state, engine_lost_linger_s=5.0) as srv:
        body = {**CHAT, "max_tokens": 5000, "stream": True}
        with httpx.stream("POST", srv.base_url + "/chat/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            assert next(lines) and next(lines)  # the stream is under way
            os.kill(engine.pid, signal.SIGKILL)
            rest = list(lines)
        assert '"code": "aborted"' in rest[-2] and rest[-1] == "data: [DONE]"  # an error event
        late = httpx.post(srv.base_url + "/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=10)
        assert late.status_code == 503
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 503
        srv.thread.join(timeout=20)  # the server shuts itself down: no hang
        assert not srv.thread.is_alive() and srv.server.exit_code == 1
    assert engine.died and not engine.process.is_alive()


# ---- `tierserve serve` itself -------------------------------------------------------------------

ENGINE_PID = re.compile(r"engine process started \(pid (\d+)\)")


@pytest.fixture
def sim_serve() -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """`tierserve serve --backend sim` in a subprocess: (process, url, engine pid)."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierserve.cli", "serve", "--backend", "sim", "--port", str(port)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    pid = None
    while pid is None:  # the log says the engine's pid before the server listens
        line = proc.stdout.readline()
        match = ENGINE_PID.search(line)
        pid = int(match.group(1)) if match else None
        if (not line and proc.poll() is not None) or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("serve did not start its engine process")
    wait_until_ready(proc, url, deadline)
    try:
        yield proc, url, pid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_sigterm_lets_the_engine_finish_in_flight_work_then_both_exit_0(
    sim_serve: tuple[subprocess.Popen[str], str, int],
) -> None:
    proc, url, pid = sim_serve
    assert pid != proc.pid
    body = {"model": "llama-3.1-70b", "prompt": "x", "max_tokens": 40, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert next(lines)
        proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    assert proc.wait(timeout=30) == 0
    log = proc.stdout.read() if proc.stdout else ""
    assert "engine process exited (status 0)" in log
    assert not _alive(pid)


def test_serve_exits_non_zero_when_its_engine_process_is_killed(
    sim_serve: tuple[subprocess.Popen[str], str, int],
) -> None:
    proc, url, pid = sim_serve
    body = {"model": "llama-3.1-70b", "prompt": "x", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert next(lines)
        os.kill(pid, signal.SIGKILL)
        rest = list(lines)
    assert '"code": "aborted"' in rest[-2] and rest[-1] == "data: [DONE]"
    assert proc.wait(timeout=30) != 0  # bounded: the server does not hang on a dead engine
    log = proc.stdout.read() if proc.stdout else ""
    assert "the engine process died" in log


def test_state_gauges_from_the_engine_process_reach_metrics() -> None:
    with live_server(make_state()) as srv:
        r = httpx.post(srv.base_url + "/chat/completions", json={**CHAT, "max_tokens": 3}, timeout=30)
        assert r.status_code == 200
        metrics = httpx.get(srv.url + "/metrics").text
        total = re.search(r"^tierserve_kv_blocks_capacity (\S+)$", metrics, re.M)
        assert total is not None and float(total.group(1)) == srv.inspect(pool_free_and_total)[1] > 0
        assert re.search(r'^llm_kv_cache_hit_rate\{priority="P0"\} ', metrics, re.M)


def test_commands_and_outputs_larger_than_the_pipe_buffer_cross_intact() -> None:
    """A long prompt (a command of several hundred KB) and a burst of streams: the pipe
    stays blocking under the event loop, so big messages are never cut."""
    state = make_state(max_model_len=200_000, num_device_blocks=16_384, per_token_s=1e-7)
    with live_server(state) as srv:
        prompt = [i % 500 for i in range(180_000)]  # ~0.9 MB of JSON, ~0.36 MB pickled
        big = httpx.post(
            srv.base_url + "/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
            timeout=60,
        )
        assert big.status_code == 200, big.text
        assert big.json()["usage"]["prompt_tokens"] == len(prompt)
        assert srv.state.engine.running


def test_ready_answers_503_while_a_stopped_engine_holds_work_and_200_once_it_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hung engine process (here SIGSTOP) is alive, so nothing fails; only its silence while
    requests wait tells the load balancer to send them elsewhere."""
    config = ServeConfig(server=ServerSettings(engine_stall_s=0.5))
    state = make_state(config, step_s=0.005)
    engine = state.engine
    assert isinstance(engine, EngineClient)
    with live_server(state) as srv:
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200
        time.sleep(1.0)  # idle for longer than the limit: silence without work is no stall
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200
        body = {**CHAT, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", srv.base_url + "/chat/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            assert next(lines) and next(lines)  # the stream is under way
            os.kill(engine.pid, signal.SIGSTOP)
            try:
                time.sleep(1.0)
                stalled = httpx.get(srv.url + "/ready", timeout=10)
                again = httpx.get(srv.url + "/ready", timeout=10)
            finally:
                os.kill(engine.pid, signal.SIGCONT)
            rest = list(lines)
        assert stalled.status_code == 503 and "silent" in stalled.json()["reason"]
        assert again.status_code == 503
        assert rest[-1] == "data: [DONE]" and "error" not in "".join(rest)  # the stream finished
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200
    stall_lines = [r for r in caplog.records if "has sent nothing" in r.getMessage()]
    assert len(stall_lines) == 1  # one line a stall, not one a probe


def test_a_stopped_engine_makes_one_scrape_wait_not_every_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each /metrics waited the whole scrape timeout (5 s) for an engine that could not
    answer, past many Prometheus servers' own timeout: the target read as down."""
    monkeypatch.setattr(engine_client, "SCRAPE_TIMEOUT_S", 0.5)
    state = make_state(ServeConfig(server=ServerSettings(metrics_max_age_s=0.0)))  # each scrape asks
    engine = state.engine
    assert isinstance(engine, EngineClient)
    with live_server(state) as srv:
        assert "vllm:num_requests_running" in httpx.get(srv.url + "/metrics", timeout=10).text
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            took = []
            for _ in range(3):
                started = time.monotonic()
                r = httpx.get(srv.url + "/metrics", timeout=10)
                took.append(time.monotonic() - started)
                assert r.status_code == 200 and "vllm:num_requests_running" in r.text  # the last families
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        assert took[0] >= 0.5 and max(took[1:]) < 0.5, took
        assert httpx.get(srv.url + "/metrics", timeout=10).status_code == 200


def test_an_engine_killed_at_shutdown_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopped engine that does not exit when asked is killed; that was an INFO line
    like a clean exit's (an attack trial)."""
    monkeypatch.setattr(engine_client, "STOP_TIMEOUT_S", 0.5)
    state = make_state()
    engine = state.engine
    assert isinstance(engine, EngineClient)
    with live_server(state):
        os.kill(engine.pid, signal.SIGSTOP)
    warned = [r for r in caplog.records if "did not exit cleanly" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING"]
    assert not any("exited (status 0)" in r.getMessage() for r in caplog.records)


def test_a_process_exit_is_said_in_words() -> None:
    from tierserve.server.engine_client import how_it_ended

    assert how_it_ended(-9) == "killed by SIGKILL" and how_it_ended(1) == "exit status 1"
    assert how_it_ended(-200) == "killed by signal 200" and how_it_ended(None) == "not exited yet"
