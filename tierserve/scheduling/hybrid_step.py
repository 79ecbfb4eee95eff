"""How `hybrid` shapes each step so that a first token waits for little else.

- Step-time bound: while a P0 request is likely (one waits or prefills, or one arrived
  within `p0_likely_s`), the prefill chunks of P1-P3 in a step are capped so that the
  step's predicted duration (the executor's cost model) stays under `step_bound_s` and
  within `p0_step_tokens`, but never under MIN_OTHER_PREFILL_TOKENS, so the other tiers
  keep moving. A chunk deep into a long prompt is priced at its context (its attention
  reads every cached token before it), so it gets fewer tokens than a fresh one. A P0
  arriving at the worst moment then waits for at most one such step before its own.
  With no P0 in sight the full step budget is used. With `step_bound_from_slack` the
  bound widens to the slack P0's recent prompts leave inside its TTFT target (the
  target less the predicted time of the longest of the last RECENT_P0_PROMPTS alone,
  past their cached prefix):
  short P0 prompts need no tight bound, and the other tiers keep their throughput.
  `step_bound_x_p0` (off by default) holds the bound to that multiple of the longest
  recent P0 prompt's own predicted time alone: 0.5 keeps a P0 that arrives mid-step near
  1.5x its idle TTFT, where the SLO alone would leave it far more room (a small model
  whose P0 prompt takes milliseconds), for some of the other tiers' throughput. The
  vLLM plug-in asks the same question (`prefill_cap`) with a step-time fit of its own.
- P0-only prefill steps (`p0_solo_prefill`): a step that prefills a P0 prompt which,
  sharing the step with the other tiers' work, would pass `p0_solo_share` of its TTFT
  target (its wait so far plus the step as built, once for each step its prompt still
  needs) carries P0 work only, in at most half of any SHAPING_WINDOW steps, so the others
  are delayed, never stopped. A P0 prompt that would miss its target sharing the step but
  meet it alone (its wait so far plus the rest of its prompt alone) gets the step past
  that budget, in up to 7 of any SHAPING_WINDOW steps, and P0 prompts longer than it sit
  it out too: a long prompt's P0-only steps had spent the budget when an 89-token prompt,
  after 0.35 s behind its chunk, shared the next step with it and missed 0.5 s (Mooncake's
  synthetic trace). A P0 prompt with time to spare shares its step: a P0-only step costs
  every other running request a step of decoding, and in closed loops of 32 and 128
  clients P0-only steps for every P0 prefill cost 0.2-0.5 % of the goodput for P0 TTFTs
  already far inside the target.
- Background yields (`p3_yields`): a step that prefills P0-P2 while more urgent work
  waits after the pass (a P0 request, or a P1/P2 one that has waited
  `p3_yield_wait_share` of its TTFT target; at 0, the default, any) leaves P3's prompt
  chunks out (in at most half of any window) and P3's decodes (in at most a quarter).
  With nobody waiting, P3's work delays no one: it stays (at 32 closed-loop clients,
  yielding then cost 1 % of the goodput).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from tierserve.request import Request
from tierserve.scheduling.step import StepBudget, StepEstimate, tokens_within
from tierserve.tiers import Tier

if TYPE_CHECKING:
    from tierserve.scheduling.hybrid import HybridOptions

SHAPING_WINDOW = 8
RECENT_P0_PROMPTS = 32  # P0 prompts whose longest sets the slack of the step bound
OTHER_TIERS = (Tier.P1, Tier.P2, Tier.P3)
# The other tiers' prefill gets at least this many tokens a step under the bound: delayed,
# never stopped (a bound below one step's fixed cost, or many decodes, would leave 0).
MIN_OTHER_PREFILL_TOKENS = 64


class StepShaper:
    def __init__(self, options: HybridOptions, max_step_tokens: int, p0_target_s: float) -> None:
        self.options = options
        self.max_step_tokens = max_step_tokens
        self.p0_target_s = p0_target_s
        self.last_p0_arrival = -math.inf
        self._recent_p0: deque[int] = deque(maxlen=RECENT_P0_PROMPTS)  # their prompt tokens
        self._longest_p0 = 0  # of `_recent_p0`
        self._bound: tuple[tuple[int, object], int] | None = None  # ((longest recent P0, cost model), tokens)
        self._solo: deque[bool] = deque(maxlen=SHAPING_WINDOW)
        self._yield_prompts: deque[bool] = deque(maxlen=SHAPING_WINDOW)
        self._yield_decodes: deque[bool] = deque(maxlen=SHAPING_WINDOW)

    def p0_likely(self, num_p0_waiting: int, p0_prefilling: bool, now: float) -> bool:
        return bool(num_p0_waiting) or p0_prefilling or now - self.last_p0_arrival < self.options.p0_likely_s

    def p0_admitted(self, num_prompt_tokens: int) -> int | None:
        """A P0 prompt starts, with `num_prompt_tokens` to compute (past its cached prefix);
        returns the record it pushed out, for `p0_not_admitted`."""
        recent = self._recent_p0
        dropped = recent[0] if len(recent) == recent.maxlen else None
        recent.append(num_prompt_tokens)
        self._longest_p0 = max(recent)
        return dropped

    def p0_not_admitted_once(self, num_prompt_tokens: int, dropped: int | None) -> None:
        """Take one record of `num_prompt_tokens` back, and `dropped`, the record its
        admission pushed out, in its place at the old end (a prompt put back after later
        admissions: theirs stay, and the window keeps its length)."""
        recent = self._recent_p0
        if num_prompt_tokens in recent:
            recent.remove(num_prompt_tokens)
            if dropped is not None:
                recent.appendleft(dropped)
            self._longest_p0 = max(recent, default=0)

    def p0_not_admitted(self, dropped: int | None) -> None:
        """Undo the latest `p0_admitted` (the prompt was put back, not run)."""
        recent = self._recent_p0
        recent.pop()
        if dropped is not None:
            recent.appendleft(dropped)
        self._longest_p0 = max(recent, default=0)

    def bound_s(self, estimate_s: StepEstimate) -> float:
        """The predicted step duration P1-P3 prefill may fill while a P0 is likely."""
        options, longest = self.options, self._longest_p0
        bound = options.step_bound_s
        if options.step_bound_from_slack and longest and math.isfinite(self.p0_target_s):
            bound = max(bound, self.p0_target_s - estimate_s(longest, 0))
        if longest and math.isfinite(options.step_bound_x_p0):
            bound = min(bound, options.step_bound_x_p0 * estimate_s(longest, 0))
        return bound

    def bound_tokens(self, estimate_s: StepEstimate | None) -> int:
        """Tokens of one step within `bound_s`, capped by `p0_step_tokens` (found again
        only when the longest recent P0 prompt or the cost model changes)."""
        key = (self._longest_p0, estimate_s)  # a bound method is equal to its next lookup
        if self._bound is None or self._bound[0] != key:
            most = self.max_step_tokens
            by_time = (
                most
                if estimate_s is None
                else tokens_within(lambda n: estimate_s(n, 0), self.bound_s(estimate_s), most)
            )
            self._bound = (key, min(by_time, self.options.p0_step_tokens))
        return self._bound[1]

    def prefill_cap(
        self,
        num_p0_waiting: int,
        p0_prefilling: bool,
        decode_tokens: int,
        now: float,
        estimate_s: StepEstimate | None,
    ) -> int | None:
        """The prompt tokens P1-P3 may have in the coming step beside `decode_tokens`
        tokens of decodes (None: no cap, no P0 is likely)."""
        if not self.p0_likely(num_p0_waiting, p0_prefilling, now):
            return None
        return self._cap(decode_tokens, estimate_s)

    def _cap(self, num_decodes: int, estimate_s: StepEstimate | None) -> int:
        """What the step bound leaves the other tiers' prompts, but MIN_OTHER_PREFILL_TOKENS."""
        return max(MIN_OTHER_PREFILL_TOKENS, self.bound_tokens(estimate_s) - num_decodes)

    def begin(
        self, step: StepBudget, num_p0_waiting: int, p0_prefilling: bool, num_decodes: int, now: float
    ) -> None:
        """Cap the other tiers' prompt tokens in `step` (beside `num_decodes` decodes) while
        a P0 is likely."""
        if self.p0_likely(num_p0_waiting, p0_prefilling, now):
            cap = self._cap(num_decodes, step.estimate_s)
            step.cap_prefill(OTHER_TIERS, cap, at_least=MIN_OTHER_PREFILL_TOKENS)

    def solo(self, wanted: bool) -> bool:
        """Whether a step for which P0-only work is `wanted` carries P0 work only: with
        `p0_solo_prefill`, in at most half of any SHAPING_WINDOW steps. Called once per
        step, it records the answer (tierserve's engine and the vLLM plug-in both ask)."""
        if not self.options.p0_solo_prefill:
            return False
        solo = wanted and sum(self._solo) < SHAPING_WINDOW // 2
        self._solo.append(solo)
        return solo

    def end(self, step: StepBudget, queued: bool, now: float) -> None:
        """`queued`: whether more urgent work still queues after this pass (the policy's
        judgement: P3 yields to it)."""
        rescued = self._rescued(step, now)
        if rescued:
            # Past the half-window budget: the step is P0's, and P0 prompts longer than
            # every rescued one sit it out too (the shorter ones go first by tokens anyway).
            longest = max(tokens_left(r) for r in rescued)
            step.drop_where(OTHER_TIERS, decodes=True, prefills=True)
            step.drop_prefills([r for r in step.prefills if tokens_left(r) > longest])
            self._solo.append(True)
        elif self.solo(self.p0_at_risk(step, now)):
            step.drop_where(OTHER_TIERS, decodes=True, prefills=True)
        if self.options.p3_yields:
            self._p3_yields(step, queued)

    def p0_at_risk(self, step: StepBudget, now: float) -> bool:
        """Whether a P0 prompt prefilling in `step` would, sharing the step with the other
        tiers' work, pass `p0_solo_share` of its TTFT target: its wait so far plus the step
        as built, once for each step its prompt still needs. The step is priced as one
        chunk of all its tokens after their mean context (weighted by tokens: a decode reads
        its whole context, as a chunk does), which leaves out what later steps carry.
        Without a cost model or a finite P0 target every P0 prefill counts as at risk."""
        p0 = Tier.P0
        prompts = [(r, n) for r, n in step.prefills.items() if r.tier is p0]
        share = self.options.p0_solo_share
        if not prompts or share == 0 or step.estimate_s is None or not math.isfinite(self.p0_target_s):
            return bool(prompts)
        shared_s = _as_built_s(step, step.estimate_s)
        limit = share * self.p0_target_s
        for req, chunk in prompts:
            num_later = tokens_left(req) - chunk
            steps = 1 + -(-num_later // self.max_step_tokens)
            if now - req.arrival_time + steps * shared_s > limit:
                return True
        return False

    def _rescued(self, step: StepBudget, now: float) -> set[Request]:
        """The P0 prompts in `step` that would miss their TTFT target sharing it (priced as
        `p0_at_risk` prices it) and would meet it in steps of their own: their wait so far
        plus the rest of the prompt alone, chunk by chunk. None while P0-only steps already
        take all but one of the last SHAPING_WINDOW steps: the other tiers keep that one."""
        estimate, target = step.estimate_s, self.p0_target_s
        if not self.options.p0_solo_prefill or estimate is None or not math.isfinite(target):
            return set()
        prompts = [(r, n) for r, n in step.prefills.items() if r.tier is Tier.P0]
        if not prompts or sum(self._solo) >= SHAPING_WINDOW - 1:
            return set()
        shared_s, most = _as_built_s(step, estimate), self.max_step_tokens
        rescued: set[Request] = set()
        for req, chunk in prompts:
            waited, left = now - req.arrival_time, tokens_left(req)
            if req.first_token_time is not None or waited >= target:
                continue  # readmitted after its first token, or past saving
            if waited + (1 + -(-(left - chunk) // most)) * shared_s <= target:
                continue  # it makes its target sharing the step
            start = req.num_computed_tokens
            alone_s = sum(estimate(min(most, left - k), start + k) for k in range(0, left, most))
            if waited + alone_s <= target:
                rescued.add(req)
        return rescued

    def steady_step(self) -> None:
        """What `end` records for a step with no prefill chunk: nothing solo, nothing yields."""
        if self.options.p0_solo_prefill:
            self._solo.append(False)
        if self.options.p3_yields:
            self._yield_prompts.append(False)
            self._yield_decodes.append(False)

    def _p3_yields(self, step: StepBudget, queued: bool) -> None:
        urgent = queued and bool(step.tiers_prefilling() - {Tier.P3})
        for history, limit, decodes in (
            (self._yield_prompts, SHAPING_WINDOW // 2, False),
            (self._yield_decodes, SHAPING_WINDOW // 4, True),
        ):
            yields = urgent and sum(history) < limit
            yields = yields and step.has_work(Tier.P3, decodes=decodes, prefills=not decodes)
            history.append(yields)
            if yields:
                step.drop_where((Tier.P3,), decodes=decodes, prefills=not decodes)


def _as_built_s(step: StepBudget, estimate_s: StepEstimate) -> float:
    """The step as built, priced as one chunk of all its tokens after their mean context
    (weighted by tokens: a decode reads its whole context, as a chunk does)."""
    num_tokens = len(step.decodes) + sum(step.prefills.values())
    context = step.decode_context_tokens()
    context += sum(n * r.num_computed_tokens for r, n in step.prefills.items())
    return estimate_s(num_tokens, context // num_tokens)


def tokens_left(req: Request) -> int:
    """The tokens of `req` whose K/V is still to compute (a prompt's, in a prefill)."""
    return req.num_tokens - req.num_computed_tokens
