"""What the HTTP side needs from the engine: the routes, the drain and the metrics use
only this. `EngineClient` (engine_client.py) implements it over an engine in a process of
its own. Every method is called on the server's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import Metric

from tierserve.engine import Engine
from tierserve.request import Request
from tierserve.server.state_metrics import EngineSnapshot
from tierserve.server.streams import RequestHandle
from tierserve.tiers import Tier


class EngineService(Protocol):
    snapshot: EngineSnapshot
    num_step_errors: int
    ttft_trace: dict[str, tuple[float, float]] | None  # set to record in-process TTFTs (benchmark)
    on_lost: Callable[[], None] | None  # called if the engine dies under the server

    @property
    def pid(self) -> int: ...

    @property
    def running(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def num_generating(self) -> int: ...

    def silent_s(self) -> float: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def kill(self) -> None: ...

    async def wait_idle(self, timeout_s: float) -> bool: ...

    def submit(self, request: Request, entitled: Tier) -> RequestHandle: ...

    def abort(self, request_id: str) -> None: ...

    def finish(self, request_id: str) -> None: ...

    def close(self, handle: RequestHandle) -> None: ...

    def cancel(self, handle: RequestHandle) -> None: ...

    async def inspect(self, fn: Callable[[Engine], Any]) -> Any: ...

    async def metric_families(self) -> list[Metric]: ...

    def queued_by_tier(self) -> dict[Tier, int]: ...

    def waiting_by_tier(self) -> dict[Tier, int]: ...
