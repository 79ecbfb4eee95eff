"""One engine replica of a simulated fleet: an `Engine` with the sim executor on its own clock.

The fleet's event loop owns time. A replica runs a step at one of its boundaries: its
clock is moved to the fleet's time, the step advances it by the step's duration, and the
step's outputs are held until the fleet reaches that next boundary, where they are
delivered. A request routed to the replica mid-step waits in its inbox and is handed to
the engine at the next boundary, with its arrival time unchanged (as `bench`'s driver
does). What a scrape sees is the state exported at the last delivered boundary.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from tierserve.clock import VirtualClock
from tierserve.engine import Engine
from tierserve.engine.lifecycle import RequestOutput
from tierserve.request import Request
from tierserve.tiers import ALL_TIERS


class ReplicaState(enum.Enum):
    STARTING = "starting"  # loading the model: costs GPU time, serves nothing
    READY = "ready"
    DRAINING = "draining"  # scaled in: takes no new requests, finishes its own
    STOPPED = "stopped"
    DEAD = "dead"  # failed; its requests were retried or lost


class ReplicaStateError(RuntimeError):
    """A request was sent to a replica that cannot take it."""


@dataclass(frozen=True, slots=True)
class Exported:
    """What the replica's /metrics would show: the engine's state at a boundary."""

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    busy_s: float = 0.0  # GPU-busy seconds since start (a DCGM-like utilization counter)
    # Prompt tokens computed and tokens generated since start (vLLM's prompt_tokens and
    # generation_tokens counters).
    num_tokens: int = 0
    waiting_by_tier: tuple[float, ...] = (0.0,) * len(ALL_TIERS)  # llm_scheduler_queue_depth


class Replica:
    def __init__(self, name: str, build: Callable[[VirtualClock], Engine], launched_s: float) -> None:
        self.name = name
        self.clock = VirtualClock(launched_s)
        self.engine = build(self.clock)
        self.state = ReplicaState.STARTING
        self.launched_s = launched_s
        self.ready_s: float | None = None
        self.ended_s: float | None = None
        self.inbox: list[Request] = []
        self.pending: list[RequestOutput] = []  # outputs of the step in flight
        self.next_boundary: float | None = None  # None: idle, no step in flight or scheduled
        self.exported = Exported()
        # (running, blocks held, busy s, tokens) as the last leapt step began
        self._leapt_step = (0, 0, 0.0, 0)
        # Tokens a second the replica computes in steps that fill its token budget with a
        # prompt: what its compute can do, measured once per model and GPU.
        budget = self.engine.config.scheduler.max_num_batched_tokens
        self.token_capacity = budget / max(1e-9, self.engine.executor.estimate_prefill_s(budget))
        # Read by the autoscaler at each of its ticks, over the interval since the last:
        self.utilization: float | None = None  # the busy fraction
        self.token_load: float | None = None  # tokens a second, as a share of `token_capacity`
        self._busy_at_scrape = (launched_s, 0.0, 0)  # (time, busy_s, num_tokens)
        self.least_waiting: int | None = None  # the fewest waiting requests a scrape found

    @property
    def serving(self) -> bool:
        return self.state in (ReplicaState.READY, ReplicaState.DRAINING)

    def send(self, req: Request) -> None:
        if self.state is not ReplicaState.READY:
            raise ReplicaStateError(f"{self.name} is {self.state.value}: it takes no requests")
        self.inbox.append(req)

    def boundary(self, now: float, until: float = -math.inf) -> tuple[list[RequestOutput], list[Request]]:
        """Deliver the last step's outputs, take in the inbox and start the next step.
        Returns (outputs delivered, requests the engine rejected on arrival).

        A fast engine may instead leap over the steps that start before `until` (when the
        caller knows nothing can reach the replica or read its state before then): the
        boundaries inside the leap deliver nothing but tokens of running requests, and the
        state exported is what the last of them would have exported, as in a step-by-step
        run (the earlier ones' are never read)."""
        delivered, self.pending = self.pending, []
        self.clock.advance_to(now)
        rejected = [r for r in self.inbox if not self.engine.add_request(r)]
        self.inbox.clear()
        self._export()
        if self.engine.has_unfinished():
            leapt = self.engine.leap(until, self._note_leapt_step)
            if leapt.num_steps:
                self._export_last_leapt_step()
                self.pending = leapt.ended
            else:
                self.pending = self.engine.step()
            self.next_boundary = self.clock.now()
        else:
            self.next_boundary = None
        return delivered, rejected

    def _note_leapt_step(self, duration_s: float) -> None:
        """What the boundary before a leapt step would export, but cheap: only the last is
        ever read (nothing reads the replica's state inside a leap), and in a leap the
        waiting requests stay as they were, so the running count, the blocks held and the
        busy time say it all."""
        engine, stats = self.engine, self.engine.stats
        used_blocks = engine.memory.used_blocks_all_tiers()
        num_tokens = stats.num_computed_prompt_tokens + stats.num_generated_tokens
        self._leapt_step = (engine.num_running(), used_blocks, stats.busy_s, num_tokens)

    def _export_last_leapt_step(self) -> None:
        self._set_exported(self.engine.waiting_by_tier(), *self._leapt_step)

    def _export(self) -> None:
        engine = self.engine
        self._set_exported(
            engine.waiting_by_tier(),
            engine.num_running(),
            engine.memory.used_blocks_all_tiers(),
            engine.stats.busy_s,
            engine.stats.num_computed_prompt_tokens + engine.stats.num_generated_tokens,
        )

    def _set_exported(
        self, waiting: tuple[int, ...], num_running: int, used_blocks: int, busy_s: float, num_tokens: int
    ) -> None:
        kv_usage = used_blocks / max(1, self.engine.memory.num_blocks)
        by_tier = tuple(map(float, waiting))
        self.exported = Exported(sum(waiting), num_running, kv_usage, busy_s, num_tokens, by_tier)

    def make_ready(self, now: float) -> None:
        """The model is loaded: the replica takes requests, and its busy fraction is read
        from now (the loading time counted as idle, a replica ready and fully busy read 0.16)."""
        self.state = ReplicaState.READY
        self.ready_s = now
        self._busy_at_scrape = (now, self.exported.busy_s, self.exported.num_tokens)

    def observe_busy(self, now: float) -> None:
        """Read the counters: the busy fraction and the token load since the previous
        reading (None until some time has passed since the replica became ready)."""
        then, busy, num_tokens = self._busy_at_scrape
        if now > then:
            e = self.exported
            self.utilization = min(1.0, (e.busy_s - busy) / (now - then))
            self.token_load = (e.num_tokens - num_tokens) / (now - then) / self.token_capacity
            self._busy_at_scrape = (now, e.busy_s, e.num_tokens)

    def note_waiting(self, num_waiting: int) -> None:
        """A scrape found `num_waiting` requests waiting (`least_waiting`)."""
        if self.least_waiting is None or num_waiting < self.least_waiting:
            self.least_waiting = num_waiting

    def end(self, state: ReplicaState, now: float) -> None:
        self.state = state
        self.ended_s = now
        self.next_boundary = None
        self.pending = []
        self.inbox = []

    def gpu_seconds(self, now: float, num_gpus: int) -> float:
        end = self.ended_s if self.ended_s is not None else now
        return max(0.0, end - self.launched_s) * num_gpus
