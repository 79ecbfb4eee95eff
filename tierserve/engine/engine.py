"""The engine: schedule -> execute -> update, one iteration at a time.

The executor and the clock are passed in, so the same engine runs in simulation
(`SimExecutor` + `VirtualClock`) and for real (`TorchExecutor` + `WallClock`). With
`fast=True` (simulation only) the running decodes are kept in aggregate through every step
and `leap` runs runs of all-decode steps at once (engine/leap.py).
"""

from __future__ import annotations

import time

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.engine.leap import DecodeLeap, LeapResult, StepObserver
from tierserve.engine.lifecycle import Lifecycle, RequestOutput
from tierserve.engine.scheduler import Scheduler, SchedulerOutput
from tierserve.engine.stats import EngineStats
from tierserve.executors.base import Executor, StepResult
from tierserve.executors.sim.executor import SimExecutor
from tierserve.memory.manager import KVCacheManager
from tierserve.memory.partition import TierPartition
from tierserve.request import EventKind, FinishReason, Request, RequestStatus
from tierserve.scheduling import Policy, create_policy
from tierserve.tiers import Tier


class Engine:
    def __init__(
        self, config: EngineConfig, policy: str | Policy, executor: Executor, clock: Clock, fast: bool = False
    ) -> None:
        """`fast`: let `leap` run steady decode steps at once (needs the `SimExecutor`)."""
        self.config = config
        self.policy = create_policy(policy, config) if isinstance(policy, str) else policy
        self.executor = executor
        self.clock = clock
        spec = executor.spec
        self.spec = spec
        if self.policy.tiered_memory:
            partition = TierPartition.from_tiers(spec.num_device_blocks, config.tiers)
        else:
            partition = TierPartition.flat(spec.num_device_blocks)
        self.memory = KVCacheManager(
            spec.num_device_blocks,
            spec.block_size,
            spec.num_host_blocks,
            partition,
            config.scheduler.enable_prefix_caching,
            evict_by_tier=self.policy.tiered_memory,  # one pool, one LRU: as vLLM and SGLang
        )
        self.stats = EngineStats()
        self.lifecycle = Lifecycle(self.policy, self.memory, clock, self.stats)
        self.scheduler = Scheduler(config, self.policy, self.memory, executor, clock, self.lifecycle)
        self._leap: DecodeLeap | None = None
        if fast:
            if not isinstance(executor, SimExecutor):
                raise ValueError(
                    f"fast simulation needs the simulated executor, not {type(executor).__name__}"
                )
            self._leap = DecodeLeap(
                config, self.policy, self.memory, executor, clock, self.lifecycle, self.scheduler, self.stats
            )
        self._in_step = False
        self._deferred: list[tuple[str, FinishReason]] = []  # ends asked for during a step
        # Time each scheduling pass's CPU into stats.last_schedule_cpu_s (bench overhead).
        # Off by default: the thread clock is a system call, and on a busy host it cost up to
        # a millisecond a call, close to half of a fast simulation's CPU.
        self.time_schedule = False

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, req: Request) -> bool:
        """Queue a request, or reject it now (returns False) if it can never fit."""
        now = self.clock.now()
        if self.lifecycle.get(req.request_id) is not None:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.record(now, EventKind.ARRIVED, req.tier.name)
        reason = self._never_fits(req)
        if reason:
            req.status = RequestStatus.REJECTED
            req.finish_reason = FinishReason.REJECTED
            req.reject_reason = reason
            req.finish_time = now
            req.record(now, EventKind.REJECTED, reason)
            self.stats.num_rejected += 1
            return False
        self.lifecycle.submit(req)
        return True

    def _never_fits(self, req: Request) -> str:
        if req.max_total_tokens > self.spec.max_model_len:
            return (
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.sampling.max_tokens}) "
                f"exceeds {self.spec.context_said()}"
            )
        need = self.memory.blocks_for(req.max_total_tokens)
        most = self.memory.partition.max_blocks(req.tier)
        if need > most:
            return (
                f"needs {need} KV blocks at full length, but tier {req.tier.name} may hold "
                f"at most {most} blocks"
            )
        return ""

    def get_request(self, request_id: str) -> Request | None:
        self._flush()
        return self.lifecycle.get(request_id)

    def abort(self, request_id: str) -> bool:
        """End a request in any state; its blocks go back to the pool (at the step boundary)."""
        return self._end_early(request_id, FinishReason.ABORTED)

    def finish(self, request_id: str) -> bool:
        """End a request as stopped (the caller found a stop string)."""
        return self._end_early(request_id, FinishReason.STOP)

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request at the next step boundary (e.g. to drain a replica)."""
        self._flush()
        req = self.lifecycle.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return False
        self.scheduler.request_preemption(req)
        return True

    def _end_early(self, request_id: str, reason: FinishReason) -> bool:
        self._flush()
        req = self.lifecycle.get(request_id)
        if req is None:
            return False
        if self._in_step:
            self._deferred.append((request_id, reason))
        else:
            self.lifecycle.end(req, reason)
        return True

    # ---- state ---------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.lifecycle.requests)

    def num_waiting(self, tier: Tier | None = None) -> int:
        return self.policy.num_waiting(tier)

    def waiting_by_tier(self) -> tuple[int, ...]:
        """`num_waiting(t)` for each tier, P0 first."""
        return self.policy.waiting_by_tier()

    def num_running(self, tier: Tier | None = None) -> int:
        return self.lifecycle.num_running(tier)

    def num_swapped(self, tier: Tier | None = None) -> int:
        return self.lifecycle.num_swapped(tier)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns the requests that got tokens or ended in it (in fast mode,
        of the requests that decoded, only those that ended: see engine/leap.py)."""
        leap = self._leap
        kept = leap is not None and not self.scheduler.has_forced() and leap.keeps()
        if not kept:
            self._flush()
        self._in_step = True
        outputs: list[RequestOutput] = []
        try:
            timed = self.time_schedule
            started = time.thread_time() if timed else 0.0
            out = self.scheduler.schedule(leap if kept else None)
            if timed:
                self.stats.last_schedule_cpu_s = time.thread_time() - started
            for victim, mode in out.preempted:
                self.stats.preemptions[(victim.tier, mode.value)] += 1
            outputs.extend(RequestOutput(r, [], True) for r in out.shed)
            if leap is not None and kept and leap.takes(out):
                outputs.extend(leap.execute(out))
            else:
                self._flush()
                outputs.extend(self._execute(out))
        finally:
            self._in_step = False
            self.memory.host.copies_done()  # a swap-in's host slots, read by now, are free
        for request_id, reason in self._deferred:
            req = self.lifecycle.get(request_id)
            if req is not None:
                self.lifecycle.end(req, reason)
                outputs.append(RequestOutput(req, [], True))
        self._deferred.clear()
        return outputs

    def _execute(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Run the pass's swaps and batch, and record what they did."""
        duration = self._swap(out)
        result: StepResult | None = None
        if len(out.batch):
            result = self.executor.execute(out.batch)
            duration += result.duration_s
            self.stats.roofline_s += result.roofline_s
        if duration > 0:
            self.clock.elapse(duration)
        self.stats.busy_s += duration
        outputs = []
        if result is not None:
            outputs = self.lifecycle.apply(out.batch, result, self.spec.eos_token_ids)
        self.stats.num_steps += bool(result)
        self.stats.last_step_tokens = out.batch.num_tokens
        self.stats.last_step_seqs = len(out.batch)
        self.stats.last_step_s = duration
        return outputs

    def leap(self, until: float, on_step: StepObserver | None = None) -> LeapResult:
        """Fast simulation: run the steps that start before `until` and in which every
        running request decodes, at once, up to the first in which requests end (their
        outputs are returned; no others are). No steps when not in fast mode or when the
        next must be a full `step`. `on_step(duration_s)` is called for each step."""
        if self._leap is None or self.clock.now() >= until:
            return LeapResult(0, [])  # no step starts before `until` (a fleet with a queue asks often)
        if self.scheduler.has_forced() or self._deferred or not self._leap.steady():
            return LeapResult(0, [])
        return self._leap.run(until, on_step)

    def _flush(self) -> None:
        """Bring the requests up to date with a leap kept for later (fast simulation)."""
        if self._leap is not None:
            self._leap.flush()

    def _swap(self, out: SchedulerOutput) -> float:
        # Out before in: blocks freed by a swap-out may be the destination of a swap-in.
        seconds = 0.0
        if out.swap_out:
            t = self.executor.swap_out(out.swap_out)
            self.stats.swap_out_s += t
            seconds += t
        if out.swap_in:
            t = self.executor.swap_in(out.swap_in)
            self.stats.swap_in_s += t
            seconds += t
        return seconds

    def run_until_done(self, max_steps: int = 10_000_000) -> None:
        """Step until every request has ended (for tests and offline use)."""
        for _ in range(max_steps):
            if not self.lifecycle.requests:
                return
            self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")
