"""A request's TTFT on an idle engine: the denominator of the per-request P0 slowdown.

The request is simulated alone on a fresh engine with the same model, GPUs and limits.
A conversation turn finds its history in the prefix cache, as it would on an idle engine
that served the previous turn: a primer request holding the history runs first. Results
are memoised by the request's shape (prompt tokens, history tokens).
"""

from __future__ import annotations

from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig
from tierserve.engine import Engine
from tierserve.executors.base import Executor
from tierserve.request import Request, SamplingParams

MAX_STEPS = 100_000
IDLE_POLICY = "fcfs"  # alone on the engine, every policy schedules the same


class IdleTtft:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self._config, self._executor = config, executor
        self._memo: dict[tuple[int, int], float] = {}

    def __call__(self, num_prompt_tokens: int, num_history_tokens: int = 0) -> float:
        key = (num_prompt_tokens, min(num_history_tokens, num_prompt_tokens - 1))
        if key not in self._memo:
            self._memo[key] = self._simulate(*key)
        return self._memo[key]

    def _simulate(self, num_prompt_tokens: int, num_history_tokens: int) -> float:
        clock = VirtualClock()
        engine = Engine(self._config, IDLE_POLICY, self._executor, clock)
        prompt = [1000 + i for i in range(num_prompt_tokens)]
        if num_history_tokens > 0:
            engine.add_request(Request("primer", prompt[:num_history_tokens], SamplingParams(max_tokens=1)))
            engine.run_until_done(MAX_STEPS)
        req = Request("alone", prompt, SamplingParams(max_tokens=1), arrival_time=clock.now())
        if not engine.add_request(req):
            raise ValueError(f"a {num_prompt_tokens}-token prompt does not fit on an idle engine")
        engine.run_until_done(MAX_STEPS)
        if req.ttft_s is None:
            raise RuntimeError("the request alone never got a first token")
        return req.ttft_s
