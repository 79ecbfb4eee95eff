"""First come, first served: one queue in arrival order, tiers ignored.

Nothing here or in the engine looks at a request's tier under this policy: one shared
memory pool, running requests protected oldest first, the newest preempted first,
swapped requests back in the order they arrived, every long prompt chunked alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import ClassVar

from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling.base import Policy


class FcfsPolicy(Policy):
    name: ClassVar[str] = "fcfs"
    tiered_memory: ClassVar[bool] = False
    leaps_decodes: ClassVar[bool] = True  # no hooks
    leaps_while_waiting: ClassVar[bool] = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._queue: deque[Request] = deque()

    def peek(self, now: float) -> Request | None:
        return self._queue[0] if self._queue else None

    def _push(self, req: Request, now: float) -> None:
        self._queue.append(req)

    def _push_front(self, req: Request, now: float) -> None:
        self._queue.appendleft(req)

    def _pop(self, now: float) -> Request:
        return self._queue.popleft()

    def _remove(self, req: Request) -> None:
        self._queue.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def running_key(self, req: Request) -> tuple[float, ...]:
        return (req.arrival_time,)

    def victim_key(self, victim: Request, borrowed: Sequence[int]) -> tuple[float, ...]:
        return (-victim.arrival_time,)  # the newest goes first, as in vLLM

    def returns_first(self, swapped: Request, head: Request) -> bool:
        return True  # every swapped request comes back before anything new, whatever its tier

    def prefill_chunk_cap(self, req: Request) -> int | None:
        cfg = self.config.scheduler
        return cfg.long_prompt_chunk_tokens if req.num_prompt_tokens > cfg.long_prompt_tokens else None
