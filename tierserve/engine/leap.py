"""Fast simulation: leap over runs of steps in which every running request decodes.

While every running request decodes and nobody can be admitted, swapped in or shed,
each step's pass makes the same choice — every running request gets one token — until a
request finishes, a request arrives, or a block cannot be had. With nothing waiting that
holds by itself; with requests waiting or swapped out (a full KV cache), each step's pass
is checked first by `Scheduler.decodes_only`. `DecodeLeap` runs such a
run without the pass, the batch or the per-request updates of `Engine.step`: a step's
duration comes from the decoders' summed context (which grows by the batch size each
step), and each request is touched only on the steps where something happens to it —
it needs a new KV block (every `block_size` steps, in the pass's order) or fills one
(entered in the prefix cache, in the batch's order). Its token ids and counters are
brought up to date at those steps and at the end of the run.

The run ends with the first step in which requests reach their max_tokens (they end
there, as `Lifecycle.apply` ends them), so that the caller can send more; admissions and
preemptions happen in `Engine.step`. The results are the step-by-step results
(tests/engine/test_leap.py compares them request by request).

A run cut short by `until` (the caller's next event) is kept, unwritten, and the next
`run` resumes it where it stopped, as long as nothing else touched the engine: a fleet's
replica is asked to leap again at every event anywhere in the fleet, most of which never
reach it, and writing back and rebuilding every running request each time cost more than
the steps themselves. `Engine` calls `flush` before anything that reads or changes the
requests (a step, a new request, an abort, a lookup); the lifecycle's `version` catches a
change that came another way (a `LeapStateError`, not silently wrong results).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.engine.lifecycle import Lifecycle, RequestOutput
from tierserve.engine.scheduler import Scheduler
from tierserve.engine.stats import EngineStats
from tierserve.executors.sim.executor import SimExecutor
from tierserve.memory.errors import KVIntegrityError
from tierserve.memory.manager import Alloc, KVCacheManager
from tierserve.request import FinishReason, Request, prefilling
from tierserve.scheduling.base import Policy, RunningPass
from tierserve.tiers import ALL_TIERS, Tier

# Called as each leapt step begins (the state a step-by-step caller sees just before
# `Engine.step`: the clock, the blocks held, the counters), with the step's duration.
StepObserver = Callable[[float], None]


class LeapResult(NamedTuple):
    num_steps: int  # leapt steps (0: the next step must be a full `Engine.step`)
    ended: list[RequestOutput]  # requests that reached max_tokens in the last one


class LeapStateError(RuntimeError):
    """The running requests changed while a leap held their progress unwritten."""


@dataclass(slots=True)
class _Decoder:
    """A running request during a run; `num_tokens0` is its token count when the run began."""

    request: Request
    num_tokens0: int
    num_done: int = 0  # leapt steps already written into `request`


@dataclass(slots=True)
class _Run:
    """A run of leapt steps, resumable while the engine is left alone (`DecodeLeap.run`)."""

    decoders: list[_Decoder]
    grows: list[list[_Decoder]]  # by the step (mod block_size) at which they need a block
    fills: list[list[_Decoder]]  # ... and at which they fill one
    last: int  # the step in which the first requests reach max_tokens: the run's last
    context: int  # the decoders' summed context as step k + 1 begins
    version: int  # the lifecycle's version the run's state belongs to
    k: int = 0  # steps run so far


class DecodeLeap:
    def __init__(
        self,
        config: EngineConfig,
        policy: Policy,
        memory: KVCacheManager,
        executor: SimExecutor,
        clock: Clock,
        lifecycle: Lifecycle,
        scheduler: Scheduler,
        stats: EngineStats,
    ) -> None:
        self.config = config
        self.policy = policy
        self.memory = memory
        self.executor = executor
        self.clock = clock
        self.lifecycle = lifecycle
        self.scheduler = scheduler
        self.stats = stats
        self._run: _Run | None = None  # a run cut short by `until`, kept for the next call

    def steady(self) -> bool:
        """Whether the next pass would give every running request one decode token and
        nothing else (the caller checks for forced preemptions and deferred ends; with
        requests waiting or swapped out, `Scheduler.decodes_only` checks each step)."""
        life, cfg, policy = self.lifecycle, self.config.scheduler, self.policy
        running = life.running
        if not policy.leaps_decodes or not running:
            return False
        if (life.swapped or policy.num_waiting()) and not policy.leaps_while_waiting:
            return False
        if self._run is not None:
            return True  # the running requests are still the kept run's decoders
        if len(running) > min(cfg.max_num_batched_tokens, cfg.max_num_seqs):
            return False
        # A stop token could be sampled; EOS never is (the sim executor's placeholders).
        return not prefilling(running) and not any(r.sampling.stop_token_ids for r in running)

    def run(self, until: float, on_step: StepObserver | None) -> LeapResult:
        """Leap over steps while the clock is before `until` and no step finds a block
        short, up to and including the first step in which requests reach max_tokens.
        Resumes the run that the last call cut short at `until`, if it is still there."""
        run = self._resume()
        if run is None:
            run = self._start()
        decoders, grows, fills, last = run.decoders, run.grows, run.fills, run.last
        size = self.memory.block_size
        num_seqs, context, k = len(decoders), run.context, run.k
        # Requests that wait or are swapped out stay so through the leap (nobody is
        # admitted, swapped in or shed in it; arrivals end it), but each step's pass must
        # be known to leave them so.
        queued = bool(self.lifecycle.swapped or self.policy.num_waiting())
        first = k
        ended: list[RequestOutput] = []
        cut = False  # stopped by `until`: the run can go on later
        while k < last:
            if self.clock.now() >= until:
                cut = True
                break
            step = k + 1
            growing = [d for d in grows[step % size] if self._needs_block(d, step)]
            tiers = [d.request.tier for d in growing]
            if growing and not self.memory.fits_one_each(tiers):
                break
            if not queued:
                self.policy.steady_step()
            elif not self.scheduler.decodes_only(_by_tier(tiers), self.clock.now()):
                break
            cost = self.executor.decode_step_cost(num_seqs, context)
            if on_step is not None:
                on_step(cost.total_s)
            self._account(cost.total_s, cost.roofline_s, num_seqs)
            for d in growing:
                if self.memory.grow(d.request, d.num_tokens0 + step - 1) is not Alloc.OK:
                    raise KVIntegrityError(f"{d.request.request_id}: a checked block could not be had")
            filling = fills[step % size] if self.memory.enable_prefix_caching else []
            k = step
            if step == last:
                ended = self._apply_last(decoders, filling, step)
                break
            for d in filling:
                self._write(d, step)
                self.memory.cache_computed_blocks(d.request)
            context += num_seqs
        run.k, run.context = k, context
        if cut:
            run.version = self.lifecycle.version
        else:
            self.flush()  # the next step is a full one (or the run ended requests)
        return LeapResult(k - first, ended)

    def flush(self) -> None:
        """Write the kept run's progress into its requests and drop it."""
        run, self._run = self._run, None
        if run is not None:
            for d in run.decoders:
                self._write(d, run.k)

    def _resume(self) -> _Run | None:
        run = self._run
        if run is not None and run.version != self.lifecycle.version:
            self._run = None
            raise LeapStateError(
                "the running requests changed while a leap held their progress (flush first)"
            )
        return run

    def _start(self) -> _Run:
        if self.policy.running_pass is RunningPass.PROTECTED and self.lifecycle.unsorted:
            # What the next pass would do first; it is stable, so doing it now changes nothing.
            self.lifecycle.running.sort(key=self.policy.running_key)
            self.lifecycle.unsorted = False
        running = self.lifecycle.running
        decoders = [_Decoder(r, r.num_tokens) for r in running]
        last = min(r.sampling.max_tokens - r.num_output_tokens for r in running)
        size = self.memory.block_size
        grows: list[list[_Decoder]] = [[] for _ in range(size)]
        fills: list[list[_Decoder]] = [[] for _ in range(size)]
        for d in decoders:
            # Step k starts with num_tokens0 + k - 1 tokens (needs a block when that is one
            # past a block's end) and ends with num_tokens0 - 1 + k computed (a block fills
            # when that is a multiple of block_size).
            grows[(2 - d.num_tokens0) % size].append(d)
            fills[(1 - d.num_tokens0) % size].append(d)
        context = sum(d.num_tokens0 - 1 for d in decoders)
        self._run = _Run(decoders, grows, fills, last, context, self.lifecycle.version)
        return self._run

    def _apply_last(
        self, decoders: list[_Decoder], filling: list[_Decoder], step: int
    ) -> list[RequestOutput]:
        """`Lifecycle.apply` for the step in which requests reach max_tokens: blocks that
        fill are cached and requests end, in the batch's order."""
        fills = {id(d) for d in filling}
        ended: list[RequestOutput] = []
        for d in decoders:
            req = d.request
            ends = req.sampling.max_tokens - (d.num_tokens0 - req.num_prompt_tokens) == step
            if not ends and id(d) not in fills:
                continue
            self._write(d, step)
            self.memory.cache_computed_blocks(req)
            if ends:
                self.lifecycle.end(req, FinishReason.LENGTH)
                ended.append(RequestOutput(req, [req.token_ids[-1]], True))
        return ended

    def _needs_block(self, d: _Decoder, step: int) -> bool:
        return self.memory.blocks_for(d.num_tokens0 + step - 1) > len(d.request.block_ids)

    def _account(self, duration_s: float, roofline_s: float, num_seqs: int) -> None:
        """`Engine.step`'s bookkeeping for one all-decode step, in the same order."""
        stats = self.stats
        if duration_s > 0:
            self.clock.elapse(duration_s)
        stats.busy_s += duration_s
        stats.roofline_s += roofline_s
        stats.num_generated_tokens += num_seqs
        stats.num_steps += 1
        stats.num_leapt_steps += 1
        stats.last_step_tokens = num_seqs
        stats.last_step_seqs = num_seqs
        stats.last_step_s = duration_s

    def _write(self, d: _Decoder, num_steps: int) -> None:
        """Bring the request to the end of leapt step `num_steps`: its sampled tokens and
        computed count, as `Lifecycle.apply` would have left them."""
        req = d.request
        # Step s samples the token at position num_tokens0 + s - 1.
        req.token_ids.extend(
            self.executor.tokens_at(req.request_id, d.num_tokens0 + d.num_done, d.num_tokens0 + num_steps)
        )
        req.num_computed_tokens = d.num_tokens0 - 1 + num_steps
        d.num_done = num_steps


def _by_tier(tiers: list[Tier]) -> list[int]:
    """How many of `tiers` are each tier (the blocks a step's decodes take, by tier)."""
    counts = [0] * len(ALL_TIERS)
    for tier in tiers:
        counts[tier] += 1
    return counts
