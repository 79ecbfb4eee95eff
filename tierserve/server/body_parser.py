"""Large request bodies are parsed and validated in a process of their own.

A worker thread keeps a parse off the event loop's turn, but not off its interpreter lock:
pydantic holds the lock for the whole of `model_validate_json` (~13 ms for 1.8 MiB of
token ids on the reference host), and a first token due in that time waits for it. Beside
a flood of 1 MiB bodies at 200 streams, that put the API overhead's P99 at 6-8 ms in ten
runs of ten (`tierserve bench serve`, docs/measurements/serving.md).

So a body larger than the server's offload size goes to one worker process, spawned when
the first such body arrives (that one, and any while the worker starts, parse on a
thread) and stopped with the server. Only what is cheap to take back crosses back:
- a body that fails validation comes back as its first error (type, location, message),
  which is all the 400 names;
- a prompt of token ids comes back as one numpy array (a single buffer to unpickle, where
  a list of 250,000 ints took ~6 ms), kept as an array through the prompt checks; only a
  prompt that passes them becomes a list (prepare.py).
Everything else (the model check, the tier, the options, the limits) runs as for a small
body, in the same order, so a large body gets the same answer a small one would.

The worker runs at the lowest CPU priority (it shares the server's CPUs, and a parse must
not take a time slice from the event loop), and exits within a second of a server that was
killed outright. Without the process (not started, or it died) the parse runs on a thread
as before; a dead worker is replaced once the job that found it dead has been served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import ValidationError

from tierserve.server.body_gate import report_cpu
from tierserve.server.errors import pick_error
from tierserve.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("tierserve.server")

T = TypeVar("T")
Body = ChatCompletionRequest | CompletionRequest
Kind = Literal["chat", "completion"]
KINDS: dict[Kind, type[Body]] = {"chat": ChatCompletionRequest, "completion": CompletionRequest}
# What comes back from the worker: the body, or the first validation error (JSON-safe).
Parsed = tuple[Body | None, list[dict[str, Any]] | None]


class BodyInvalid(Exception):
    """A body failed validation in the worker; `errors` holds its first error."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0].get("msg", "invalid request") if errors else "invalid request")
        self.errors = errors


def parse(kind: Kind, raw: bytes) -> Parsed:
    """Validate `raw` as a `kind` body (in the worker); a token-id prompt becomes an array."""
    try:
        body = KINDS[kind].model_validate_json(raw)
    except ValidationError as e:
        return None, [first_error(e)]
    return compact(body), None


def parse_timed(kind: Kind, raw: bytes) -> tuple[Parsed, float]:
    """`parse`, and the CPU time it took on its thread (the body gate charges that)."""
    start = time.thread_time()
    parsed = parse(kind, raw)
    return parsed, time.thread_time() - start


def first_error(e: ValidationError) -> dict[str, Any]:
    """What `errors.invalid_body` reads of an error, as plain data (its `input` may be the
    whole body, and its `ctx` may hold an exception); `errors.pick_error` picks it."""
    first = pick_error(e.errors(include_url=False, include_input=False))
    out: dict[str, Any] = {"type": first["type"], "loc": list(first["loc"]), "msg": first["msg"]}
    if "ctx" in first and "error" in first["ctx"]:
        out["ctx"] = {"error": str(first["ctx"]["error"])}
    return out


def compact(body: Body) -> Body:
    """The body with its prompt of token ids (flat, or the one nested prompt) as an array;
    ids beyond int64 stay a list (the vocabulary check refuses them)."""
    if not isinstance(body, CompletionRequest) or not isinstance(body.prompt, list) or not body.prompt:
        return body
    prompt: Any = body.prompt
    try:
        if isinstance(prompt[0], int):
            return body.model_copy(update={"prompt": np.asarray(prompt, dtype=np.int64)})
        one = prompt[0]
        if len(prompt) == 1 and isinstance(one, list) and (not one or isinstance(one[0], int)):
            return body.model_copy(update={"prompt": [np.asarray(one, dtype=np.int64)]})
    except OverflowError:
        pass
    return body


WORKER_NICENESS = 19
PARENT_CHECK_S = 0.5  # how often the worker looks for its server


