"""The handler's side of a request: its stream of deltas, and their delivery on the event loop.

`EngineClient` posts each step's deltas to the `Dispatcher` as they come off the engine
process's pipe. The dispatcher wakes at most `DISPATCH_SLICE` queued handlers per
event-loop iteration, FIFO but for first tokens, which go ahead (up to `FIRSTS_AT_ONCE`
woken at once): each request's deltas stay in order, and a step's burst of hundreds of
chunks cannot hold up a new first token, or a new request's bytes, for the whole burst
(the loop polls for I/O between slices). Before any token, a handler gets `ACCEPTED` when
the engine takes its request.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tierserve.request import FinishReason, Request
from tierserve.tiers import Tier

DISPATCH_SLICE = 4  # queued handlers woken per event-loop iteration
FIRSTS_AT_ONCE = 32  # first tokens woken at once when none is queued


class Delta(NamedTuple):
    """New tokens of one request (possibly none) and, when it ended, how. (A tuple: hundreds
    are made per step on the engine thread, while first tokens wait for them.)"""

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str = ""  # the engine refused or lost the request
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass(slots=True)
class RequestHandle:
    """The handler's end of one request. Deltas arrive in order; the last one has `finished`."""

    request: Request
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    finished: bool = False  # the final delta has been delivered
    closed: bool = False

    async def next(self) -> list[Delta]:
        """Wait for at least one delta and return every delta already delivered."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items


# The engine took the request: its response's status line can go now, not with the first token.
ACCEPTED = Delta(())


def tier_of(item: tuple[RequestHandle, Delta]) -> Tier:
    return item[0].request.tier


class Dispatcher:
    """Hands deltas to handlers on the event loop, at most `DISPATCH_SLICE` per loop iteration.

    FIFO, so each request's deltas stay in order, except that first tokens go ahead of
    everything but earlier first tokens (a request's first delta has nothing before it to
    overtake): a step's new first tokens do not wait behind the rest of the previous step's
    burst. With no first token queued, a slice of new ones is woken at once, in `post`.
    `done` is set once the handlers of every first token posted so far have run."""

    def __init__(self, loop: asyncio.AbstractEventLoop, done: threading.Event) -> None:
        self._loop = loop
        self._done = done
        self._pending: deque[tuple[RequestHandle, Delta]] = deque()
        self._firsts_left = 0  # first tokens at the head of `_pending` not woken yet
        self._unsignalled = 0  # batches of first tokens woken whose handlers may not have run yet
        self._scheduled = False

    def post(
        self, items: list[tuple[RequestHandle, Delta]], firsts: Sequence[tuple[RequestHandle, Delta]] = ()
    ) -> None:
        pending = self._pending
        pending.extend(items)
        woken = False
        if firsts and not self._firsts_left:
            # No first token is queued: wake a slice of these now, ahead of whatever the loop
            # already has ready (the rest of an earlier step's burst), not one iteration later.
            for handle, delta in firsts[:FIRSTS_AT_ONCE]:
                self._wake(handle, delta)
            firsts, woken = firsts[FIRSTS_AT_ONCE:], True
        for item in firsts:  # behind the first tokens still queued, ahead of everything else
            pending.insert(self._firsts_left, item)
            self._firsts_left += 1
        if woken and not self._firsts_left:
            self._signal_when_run()
        elif not self._firsts_left and not self._unsignalled:
            self._done.set()
        if not self._scheduled:
            self._drain()

    def _signal_when_run(self) -> None:
        """Set `done` once the handlers just woken have run (unless more first tokens follow)."""
        self._unsignalled += 1
        self._loop.call_soon(self._signal)  # runs after the handlers just woken

    def _signal(self) -> None:
        self._unsignalled -= 1
        if not self._unsignalled and not self._firsts_left:
            self._done.set()

    @staticmethod
    def _wake(handle: RequestHandle, delta: Delta) -> None:
        if delta.finished:
            handle.finished = True
        if not handle.closed:
            handle.queue.put_nowait(delta)

    def _drain(self) -> None:
        self._scheduled = False
        pending = self._pending
        for _ in range(min(DISPATCH_SLICE, len(pending))):
            self._wake(*pending.popleft())
            if self._firsts_left:
                self._firsts_left -= 1
                if not self._firsts_left:
                    self._signal_when_run()
        # The woken handlers run in the next iteration, after a poll for I/O; then the rest.
        if pending:
            self._scheduled = True
            self._loop.call_soon(self._drain)
