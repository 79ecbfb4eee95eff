"""The engine process's brief wait, after it has sent a step's first tokens, until the
server has sent them on.

The first tokens wake the server's event loop, but where the two processes share a CPU
(`bench serve` leaves the server and the engine one CPU between them, the other one to its
load generator), the kernel often lets the running engine process go on with the step's
other work before the task it woke may run: its metrics, the rest of the step's tokens,
the next step's scheduling, ~2.5 ms of Python at 200 streams. The first tokens waited for
it, and the API overhead P50 went from 0.57 ms (engine on a thread of the server, which
waited the same way for the event loop) to 3.8 ms (docs/measurements/serving.md has the breakdown).
So the engine waits, blocked, until the server says `FirstsHandled`, or for a bound that
grows with the number of first tokens: a server that is slow to answer costs a step at
most `HANDOFF_WAIT_MAX_S`. Sharing a CPU at 200 streams the wait was 0.7 ms at the median,
0.5 % of the engine's time; with a CPU for each process it was not measured.
"""

from __future__ import annotations

import threading

# Sending one first token takes the server ~0.1 ms on the reference host.
HANDOFF_WAIT_S = 0.001
HANDOFF_WAIT_PER_FIRST_S = 0.0002
HANDOFF_WAIT_MAX_S = 0.010


def handoff_timeout_s(num_firsts: int) -> float:
    """The longest the engine waits for the server to send `num_firsts` first tokens."""
    return min(HANDOFF_WAIT_S + HANDOFF_WAIT_PER_FIRST_S * num_firsts, HANDOFF_WAIT_MAX_S)


class Handoff:
    """Steps are named by when they returned (`StepOutputs.returned_at`), which only grows."""

    def __init__(self) -> None:
        self._handled = threading.Condition()
        self._handled_at = float("-inf")  # the latest step whose first tokens the server has sent

    def handled(self, returned_at: float) -> None:
        """The server has sent the first tokens of the step that returned at `returned_at`
        (called on the engine process's pipe reader thread)."""
        with self._handled:
            if returned_at > self._handled_at:
                self._handled_at = returned_at
                self._handled.notify_all()

    def wait(self, returned_at: float, num_firsts: int) -> bool:
        """Block until the server has sent this step's first tokens, or the bound passes;
        True if it had."""
        with self._handled:
            return self._handled.wait_for(
                lambda: self._handled_at >= returned_at, handoff_timeout_s(num_firsts)
            )
