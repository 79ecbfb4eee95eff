"""How long vLLM's steps take here, for hybrid's step bound: a fit of step time to tokens.

tierserve's own engine predicts a step from its executor's cost model; inside vLLM the
plug-in has none, so it learns one from the steps it sees. Each step is timed from when it
could start running (the later of its scheduling and the end of the step before it, which
covers async scheduling's overlap) to when vLLM hands its output back to the scheduler;
a least-squares line through the last WINDOW (tokens, seconds) pairs gives
`estimate_s(num_tokens, context) = fixed + per_token * num_tokens` (context is left out:
on the small batches the bound is for, a step's cost is its fixed part and its tokens).

The fit is redone every REFIT steps, and only once MIN_STEPS steps of at least two sizes
were seen; until then there is no estimate, and hybrid's bound falls back to the token
limits alone. Each refit is a new function, which is how the shaper knows to recompute
its bound.
"""

from __future__ import annotations

from collections import deque

from tierserve.scheduling.step import StepEstimate

WINDOW = 256  # steps the fit covers
REFIT = 32  # steps between fits
MIN_STEPS = 32  # steps before the first fit
MAX_IN_FLIGHT = 64  # scheduled steps awaiting their output (vLLM keeps one or two)


class StepTimes:
    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._scheduled: dict[int, tuple[float, int]] = {}  # id(scheduler output) -> (at, tokens)
        self._last_end = float("-inf")
        self._since_fit = 0
        self.estimate_s: StepEstimate | None = None
        self.fixed_s = 0.0
        self.per_token_s = 0.0

    def scheduled(self, output: object, num_tokens: int, at: float) -> None:
        if num_tokens <= 0:
            return  # nothing to time; vLLM need not hand such a step back
        if len(self._scheduled) >= MAX_IN_FLIGHT:
            self._scheduled.clear()  # outputs never handed back: forget them, not leak
        self._scheduled[id(output)] = (at, num_tokens)

    def finished(self, output: object, at: float) -> None:
        """The step of `output` (as passed to `scheduled`) handed its results back at `at`."""
        started = self._scheduled.pop(id(output), None)
        if started is None:
            return
        scheduled_at, num_tokens = started
        begin = max(scheduled_at, self._last_end)
        self._last_end = at
        if at > begin:
            self.record(num_tokens, at - begin)

    def record(self, num_tokens: int, seconds: float) -> None:
        self._samples.append((num_tokens, seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT and len(self._samples) >= MIN_STEPS:
            self._since_fit = 0
            self._fit()

    def _fit(self) -> None:
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if var == 0:
            return  # one step size only: the per-token part is unknown
        cov = sum((x - mean_x) * (y - mean_y) for x, y in self._samples)
        per_token = max(0.0, cov / var)
        fixed = max(0.0, mean_y - per_token * mean_x)
        self.fixed_s, self.per_token_s = fixed, per_token

        def estimate_s(num_tokens: int, context: int) -> float:
            return fixed + per_token * num_tokens

        self.estimate_s = estimate_s
