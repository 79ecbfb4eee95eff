"""The executor as the server runs it: swap times observed, and simulated time made real.

With `pace=True` (the sim backend) every step and swap blocks the engine thread for the
duration the simulator predicts, so a served request takes the wall-clock time it would
take on the simulated deployment. A real executor (`pace=False`) already takes its time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import Histogram

from tierserve.executors.base import Executor, ExecutorSpec, StepBatch, StepResult


class ServedExecutor:
    def __init__(self, inner: Executor, swap_seconds: Histogram, *, pace: bool) -> None:
        self._inner = inner
        self._swap_out = swap_seconds.labels("out")
        self._swap_in = swap_seconds.labels("in")
        self._pace = pace

    @property
    def spec(self) -> ExecutorSpec:
        return self._inner.spec

    def _hold(self, started: float, duration_s: float) -> None:
        if self._pace:
            left = duration_s - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)

    def execute(self, batch: StepBatch) -> StepResult:
        started = time.perf_counter()
        result = self._inner.execute(batch)
        self._hold(started, result.duration_s)
        return result

    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> float:
        started = time.perf_counter()
        seconds = self._inner.swap_out(mapping)
        self._swap_out.observe(seconds)
        self._hold(started, seconds)
        return seconds

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> float:
        started = time.perf_counter()
        seconds = self._inner.swap_in(mapping)
        self._swap_in.observe(seconds)
        self._hold(started, seconds)
        return seconds

    def estimate_prefill_s(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        return self._inner.estimate_prefill_s(num_tokens, num_context_tokens)

    def estimate_swap_s(self, num_blocks: int) -> float:
        return self._inner.estimate_swap_s(num_blocks)
