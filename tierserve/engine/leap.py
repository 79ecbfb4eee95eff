"""Fast simulation: the running decodes kept in aggregate, and runs of steps leapt over.

In a busy engine most of each step is the same from one step to the next: every running
request past its prompt decodes one token. The fast simulation keeps those requests, the
*kept decoders*, in aggregate (`_Run`) instead of walking them in every step:

- a step's decodes are priced from their count and summed context (which grows by their
  number each step), and their tokens are drawn only when a request is read;
- each request is touched only on the steps where something happens to it: it needs a
  new KV block (every `block_size` steps, in the running order), fills one (entered in
  the prefix cache, in the batch's order) or reaches max_tokens (it ends, as
  `Lifecycle.apply` ends it). Its token ids and counters are brought up to date then, and
  whenever anything else is about to read them (`flush`).

Two kinds of step use the kept decoders:

- `run` leaps over steps in which every running request decodes and nobody is admitted,
  swapped in or shed — with requests waiting or swapped out (a full KV cache), each
  step's pass is checked first by `Scheduler.decodes_only` — up to and including the first
  step in which requests end, so that the caller can send more;
- a full step (`Engine.step`) runs the scheduler's pass with the kept decoders' decodes
  added at once (`decode`) and everything else — the prompts that prefill, admissions,
  the policy's hooks — done as always; a request whose prompt completes joins the kept
  decoders. Where the pass would do what the aggregate cannot (preempt, swap, leave a
  decode out of the step) the decoders are written out first or the step is taken the
  ordinary way (`keeps`, `takes`).

The results are the step-by-step results to the bit (tests/engine/test_leap.py, and
`tierserve bench sim-speed` on any workload, compare them request by request). The
kept decoders last while nothing else touches the running requests: `Engine` calls
`flush` before anything that reads or changes them from outside (a request's lookup, an
abort, a preemption, an ordinary step); the lifecycle's `version` catches a change that
came another way (a `LeapStateError`, not silently wrong results).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.engine.lifecycle import Lifecycle, RequestOutput
from tierserve.engine.scheduler import Scheduler, SchedulerOutput
from tierserve.engine.stats import EngineStats
from tierserve.executors.base import ScheduledSeq, StepBatch, StepResult
from tierserve.executors.sim.executor import SimExecutor
from tierserve.memory.errors import KVIntegrityError
from tierserve.memory.manager import Alloc, KVCacheManager
from tierserve.request import FinishReason, Request, RequestStatus, prefilling
from tierserve.scheduling.base import Policy, RunningPass
from tierserve.scheduling.step import StepBudget
from tierserve.tiers import ALL_TIERS, Tier

# Called as each leapt step begins (the state a step-by-step caller sees just before
# `Engine.step`: the clock, the blocks held, the counters), with the step's duration.
StepObserver = Callable[[float], None]


class LeapResult(NamedTuple):
    num_steps: int  # leapt steps (0: the next step must be a full `Engine.step`)
    ended: list[RequestOutput]  # requests that reached max_tokens in the last one


class LeapStateError(RuntimeError):
    """The running requests changed while their progress was kept unwritten."""


@dataclass(eq=False, slots=True)
class _Decoder:
    """A kept decoder: after the run's step k its request holds `num_tokens0 + k` tokens,
    `num_tokens0 + k - 1` of them computed; `num_done` run steps are written into it."""

    request: Request
    num_tokens0: int
    num_done: int


class _Chunk(NamedTuple):
    """A prompt's chunk in vLLM's walk, with the step's tokens left when the walk reaches it."""

    request: Request
    num_tokens: int
    tokens_left: int


