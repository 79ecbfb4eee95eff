"""Stand-ins and a live-server harness for the server tests."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import httpx
import pytest

from tierserve.engine import Engine
from tierserve.executors.base import StepBatch, StepResult
from tierserve.executors.null import NullExecutor
from tierserve.executors.pytorch.tokenizer import no_template_for
from tierserve.server.backends import Backend
from tierserve.server.config import ServeConfig
from tierserve.server.drain import DrainingServer
from tierserve.server.embedded import embedded_server, loopback_socket
from tierserve.server.state import ServerState, spawn_state

T = TypeVar("T")
MODEL = "stand-in"
REPLY = "Hello, world! The quick brown fox jumps over the lazy dog. "


class ByteTokenizer:
    """Ids 0-255 are bytes; 256 is BOS, 257 EOS."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (257,)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [256, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        no_template_for(template_kwargs)
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")


class TextExecutor(NullExecutor):
    """A stand-in executor whose requests all answer REPLY, byte by byte, over and over.

    `gate`: an event (multiprocessing's, to cross into the engine process) that the first
    step waits for; `fail_steps`: the steps (1 = the first) that raise."""

    def __init__(
        self, *, gate: Any = None, fail_steps: tuple[int, ...] = (), context_note: str = "", **kw: object
    ) -> None:
        kw.setdefault("step_s", 0.002)
        kw.setdefault("per_token_s", 1e-6)
        super().__init__(**kw)  # type: ignore[arg-type]
        self._spec = dataclasses.replace(self._spec, context_note=context_note)
        self.record = False
        self._reply = REPLY.encode()
        self._gate = gate
        self._fail_steps = fail_steps
        self._num_steps = 0

    def execute(self, batch: StepBatch) -> StepResult:
        self._num_steps += 1
        if self._num_steps == 1 and self._gate is not None:
            self._gate.wait(30)
        if self._num_steps in self._fail_steps:
            raise RuntimeError(f"step {self._num_steps} fails, as asked")
        sampled = {
            s.request.request_id: self._reply[s.request.num_output_tokens % len(self._reply)]
            for s in batch.seqs
            if s.samples
        }
        duration = self.step_s + self.per_token_s * batch.num_tokens
        return StepResult(duration, sampled, roofline_s=duration / 2)


def free_socket() -> socket.socket:
    return loopback_socket()


@dataclass
class LiveServer:
    url: str
    state: ServerState
    server: DrainingServer
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def begin_drain(self) -> None:
        loop = self.server._loop
        assert loop is not None
        loop.call_soon_threadsafe(self.server.begin_drain)

    def signal(self, sig: int = 15) -> None:
        """What a signal (SIGTERM by default) does to the running server."""
        self.server.handle_exit(sig, None)

    def inspect(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` in the engine process (or thread), between steps. In the engine
        process `fn` must pickle by name: a module-level function, not a lambda."""
        loop = self.server._loop
        assert loop is not None
        future = asyncio.run_coroutine_threadsafe(self.state.engine.inspect(fn), loop)
        result: T = future.result(timeout=10)
        return result

    def wait_engine_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.inspect(has_unfinished):
            if time.monotonic() > deadline:
                raise AssertionError("engine still has unfinished requests")
            time.sleep(0.02)


def text_backend(**executor_kw: Any) -> Backend:
    """The stand-in backend (`TextExecutor`, `ByteTokenizer`), built where it is called: pass
    `partial(text_backend, ...)` to the engine process."""
    return Backend(TextExecutor(**executor_kw), ByteTokenizer(), MODEL, 512, pace=True)


def make_state(
    config: ServeConfig | None = None,
    *,
    policy: str = "hybrid",
    fresh_metrics: bool = True,
    **executor_kw: object,
) -> ServerState:
    """A server's state over the stand-in executor, its engine in a process of its own as
    `tierserve serve` runs it; `executor_kw` go to `TextExecutor` there.

    With `fresh_metrics` each /metrics scrape is made anew (`metrics_max_age_s` 0): tests
    read counts right after the requests that moved them, and a scrape by the test before,
    inside the default 0.5 s, would otherwise answer with the counts as they were then."""
    config = config or ServeConfig()
    if fresh_metrics:
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, metrics_max_age_s=0.0))
    return spawn_state(config, partial(text_backend, **executor_kw), policy=policy)


# Probes for `LiveServer.inspect` (module-level, so that they reach the engine process).


def has_unfinished(engine: Engine) -> bool:
    return engine.has_unfinished()


def pool_free_and_total(engine: Engine) -> tuple[int, int]:
    """Free blocks (cached ones included) and the pool's size, after an integrity check."""
    memory = engine.memory
    memory.check_integrity()
    return memory.num_free_blocks, memory.num_blocks


def pool_in_use(engine: Engine) -> bool:
    return engine.memory.num_free_blocks < engine.memory.num_blocks


def end_counts(engine: Engine) -> tuple[int, int, int]:
    """Requests finished, aborted and rejected so far."""
    return engine.stats.num_finished, engine.stats.num_aborted, engine.stats.num_rejected


def engine_pid(engine: Engine) -> int:
    return os.getpid()


@contextmanager
def live_server(
    state: ServerState,
    *,
    drain_timeout_s: float = 5.0,
    freeze_heap: bool = False,
    engine_lost_linger_s: float = 1.0,
) -> Iterator[LiveServer]:
    """Run the app under uvicorn in a thread on a free loopback port."""
    with embedded_server(
        state,
        drain_timeout_s=drain_timeout_s,
        freeze_heap=freeze_heap,
        engine_lost_linger_s=engine_lost_linger_s,
    ) as srv:
        yield LiveServer(srv.url, srv.state, srv.server, srv.thread)


def wait_until_ready(proc: subprocess.Popen[str], url: str, deadline: float) -> None:
    """Poll `url`/ready until it answers 200; fail the test with the server's output if the
    process exits first or `deadline` (time.monotonic) passes."""
    while True:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"serve did not become ready:\n{proc.communicate()[0]}")
        time.sleep(0.2)


# The front door's cases, for `tierserve serve` and the gateway alike (both read the same
# headers and route the same paths): paths with a trailing slash, answered 404 (not a
# redirect built from the Host header) ...
SLASHED_PATHS = [
    ("POST", "/v1/completions/"),
    ("POST", "/v1/chat/completions/"),
    ("GET", "/health/"),
    ("GET", "/ready/"),
]
# ... and a header sent twice with different values, a 400 naming it: (name, first, second,
# the API key of a request that sends a tier twice; None where the header itself is the key
# or names a tenant, which it does only without a key).
HEADERS_SENT_TWICE = [
    ("x-request-tier", "P3", "P0", "sk-bronze"),
    ("x-tenant-id", "internal", "bronze", None),
    ("authorization", "Bearer sk-bronze", "Bearer sk-gold", None),
]