def _worker_init(server: int) -> None:
    """In the worker: the lowest CPU priority, no Ctrl-C, and an exit when the server is gone.

    It shares the server's CPUs (it inherits their affinity), and a token due on the event
    loop must not wait for a time slice of a parse. Ctrl-C in a terminal reaches the whole
    process group: the server drains and then shuts the pool down, and the worker, had it
    taken the signal itself, printed a KeyboardInterrupt traceback. A server killed outright
    (SIGKILL, a crash) never shuts the pool down, and the worker holds both ends of its own
    job queue, so it would wait for a job for ever: a thread watches for the server's exit
    instead. `server` is the server's pid, passed in: a server killed while the worker still
    started up was no longer its parent when the worker asked, and the worker watched the
    process it had been handed to (pid 1) for ever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):  # not permitted here: it runs at normal priority
        os.nice(WORKER_NICENESS)
    threading.Thread(target=_exit_with, args=(server,), name="parent-watch", daemon=True).start()


def _exit_with(server: int) -> None:
    """Exit once this process's parent is no longer `server` (it died, and the process was
    handed to another)."""
    while os.getppid() == server:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def _spawn_pool() -> ProcessPoolExecutor:
    """The pool of one worker (spawned at its first job)."""
    return ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_init,
        initargs=(os.getpid(),),
    )


class BodyParser:
    """One worker process for large bodies, or a thread where there is none."""

    def __init__(self, use_process: bool = True) -> None:
        self._use_process = use_process
        self._pool: ProcessPoolExecutor | None = None
        self._starting: asyncio.Task[None] | None = None
        self.num_parsed_in_process = 0

    @property
    def running(self) -> bool:
        return self._pool is not None

    def start(self) -> None:
        """Spawn the worker and wait for its imports (the first job would otherwise pay
        them); jobs go to it only once it has answered."""
        if self._pool is not None:
            return
        pool = _spawn_pool()
        try:
            pool.submit(parse, "completion", b'{"model": "warm-up", "prompt": [0]}').result(timeout=120)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        self._pool = pool

    def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    async def aclose(self) -> None:
        """Stop the worker (waiting for a start in progress first)."""
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        await asyncio.to_thread(self.stop)

    async def parse(self, kind: Kind, raw: bytes) -> Body:
        """The validated body; raises `BodyInvalid` with the first error if it is not valid."""
        (body, errors), cpu_s = await self.run(parse_timed, kind, raw)
        report_cpu(cpu_s)  # the time the gate charges: waiting for a CPU is not parsing
        if body is None:
            raise BodyInvalid(errors or [])
        return body

    async def run(
        self, job: Callable[[Kind, bytes], T], kind: Kind, raw: bytes, wait_for_worker: bool = False
    ) -> T:
        """`job(kind, raw)` in the worker (a module-level function: it crosses by name), or
        on a thread while there is none. The gateway reads its bodies through here too.
        `wait_for_worker`: while the worker starts, wait for it rather than take a thread,
        whose parse holds the interpreter lock (json.loads does) and so the event loop: a
        job that must not be refused and need not be quick (a reply the gateway reads, which
        four at a time on threads held its streams for 0.3-0.6 s)."""
        pool = self._pool
        if pool is None:
            if self._use_process and self._starting is None:
                self._starting = asyncio.get_running_loop().create_task(self._start_in_background())
            if wait_for_worker and self._starting is not None and not self._starting.done():
                await asyncio.shield(self._starting)
                pool = self._pool
            if pool is None:
                return await asyncio.to_thread(job, kind, raw)
        try:
            done = await asyncio.get_running_loop().run_in_executor(pool, job, kind, raw)
        except BrokenProcessPool:
            log.error("the body parser process died; parsing on a thread while it restarts")
            done = await asyncio.to_thread(job, kind, raw)
            await self._restart(pool)
            return done
        self.num_parsed_in_process += 1
        return done

    async def _start_in_background(self) -> None:
        try:
            await asyncio.to_thread(self.start)
        except Exception:  # any failure to start: large bodies stay on the thread
            log.exception("the body parser process could not start; large bodies parse on a thread")
            self.stop()
            self._use_process = False
            return
        log.info("body parser process started: bodies over the offload size are parsed there")

    async def _restart(self, broken: ProcessPoolExecutor) -> None:
        """A new worker, started off the event loop; jobs meanwhile parse on a thread."""
        if self._pool is not broken:
            return  # another job restarted it already
        self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)
        self._starting = asyncio.get_running_loop().create_task(self._start_in_background())