@dataclass(slots=True)
class _Run:
    """The kept decoders and the rest of the running requests, while nobody else touches them."""

    decoders: dict[Request, _Decoder]
    prefilling: list[Request]  # the other running requests (prompts to finish), in running order
    ranks: dict[Request, float]  # each running request's place in the running order
    grows: list[list[_Decoder]]  # by the step (mod block_size) at which they need a block, in order
    fills: list[list[_Decoder]]  # ... and at which they fill one
    ends: dict[int, list[_Decoder]]  # by the step in which they reach max_tokens (after k)
    context: int  # the decoders' summed context as step k + 1 begins
    version: int  # the lifecycle's version the run's state belongs to
    k: int = 0  # the run's steps so far


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
        self._run: _Run | None = None
        self._growing: list[_Decoder] = []  # the decoders that take a block in the coming full step

    # ---- leaping over steps --------------------------------------------------------------

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
        if len(running) > min(cfg.max_num_batched_tokens, cfg.max_num_seqs):
            return False
        if self._run is not None:
            return not self._run.prefilling  # every other running request is a kept decoder
        return not prefilling(running) and all(self._keepable(r) for r in running)

    def run(self, until: float, on_step: StepObserver | None) -> LeapResult:
        """Leap over steps while the clock is before `until` and no step finds a block
        short, up to and including the first step in which requests reach max_tokens.
        Call only when `steady`."""
        run = self._resume() or self._start()
        if run is None:
            raise LeapStateError("no steady decodes to leap over (ask `steady` first)")
        # Requests that wait or are swapped out stay so through the leap (nobody is
        # admitted, swapped in or shed in it; arrivals end it), but each step's pass must
        # be known to leave them so.
        queued = bool(self.lifecycle.swapped or self.policy.num_waiting())
        first = run.k
        ended: list[RequestOutput] = []
        while not ended and self.clock.now() < until:
            step = run.k + 1
            growing = self._needing_blocks(run, step)
            tiers = [d.request.tier for d in growing]
            if growing and not self.memory.fits_one_each(tiers):
                break
            if not queued:
                self.policy.steady_step()
            elif not self.scheduler.decodes_only(_by_tier(tiers), self.clock.now()):
                break
            num_seqs = len(run.decoders)
            cost = self.executor.decode_step_cost(num_seqs, run.context)
            if on_step is not None:
                on_step(cost.total_s)
            self._account(cost.total_s, cost.roofline_s, num_seqs)
            self._grow(growing, step)
            ended = self._advance(run, step)
        self._settled(run)
        return LeapResult(run.k - first, ended)

    def flush(self) -> None:
        """Write the kept decoders' progress into their requests and stop keeping them."""
        run, self._run = self._run, None
        if run is not None:
            for d in run.decoders.values():
                self._write(d, run.k)

    # ---- a full step beside the kept decoders (`Engine.step`, `Scheduler.schedule`) ------

    def keeps(self) -> bool:
        """Whether the coming full step can keep the running decodes in aggregate: nobody
        swapped out, every decoder keepable and in the step's token budget, and a block free
        for each that needs one. Changes nothing if not (the caller then flushes and steps
        the ordinary way)."""
        life, policy = self.lifecycle, self.policy
        if not policy.leaps_decodes or not life.running or life.swapped:
            return False
        run = self._resume() or self._start()
        if run is None:
            return False
        growing = self._needing_blocks(run, run.k + 1)
        # vLLM's walk checks its own blocks and tokens (`walk`): they may run out partway.
        if policy.running_pass is RunningPass.PROTECTED:
            if len(run.decoders) > self.config.scheduler.max_num_batched_tokens:
                return False
            if growing and not self.memory.fits_one_each([d.request.tier for d in growing]):
                return False
        self._growing = growing
        return True

    def prefilling(self) -> list[Request]:
        """`KeptDecodes.prefilling`: the running requests that are not kept decoders."""
        run = self._kept()
        return list(run.prefilling)

    def decode(self, step: StepBudget) -> None:
        """`KeptDecodes.decode`: the kept decoders take their blocks and decode in `step`."""
        run = self._kept()
        self._grow(self._growing, run.k + 1)
        running = self.lifecycle.running
        step.add_decodes(running if not run.prefilling else [r for r in running if r in run.decoders])
        step.decode_context = run.context

    def walk(self, step: StepBudget) -> bool:
        """`KeptDecodes.walk`: vLLM's walk over the running requests in admission order
        (`Scheduler._walk_in_admission_order`) with the kept decoders in aggregate: each
        decoder takes one token and each prompt its chunk, in running order, until the
        step's tokens run out (the decoders after that sit the step out). False, with
        nothing changed, where a block it needs is short (the walk would preempt) or the
        policy capped the step."""
        run, memory = self._kept(), self.memory
        if step.capped_tiers:
            return False
        running, ranks = self.lifecycle.running, run.ranks
        initial = step.tokens_left
        chunks, cut, tokens_left = self._plan_walk(run, step)
        limit = ranks[running[cut]] if cut < len(running) else math.inf
        # The blocks the walk takes, in its order, checked before any is taken.
        walked: list[_Decoder | _Chunk] = [d for d in self._growing if ranks[d.request] < limit]
        walked.extend(chunks)
        walked.sort(key=lambda x: ranks[x.request])
        if not memory.fits_each([(x.request.tier, self._new_blocks(x)) for x in walked]):
            step.tokens_left = initial
            return False
        for x in walked:
            if isinstance(x, _Decoder):
                self._grow([x], run.k + 1)
            else:
                if memory.grow(x.request, x.request.num_computed_tokens + x.num_tokens) is not Alloc.OK:
                    raise KVIntegrityError(f"{x.request.request_id}: a checked block could not be had")
                step.tokens_left = x.tokens_left
                step.add_prefill(x.request, x.num_tokens)
        decoding = [r for r in running[:cut] if r in run.decoders]
        step.add_decodes(decoding)
        step.tokens_left = tokens_left
        if len(decoding) == len(run.decoders):
            step.decode_context = run.context
        return True

    def _plan_walk(self, run: _Run, step: StepBudget) -> tuple[list[_Chunk], int, int]:
        """The walk's tokens, without taking anything: each prompt's chunk (from the tokens
        left at its place, behind the decoders before it), the position before which the
        walk stops (the tokens ran out), and the tokens left after it."""
        running, policy = self.lifecycle.running, self.policy
        tokens_left = step.tokens_left
        last = -1  # the position of the last prompt walked
        chunks: list[_Chunk] = []
        for req in run.prefilling:
            i = running.index(req)
            if tokens_left < i - last:  # the decoders before it take the last tokens
                return chunks, last + 1 + tokens_left, 0
            tokens_left -= i - last - 1
            last = i
            step.tokens_left = tokens_left
            n = step.chunk_for(req, policy.prefill_chunk_cap(req))
            if n >= 1:
                chunks.append(_Chunk(req, n, tokens_left))
                tokens_left -= n
        trailing = len(running) - last - 1
        if tokens_left < trailing:
            return chunks, last + 1 + tokens_left, 0
        return chunks, len(running), tokens_left - trailing

    def _new_blocks(self, x: _Decoder | _Chunk) -> int:
        """The blocks a walked decoder (one: it is among those that need one) or chunk takes."""
        if isinstance(x, _Decoder):
            return 1
        req = x.request
        return self.memory.blocks_for(req.num_computed_tokens + x.num_tokens) - len(req.block_ids)

    def takes(self, out: SchedulerOutput) -> bool:
        """Whether the pass that built `out` left the kept decoders as they were: nothing
        preempted or swapped (nor written out to choose a victim). Decodes the policy left
        out of the step (`StepBudget.drop_where`) are fine."""
        run = self._run
        return run is not None and not out.preempted and not out.swap_in and not out.swap_out

    def execute(self, out: SchedulerOutput) -> list[RequestOutput]:
        """`Engine.step`'s execution and bookkeeping for a step that `takes`: the prompts'
        chunks one by one, the kept decoders in aggregate. Returns the outputs of the
        prompts' chunks and of the decoders that end (the others' tokens are drawn when
        read)."""
        run = self._kept()
        life, stats = self.lifecycle, self.stats
        step = run.k + 1
        admitted = self._place_admitted(run)
        prefills, decodes = out.batch.prefills, out.batch.decodes
        if len(decodes) == len(run.decoders):
            result = self._execute_beside(prefills, len(decodes), run.context)
            outputs = self._advance(run, step)
        elif 2 * len(decodes) < len(run.decoders):
            # Most decoders sit this step out (e.g. a P0-only step): the run stays at its
            # step, and the few that decode move on one step ahead of it.
            decoding = [run.decoders[seq.request] for seq in decodes]
            context = sum(d.num_tokens0 + step - 2 for d in decoding)
            result = self._execute_beside(prefills, len(decodes), context)
            outputs = self._advance_some(run, decoding, step)
        else:
            # A few sit it out: they fall one step behind the run, which moves on.
            sitting = _left_out(run, decodes)
            context = run.context - sum(d.num_tokens0 + step - 2 for d in sitting)
            result = self._execute_beside(prefills, len(decodes), context)
            for d in sitting:
                self._shift(run, d, -1)
            run.context -= len(sitting)
            outputs = self._advance(run, step)
        outputs.extend(life.apply(StepBatch([], prefills), result, self.executor.spec.eos_token_ids))
        stats.num_steps += bool(len(out.batch))  # as `Engine._execute`: a step with no work is none
        stats.num_kept_steps += bool(len(out.batch))
        stats.last_step_tokens = out.batch.num_tokens
        stats.last_step_seqs = len(out.batch)
        stats.last_step_s = result.duration_s
        self._join(run, admitted)
        return outputs

    # ---- the run's state -----------------------------------------------------------------

    def _kept(self) -> _Run:
        if self._run is None:
            raise LeapStateError("no kept decoders (written out by a flush)")
        return self._run

    def _resume(self) -> _Run | None:
        run = self._run
        if run is not None and run.version != self.lifecycle.version:
            self._run = None
            raise LeapStateError("the running requests changed while their progress was kept (flush first)")
        return run

    def _start(self) -> _Run | None:
        """Keep the running requests' decodes, or None if one of them cannot be kept."""
        life = self.lifecycle
        if self.policy.running_pass is RunningPass.PROTECTED and life.unsorted:
            # What the next pass would do first; it is stable, so doing it now changes nothing.
            life.running.sort(key=self.policy.running_key)
            life.unsorted = False
        running = life.running
        others = prefilling(running)
        skipped = set(others)
        decoders = [r for r in running if r not in skipped] if others else running
        if not all(self._keepable(r) for r in decoders):
            return None
        size = self.memory.block_size
        ranks = {r: float(i) for i, r in enumerate(running)}
        run = _Run({}, others, ranks, [[] for _ in range(size)], [[] for _ in range(size)], {}, 0, 0)
        for r in decoders:
            self._add(run, r, in_order=True)
        run.version = life.version
        self._run = run
        return run

    def _keepable(self, req: Request) -> bool:
        # A stop token could be sampled (EOS never is: the sim executor's placeholders); a
        # request behind on caching is cached on every step, not only at a block's end.
        return not req.sampling.stop_token_ids and req.request_id not in self.memory.caching_behind

    def _add(self, run: _Run, req: Request, *, in_order: bool = False) -> None:
        """Keep a running request that decodes from the run's next step on (`in_order`:
        it comes after every decoder kept so far)."""
        d = _Decoder(req, req.num_tokens - run.k, run.k)
        run.decoders[req] = d
        self._link(run, d, in_order)
        run.context += req.num_computed_tokens

    def _link(self, run: _Run, d: _Decoder, in_order: bool = False) -> None:
        """File the decoder by the steps at which it needs a block, fills one and ends."""
        size, n0 = self.memory.block_size, d.num_tokens0
        # Step k starts with n0 + k - 1 tokens (needs a block when that is one past a
        # block's end) and ends with n0 - 1 + k computed (a block fills when that is a
        # multiple of block_size).
        grows, fills = run.grows[(2 - n0) % size], run.fills[(1 - n0) % size]
        if in_order:
            grows.append(d)
            fills.append(d)
        else:
            ranks = run.ranks
            bisect.insort(grows, d, key=lambda x: ranks[x.request])
            bisect.insort(fills, d, key=lambda x: ranks[x.request])
        run.ends.setdefault(_end_step(d), []).append(d)

    def _unlink(self, run: _Run, d: _Decoder, *, ends: bool = True) -> None:
        """Undo `_link` (`ends`: also where it ends; not for a step's ending, taken whole)."""
        size, n0 = self.memory.block_size, d.num_tokens0
        run.grows[(2 - n0) % size].remove(d)
        run.fills[(1 - n0) % size].remove(d)
        if ends:
            end = _end_step(d)
            ending = run.ends[end]
            ending.remove(d)
            if not ending:
                del run.ends[end]

    def _drop(self, run: _Run, d: _Decoder, *, ends: bool = True) -> None:
        """Stop keeping a decoder (it ended)."""
        self._unlink(run, d, ends=ends)
        del run.decoders[d.request]
        del run.ranks[d.request]

    def _shift(self, run: _Run, d: _Decoder, steps: int) -> None:
        """Move a decoder `steps` steps ahead of the run (behind, if negative): it needs
        blocks, fills them and ends that many steps sooner."""
        self._unlink(run, d)
        d.num_tokens0 += steps
        d.num_done -= steps  # the same positions written
        self._link(run, d)

    def _needing_blocks(self, run: _Run, step: int) -> list[_Decoder]:
        """The decoders that need a new block to decode in `step`, in running order."""
        size = self.memory.block_size
        # blocks_for(num_tokens0 + step - 1), inlined
        return [
            d
            for d in run.grows[step % size]
            if -(-(d.num_tokens0 + step - 1) // size) > len(d.request.block_ids)
        ]

    def _grow(self, growing: list[_Decoder], step: int) -> None:
        for d in growing:
            if self.memory.grow(d.request, d.num_tokens0 + step - 1) is not Alloc.OK:
                raise KVIntegrityError(f"{d.request.request_id}: a checked block could not be had")

    def _advance(self, run: _Run, step: int) -> list[RequestOutput]:
        """`Lifecycle.apply` for the kept decoders' tokens of `step`: blocks that fill are
        cached and requests that reach max_tokens end, in the batch's order."""
        filling = run.fills[step % self.memory.block_size] if self.memory.enable_prefix_caching else []
        ending = run.ends.pop(step, None)
        run.context += len(run.decoders)
        run.k = step
        if ending is None:
            for d in filling:
                self._write(d, step)
                self.memory.cache_computed_blocks(d.request)
            return []
        ranks, ends = run.ranks, set(ending)
        outputs: list[RequestOutput] = []
        for d in sorted(dict.fromkeys([*filling, *ending]), key=lambda x: ranks[x.request]):
            req = d.request
            self._write(d, step)
            self.memory.cache_computed_blocks(req)
            if d in ends:
                self.lifecycle.end(req, FinishReason.LENGTH)
                outputs.append(RequestOutput(req, [req.token_ids[-1]], True))
                self._drop(run, d, ends=False)
                run.context -= req.num_computed_tokens
        return outputs

    def _execute_beside(self, prefills: list[ScheduledSeq], num_decodes: int, context: int) -> StepResult:
        """Price the step and take its time (`Engine._execute`'s bookkeeping, before the
        results apply); the decodes' tokens are counted here, their ids drawn when read."""
        result = self.executor.execute_beside(prefills, num_decodes, context)
        stats = self.stats
        stats.roofline_s += result.roofline_s
        if result.duration_s > 0:
            self.clock.elapse(result.duration_s)
        stats.busy_s += result.duration_s
        stats.num_generated_tokens += num_decodes
        return result

    def _advance_some(self, run: _Run, decoding: list[_Decoder], step: int) -> list[RequestOutput]:
        """`_advance` for a step (the run's `step`) in which only `decoding` (in the batch's
        order) decode: the run stays where it was, and each of them moves one step ahead."""
        size, caching = self.memory.block_size, self.memory.enable_prefix_caching
        outputs: list[RequestOutput] = []
        for d in decoding:
            req = d.request
            computed = d.num_tokens0 + step - 1  # once this step's decode is done
            ends = _end_step(d) == step
            if ends or (caching and computed % size == 0):
                self._write(d, step)
                self.memory.cache_computed_blocks(req)
            if ends:
                self.lifecycle.end(req, FinishReason.LENGTH)
                outputs.append(RequestOutput(req, [req.token_ids[-1]], True))
                self._drop(run, d)
                run.context -= computed - 1
            else:
                self._shift(run, d, 1)
                run.context += 1
        return outputs

    def _place_admitted(self, run: _Run) -> list[Request]:
        """Put the requests the pass admitted (appended to the running list) where the next
        pass's sort would (stable: after their equals, in admission order); returns them."""
        life = self.lifecycle
        running = life.running
        n = len(run.decoders) + len(run.prefilling)  # the running requests before the pass
        admitted = running[n:]
        if not admitted:
            return []
        ranks = run.ranks
        if self.policy.running_pass is RunningPass.ADMISSION_ORDER:  # never sorted: at the end
            rank = ranks[running[n - 1]] if n else 0.0
            for req in admitted:
                rank += 1.0
                ranks[req] = rank
            return admitted
        del running[n:]
        key = self.policy.running_key
        for req in admitted:
            i = bisect.bisect_right(running, key(req), key=key)
            running.insert(i, req)
            ranks[req] = _rank_between(running, i, ranks)
        life.unsorted = False
        return admitted

    def _join(self, run: _Run, admitted: list[Request]) -> None:
        """After a full step: the requests whose prompts completed join the kept decoders
        (or, where one cannot be kept, every decoder is written out)."""
        still: list[Request] = []
        ranks = run.ranks
        keepable = True
        for req in [*run.prefilling, *admitted]:
            if req.status is not RequestStatus.RUNNING:
                ranks.pop(req, None)
            elif req.is_prefilling:
                still.append(req)
            elif self._keepable(req):
                self._add(run, req)
            else:
                keepable = False
        run.prefilling = sorted(still, key=ranks.__getitem__) if len(still) > 1 else still
        self._settled(run)
        if not keepable:
            self.flush()

    def _settled(self, run: _Run) -> None:
        """The changes made through the run are its own: note the lifecycle's version."""
        run.version = self.lifecycle.version
        if not run.decoders and not run.prefilling:
            self._run = None

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
        """Bring the request to the end of the run's step `num_steps`: its sampled tokens
        and computed count, as `Lifecycle.apply` would have left them."""
        req = d.request
        # Step s samples the token at position num_tokens0 + s - 1.
        req.token_ids.extend(
            self.executor.tokens_at(req.request_id, d.num_tokens0 + d.num_done, d.num_tokens0 + num_steps)
        )
        req.num_computed_tokens = d.num_tokens0 - 1 + num_steps
        d.num_done = num_steps


def _end_step(d: _Decoder) -> int:
    """The run's step in which the decoder reaches max_tokens."""
    req = d.request
    return req.sampling.max_tokens + req.num_prompt_tokens - d.num_tokens0


def _left_out(run: _Run, decodes: list[ScheduledSeq]) -> list[_Decoder]:
    """The kept decoders not among a step's `decodes`."""
    decoding = {seq.request for seq in decodes}
    return [d for r, d in run.decoders.items() if r not in decoding]


def _rank_between(running: list[Request], i: int, ranks: dict[Request, float]) -> float:
    """A rank for `running[i]` between its neighbours' (renumbering them all when the
    floats between two neighbours run out)."""
    lo = ranks[running[i - 1]] if i > 0 else None
    hi = ranks[running[i + 1]] if i + 1 < len(running) else None
    if lo is None:
        return 0.0 if hi is None else hi - 1.0
    if hi is None:
        return lo + 1.0
    mid = (lo + hi) / 2
    if lo < mid < hi:
        return mid
    for j, req in enumerate(running):
        ranks[req] = float(j)
    return float(i)


def _by_tier(tiers: list[Tier]) -> list[int]:
    """How many of `tiers` are each tier (the blocks a step's decodes take, by tier)."""
    counts = [0] * len(ALL_TIERS)
    for tier in tiers:
        counts[tier] += 1
    return counts
