"""`TierScheduler`: vLLM V1's scheduler with tierserve's tiers.

    vllm serve MODEL --scheduler-cls tierserve.integrations.vllm.TierScheduler

What it changes, and nothing else (vLLM's `schedule()` still builds every step):
  * the waiting queue is ordered by a tierserve policy (hybrid, with aging, by default);
  * at the step boundary, before vLLM schedules, a waiting request that does not fit
    preempts running requests the policy lets it take from (P0: any lower tier; others:
    borrowers of their reserve), lowest tier and least work lost first; a P0 head makes
    room for the P0 requests waiting with it too, as many as the step takes; a head whose
    LoRA adapter has no slot takes one adapter's slot from requests it may take seats from;
  * a step that prefills P0 carries P0 work only (hybrid's `p0_solo_prefill`, in at most
    half of any 8 steps): the other running requests sit that step out, as when vLLM's
    token budget runs out before them, and the queue shows vLLM only its P0 requests;
  * while a P0 is likely, the other tiers' prompt tokens in a step are capped by hybrid's
    step bound (`Policy.prefill_cap`), priced by a fit of this engine's own step times
    (`step_times.py`): the step's token budget is cut to its decodes, P0's prompts and
    the cap, and the decodes go ahead of the other tiers' chunks, so none of them loses
    its token to the cap;
  * every block allocation is held to the tier partition (see `kv_guard.py`), and a
    request's vLLM `priority` is set to its tier, so vLLM's own preemption on a failed
    allocation picks the lowest tier (but a request held back by its own tier's ceiling
    makes vLLM pick that tier's latest request: no other tier's blocks would help it);
    every tier must be allowed one request of vLLM's `max_model_len` (checked at start);
  * per-tier metrics (see `tier_metrics.py`).
A step already running is never interrupted: preemption happens between steps.
"""

from __future__ import annotations

from tierserve.integrations.vllm.versions import check_vllm_version

VLLM_VERSION = check_vllm_version()  # before any vLLM internal is imported

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from tierserve.config import ConfigError, EngineConfig
from tierserve.integrations.vllm.book import RequestBook
from tierserve.integrations.vllm.kv_guard import Freeing, TierGuardedKVCacheManager, holdings
from tierserve.integrations.vllm.ledger import TierLedger, check_room_for_one_request
from tierserve.integrations.vllm.plugin_config import PluginConfig, load_plugin_config
from tierserve.integrations.vllm.queue import PolicyRequestQueue
from tierserve.integrations.vllm.request_tier import TierArgsError, TierLabel, label_request
from tierserve.integrations.vllm.step_times import StepTimes
from tierserve.integrations.vllm.tier_metrics import TierMetrics, on_vllm_endpoint
from tierserve.memory.partition import TierPartition
from tierserve.scheduling import create_policy
from tierserve.tiers import ALL_TIERS, Tier

if TYPE_CHECKING:
    from tierserve.memory.manager import KVCacheManager as TierserveKVCacheManager
    from tierserve.request import Request as TierserveRequest

# Under vLLM's own logger, so that its handler and format (and VLLM_LOGGING_LEVEL) apply: a
# logger outside "vllm" has no handler under `vllm serve`, and its INFO lines were lost.
logger = logging.getLogger("vllm.tierserve")

# Above every tier's priority: vLLM's victim choice, the highest (priority, arrival), takes
# requests so marked first (see `_ceiling_reached`).
CEILING_VICTIM_PRIORITY = len(ALL_TIERS)


# A request id no request has: sizing counts a request's blocks from scratch.
_SIZING_ID = "\0tierserve-sizing"


def blocks_to_hold(
    manager: Any, num_tokens: int, num_tokens_main_model: int, hit: tuple[Any, int] | None = None
) -> int:
    """The pool blocks a request holds for `num_tokens` tokens (`num_tokens_main_model` of
    them the model's own, the rest spec decode's lookahead), counted from scratch by vLLM's
    KV-cache coordinator as its admission checks count them (`Scheduler`'s full-sequence
    gate and `_request_remaining_blocks`): a block a `block_size` tokens in every KV-cache
    group, so a model with sliding-window and full-attention layers (Gemma 2 and 3, gpt-oss,
    Llama 4) takes blocks in each group, a sliding window's groups no more than vLLM's cap
    for them. An encoder-decoder model's cross-attention blocks are not counted (vLLM's
    checks count none either). `hit`: the prefix cache's hit for the request (its blocks by
    group, and the tokens they hold), as vLLM looks it up before it admits the request: blocks
    other requests hold take none from the pool, cached free ones one each. `manager` is
    vLLM's `KVCacheManager`."""
    coordinator = manager.coordinator
    hit_blocks, num_hit_tokens = hit if hit is not None else (manager.empty_kv_cache_blocks.blocks, 0)
    blocks = coordinator.get_num_blocks_to_allocate(
        request_id=_SIZING_ID,
        num_tokens=num_tokens,
        new_computed_blocks=hit_blocks,
        num_encoder_tokens=0,
        total_computed_tokens=num_hit_tokens,
        num_local_computed_tokens=num_hit_tokens,
        num_tokens_main_model=num_tokens_main_model,
        apply_admission_cap=True,
        prefill_end=num_tokens_main_model,
    )
    for group in coordinator.single_type_managers:  # Mamba's manager indexes a defaultdict
        held = group.req_to_blocks
        if not held.get(_SIZING_ID, True):
            del held[_SIZING_ID]
    return int(blocks)


def _taken_again(request: Request, hit: tuple[Any, int] | None, taken: set[Any], block_size: int) -> int:
    """Of `request`'s leading prompt blocks whose hashes are in `taken` (blocks an earlier
    admission of the same pass holds), those its own count took from the pool: all but the
    cache hit's blocks that running requests hold (those it counted as free of charge). Only
    blocks before its last token count: vLLM computes that token, so the block holding it is
    never a hit."""
    num_leading = 0
    for block_hash in request.block_hashes[: (int(request.num_tokens) - 1) // block_size]:
        if block_hash not in taken:
            break
        num_leading += 1
    hit_blocks = hit[0][0] if hit is not None else ()
    return num_leading - sum(1 for block in hit_blocks[:num_leading] if block.ref_cnt > 0)


class TierScheduler(Scheduler):
    kv_cache_manager: Any  # vLLM's manager, wrapped in a TierGuardedKVCacheManager
    max_num_scheduled_tokens: int  # vLLM's token budget of a step (cut for capped steps)

    def __new__(cls, *args: Any, **kwargs: Any) -> TierScheduler:
        # vLLM turns async scheduling on by default; it needs AsyncScheduler's bookkeeping.
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is TierScheduler and vllm_config is not None and vllm_config.scheduler_config.async_scheduling:
            cls = AsyncTierScheduler
        return cast(TierScheduler, super().__new__(cls))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tier_config: PluginConfig = load_plugin_config(self.vllm_config.additional_config)
        self.book = RequestBook()
        self.tier_policy = create_policy(self.tier_config.policy, self._policy_engine_config())
        # vLLM's own victim choice on a failed allocation: highest (priority, arrival).
        self.policy = SchedulingPolicy.PRIORITY
        self.waiting: PolicyRequestQueue = PolicyRequestQueue(self.tier_policy, self.book)
        self.kv_holding_waiting = create_request_queue(SchedulingPolicy.PRIORITY)
        inner = self.kv_cache_manager
        self.num_pool_blocks = inner.block_pool.num_gpu_blocks - 1  # less vLLM's null block
        partition = (
            TierPartition.from_tiers(self.num_pool_blocks, self.tier_config.engine.tiers)
            if self.tier_policy.tiered_memory
            else TierPartition.flat(self.num_pool_blocks)
        )
        max_model_len = int(self.vllm_config.model_config.max_model_len)
        try:
            check_room_for_one_request(partition, self._blocks_for(max_model_len), max_model_len)
        except ConfigError as e:
            raise ConfigError(f"{self.tier_config.source}: {e}") from None
        self.ledger = TierLedger(partition)
        self.kv_cache_manager = TierGuardedKVCacheManager(inner, self.ledger, self.book)
        self.kv_cache_manager.on_ceiling = self._ceiling_reached
        self.kv_cache_manager.on_allocate = self._allocating
        self._ceiling_victims: list[Request] = []  # marked by `_ceiling_reached` ...
        self._ceiling_for: str | None = None  # ... for this request's allocation
        self._held_back: set[str] = set()  # prompts held back last step (`_hold_back_for_p0`)
        self.tier_metrics = TierMetrics()
        self.step_times = StepTimes()
        if not on_vllm_endpoint():
            logger.warning(
                "tierserve: PROMETHEUS_MULTIPROC_DIR is not set, so the per-tier metrics are not on "
                "vLLM's /metrics (set it to an empty directory before `vllm serve` to export them)"
            )
        for note in self.tier_config.ignored:
            logger.warning("tierserve: %s: %s", self.tier_config.source, note)
        logger.info(
            "tierserve: policy %s, %d KV blocks, floors %s, ceilings %s",
            self.tier_config.policy,
            self.num_pool_blocks,
            partition.floor,
            partition.ceiling,
        )

    # ---- arrival and end -----------------------------------------------------------------

    def _label(self, request: Request) -> TierLabel:
        try:
            params = request.sampling_params
            return label_request(request.priority, params.extra_args if params else None, self.tier_config)
        except TierArgsError as e:
            # The API server rejects these with a 400 when the validator is loaded (see
            # validator.py); a request that slips through runs at the least urgent tier.
            logger.warning("tierserve: request %s: %s; running it as %s", request.request_id, e, Tier.P3.name)
            return TierLabel(Tier.P3, "default")

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            label = self._label(request)
            self.book.add(request, label.tier, label.tenant)
            request.priority = int(label.tier)
        super().add_request(request)

    def _policy_engine_config(self) -> EngineConfig:
        """The tiers config with vLLM's step limits in place of `[scheduler]`'s, which configure
        tierserve's own engine: hybrid sizes its step shaping (the step bound's most tokens, how
        many steps a P0 prompt still needs) from the steps vLLM builds."""
        engine = self.tier_config.engine
        vllm_limits = dataclasses.replace(
            engine.scheduler,
            max_num_batched_tokens=int(self.scheduler_config.max_num_batched_tokens),
            max_num_seqs=int(self.scheduler_config.max_num_seqs),
        )
        return dataclasses.replace(engine, scheduler=vllm_limits)

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        finished: list[Request] = super().finish_requests(request_ids, finished_status)
        if finished:  # an abort may leave the engine idle: no step would publish the state
            self._recount()
            self._publish_state()
        return finished

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        self._release(request)
        entry = self.book.end(request.request_id)  # a second end of one request raises
        if not entry.first_token_seen and request.num_output_tokens > 0:
            self.tier_metrics.observe_first_token(entry.shadow.tier, time.time() - request.arrival_time)
        return super()._free_request(request, delay_free_blocks)

    def _release(self, request: Request) -> None:
        """Take the blocks the request's end frees off its tier's count (those it shares
        stay with their other holders until the next recount)."""
        freed = Freeing(self.kv_cache_manager.inner).add(request.request_id)
        self.ledger.release(self.book.tier(request.request_id), freed)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        self._release(request)
        tier = self.book.tier(request.request_id)
        request.priority = int(tier)  # undo `_ceiling_reached`'s mark
        self.tier_metrics.preempted(tier, "recompute")
        super()._preempt_request(request, timestamp, drop_stale_output)

    # ---- the step ------------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        now = time.time()
        self.waiting.tick(now)
        self._recount()
        # Paused (vLLM's "wait" pause drains the requests in flight and admits nobody): no room
        # is made and no step shaped for a head vLLM will not admit. P0-only steps then held
        # back the requests the pause waits for, and preempted ones never came back.
        paused = self.pause_state is not PauseState.UNPAUSED
        admitted = None if paused else self._make_room(now)
        # vLLM hands the token budget to running requests in list order: most urgent first.
        self.running.sort(key=lambda r: r.priority)
        solo = None if paused else self.tier_policy.solo_tier(self._tiers_prefilling(admitted))
        if self.lora_config:
            self.waiting.gate = _LoraGate(self)
        try:
            if solo is not None:
                output = self._schedule_solo(solo, *args, **kwargs)
            elif not paused and (budget := self._capped_budget(now, admitted is Tier.P0)) is not None:
                output = self._schedule_capped(budget, *args, **kwargs)
            else:
                self._held_back.clear()
                output = super().schedule(*args, **kwargs)
        finally:
            self._unmark_ceiling_victims()
            self.waiting.gate = None
            self.waiting.end_pass()
        self.step_times.scheduled(output, output.total_num_scheduled_tokens, time.monotonic())
        self._publish_state()
        return output

    def _publish_state(self) -> None:
        self.tier_metrics.publish_state(
            [self.tier_policy.num_waiting(t) for t in ALL_TIERS], self.ledger.used, self.ledger.borrowed()
        )

    def _ceiling_reached(self, request: Request, tier: Tier) -> None:
        """`request`, running, cannot grow: `tier` holds all its ceiling allows. vLLM will
        preempt the running request of highest (priority, arrival) and try again, until
        the allocation succeeds or `request` itself is the victim; by priority alone that
        is every lower tier's request first, whose blocks `tier` may not take. For this
        pass, `tier`'s running requests are marked above every tier instead, so the victims
        are `tier`'s own, latest first, as vLLM picks within a tier."""
        book = self.book
        self._ceiling_for = request.request_id
        for r in self.running:
            if r.priority != CEILING_VICTIM_PRIORITY and book.tier(r.request_id) is tier:
                r.priority = CEILING_VICTIM_PRIORITY
                self._ceiling_victims.append(r)

    def _allocating(self, request: Request) -> None:
        """Before each allocation: the marks of `_ceiling_reached` hold only while the
        request they were made for tries again. Kept for the rest of the pass, they made a
        later request's failed allocation, a P3's, preempt a marked P0 request."""
        if self._ceiling_victims and request.request_id != self._ceiling_for:
            self._unmark_ceiling_victims()

    def _unmark_ceiling_victims(self) -> None:
        for r in self._ceiling_victims:
            r.priority = int(self.book.tier(r.request_id))
        self._ceiling_victims.clear()
        self._ceiling_for = None

    def _tiers_prefilling(self, admitted: Tier | None) -> set[Tier]:
        """The tiers with prompt tokens to compute in the coming step: the running
        requests' prefill chunks, and `admitted`, the tier of the queue's head if it fits."""
        tiers = {self.book.tier(r.request_id) for r in self.running if r.is_prefill_chunk}
        if admitted is not None:
            tiers.add(admitted)
        return tiers

    def _schedule_solo(self, tier: Tier, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """A step of `tier`'s work only. The other running requests stay in `running`
        (their seats, blocks and state untouched, and still vLLM's victims if memory runs
        short) but are not eligible this step, through the same per-request field vLLM's
        own schedulers use to hold a request back a step; the queue shows vLLM only
        `tier`'s requests. (Waiting requests that hold blocks, during KV transfers, are
        admitted from vLLM's own queue ahead of ours, whatever their tier.)"""
        next_step = self.current_step + 2  # vLLM's schedule() first advances current_step
        self._held_back = set()  # held back this step, as `_hold_back_for_p0` counts it
        for req in self.running:
            if self.book.tier(req.request_id) != tier:
                req.next_decode_eligible_step = max(req.next_decode_eligible_step, next_step)
                if req.is_prefill_chunk:
                    self._held_back.add(req.request_id)
        self.waiting.show_only(tier)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.waiting.show_only(None)

    def _capped_budget(self, now: float, p0_admissible: bool) -> int | None:
        """This step's token budget under the policy's cap on the tiers below P0 (None: no
        cap, or one no tighter than vLLM's own budget): every running decode's tokens (one,
        or more with speculative decoding: what vLLM's pass gives it), P0's prompt tokens,
        running and waiting (`_hold_back_for_p0`), and the cap. Without chunked prefill
        a prompt is never cut, so nothing is capped."""
        if not self.scheduler_config.enable_chunked_prefill:
            return None
        p0, book = Tier.P0, self.book
        decode_tokens, p0_tokens, p0_prefilling = 0, 0, False
        others_prefilling: list[Request] = []
        for r in self.running:
            if not r.is_prefill_chunk:
                decode_tokens += max(
                    1, r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens
                )
            elif book.tier(r.request_id) is p0:
                p0_prefilling = True
                p0_tokens += r.num_tokens - r.num_computed_tokens
            else:
                others_prefilling.append(r)
        cap = self.tier_policy.prefill_cap(decode_tokens, p0_prefilling, now, self.step_times.estimate_s)
        budget = None if cap is None else decode_tokens + p0_tokens + cap
        if budget is None or budget >= self.max_num_scheduled_tokens:
            return None  # an uncapped step: `schedule` forgets what was held back
        waiting_p0 = 0
        if p0_admissible and self.tier_policy.num_waiting(p0):
            waiting_p0 = sum(r.num_tokens for r in self.waiting.waiting_in(p0))
        if self._hold_back_for_p0(others_prefilling, waiting_p0 > 0):
            budget = min(budget + waiting_p0, self.max_num_scheduled_tokens)
        return budget

    def _hold_back_for_p0(self, others_prefilling: list[Request], p0_waits: bool) -> bool:
        """Whether this capped step counts the waiting P0 prompts' tokens in its budget.
        vLLM's pass serves the running requests before the waiting ones, so a lower tier's
        running prompt took those tokens (past the cap) and the P0 prompts none: such
        prompts sit this step out, as `_schedule_solo` holds requests back. Never two capped
        steps in a row (a P0 arriving every step would starve them): the capped step after
        leaves the waiting P0 prompts out of its budget, the lower prompts get the cap and no
        more, and the P0 prompts what it leaves. A P0-only step between counts as a hold, so
        such a prompt runs at least one step in three."""
        held_last_step = self._held_back
        self._held_back = set()
        if not p0_waits or any(r.request_id in held_last_step for r in others_prefilling):
            return False
        next_step = self.current_step + 2  # vLLM's schedule() first advances current_step
        for r in others_prefilling:
            r.next_decode_eligible_step = max(r.next_decode_eligible_step, next_step)
            self._held_back.add(r.request_id)
        return True

    def _schedule_capped(self, budget: int, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """vLLM's pass with `budget` tokens: P0's work first, then every other decode,
        then the other tiers' prompt chunks, most urgent first."""
        p0, book = Tier.P0, self.book
        self.running.sort(
            key=lambda r: (r.is_prefill_chunk and book.tier(r.request_id) is not p0, r.priority)
        )
        full = self.max_num_scheduled_tokens
        self.max_num_scheduled_tokens = budget
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = full

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> Any:
        self.step_times.finished(scheduler_output, time.monotonic())
        num_live = len(self.book)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if len(self.book) < num_live:  # the last step before the engine idles publishes nothing
            self._recount()
            self._publish_state()
        now = time.time()
        for rid in scheduler_output.num_scheduled_tokens:
            entry = self.book.find(rid)
            if entry is not None and not entry.first_token_seen and entry.vllm.num_output_tokens > 0:
                entry.first_token_seen = True
                self.tier_metrics.observe_first_token(entry.shadow.tier, now - entry.vllm.arrival_time)
        return outputs

    def _holders(self) -> list[Request]:
        return [*self.running, *self.kv_holding_waiting]

    def _recount(self) -> None:
        """Each tier's blocks, from vLLM's pool: a request's own, and each shared block once,
        for the most urgent tier holding it."""
        used = [0] * len(ALL_TIERS)
        inner = self.kv_cache_manager.inner
        shared_by: dict[int, Tier] = {}
        for req in self._holders():
            entry = self.book.find(req.request_id)
            if entry is None:
                continue
            tier = entry.shadow.tier
            shared, own = holdings(inner, req.request_id)
            used[tier] += own
            for block in shared:
                held_by = shared_by.get(block.block_id)
                if held_by is None or tier < held_by:
                    shared_by[block.block_id] = tier
        for tier in shared_by.values():
            used[tier] += 1
        self.ledger.reset(used)

    def _make_room(self, now: float) -> Tier | None:
        """Preempt, between steps, the running requests the waiting head may take from.
        Returns the head's tier if it fits now (vLLM admits it this step), else None.

        A P0 head makes room for the P0 requests waiting with it too, as many as the step's
        tokens and seats take: vLLM's own pass never preempts for a waiting request, so
        room made for the head alone left a burst of P0s to start one step after another."""
        if not self.waiting:
            return None
        head = self.waiting.peek_request()
        tier = self.book.tier(head.request_id)
        # A head whose adapter has no slot takes one adapter's, as part of the room made for
        # it (all or nothing): the requests of that adapter go first.
        skipped = _skipped(self, head)
        slot_from = [] if skipped else self._lora_victims(head)  # the head leads its burst then
        loras = self._running_loras() - {_lora_id(r) for r in slot_from}
        # A request vLLM skips this pass (its grammar compiling, say) takes no room: room made
        # for it, and the P0-only step around it, were steps with nothing to run.
        if tier is Tier.P0:
            burst = self._p0_burst(head, loras)
        else:
            burst = [] if skipped or not self._lora_has_slot(head, loras) else [head]
        if not burst:
            return None
        first = self.book.get(burst[0].request_id).shadow
        groups = [burst] if len(burst) == 1 else [burst, burst[:1]]  # the burst, else its first alone
        for group in groups:
            need = self._burst_need(group)
            if self._preempt_for(first, need, len(group), now, slot_from):
                return tier
        return None

    def _p0_burst(self, head: Request, loras: set[int]) -> list[Request]:
        """The head, then the other waiting P0 requests by arrival, as many as one step's
        tokens and seats take (vLLM admits them in the same pass), leaving out those vLLM
        skips this pass, and those whose adapter has no slot beside `loras` (those running)."""
        others = sorted(
            (r for r in self.waiting.waiting_in(Tier.P0) if r is not head), key=lambda r: r.arrival_time
        )
        burst: list[Request] = []
        tokens = 0
        loras = set(loras)
        for r in [head, *others]:
            if _skipped(self, r) or not self._lora_has_slot(r, loras):
                continue
            tokens += int(r.num_tokens)
            if burst and (tokens > self.max_num_scheduled_tokens or len(burst) >= self._seat_limit()):
                break
            burst.append(r)
            if lora := _lora_id(r):
                loras.add(lora)
        return burst

    # ---- LoRA adapters: at most `max_loras` run at once ---------------------------------

    def _running_loras(self) -> set[int]:
        return {lora for r in self.running if (lora := _lora_id(r))}

    def _lora_has_slot(self, request: Request, loras: set[int] | None = None) -> bool:
        """Whether `request`'s adapter may run beside the running requests' (`loras`, else
        theirs now). vLLM asks the same of the adapters its pass schedules, not of every
        running request's: one held back for a P0-only step was not counted, a P0 of another
        adapter was admitted beside it, and the next step's pass failed its own assertion
        (more adapters than max_loras), stopping the engine."""
        lora = _lora_id(request)
        if not lora or not self.lora_config:
            return True
        loras = self._running_loras() if loras is None else loras
        return lora in loras or len(loras) < self.lora_config.max_loras

    def _lora_victims(self, head: Request) -> list[Request]:
        """For a head whose adapter has no slot: the running requests of one adapter, each of
        which the policy lets `head` take the seat of, whose preemption gives `head`'s adapter
        their slot (the adapter whose requests lose the least work); none where no adapter's
        requests may all be taken, or the head needs no slot. vLLM never preempts for an
        adapter's slot, so a P0 request of another adapter waited for lower tiers' to end."""
        if self._lora_has_slot(head):
            return []
        shadow = self.book.get(head.request_id).shadow
        policy = self.tier_policy
        if not policy.preempts_for_seat(shadow):
            return []
        memory = cast("TierserveKVCacheManager", self.ledger)
        holders: dict[int, list[Request]] = {}
        for r in self.running:
            if lora := _lora_id(r):
                holders.setdefault(lora, []).append(r)
        takeable = [
            rs
            for rs in holders.values()
            if all(policy.seat_victim_ok(shadow, self.book.get(r.request_id).shadow, memory) for r in rs)
        ]
        if not takeable:
            return []
        return min(takeable, key=lambda rs: sum(int(r.num_computed_tokens) for r in rs))

    def _preempt_for(
        self, head: TierserveRequest, need: int, seats: int, now: float, first: Sequence[Request] = ()
    ) -> bool:
        """Make room for `head`: `need` blocks and `seats` seats free for its tier, preempting
        the requests in `first` (an adapter's, for its slot) and then the fewest running
        requests the policy lets `head` take from; True where the room is there (nobody
        preempted where none was needed), False (nobody preempted) where even every allowed
        victim would not make it."""
        memory = cast("TierserveKVCacheManager", self.ledger)  # the policies ask only what the ledger answers
        inner = self.kv_cache_manager.inner
        chosen = list(first)
        freeing = Freeing(inner)
        freed = 0
        for r in chosen:
            if self._request_blocks_can_be_freed(r):  # else a connector still writes them
                freed = freeing.add(r.request_id)  # the blocks all so far free
        if self._fits(head.tier, need, freed, len(chosen), seats):
            self._preempt_all(chosen, now)
            return True
        if not self.tier_policy.preempts_for_admission(head, memory, need):
            return False
        borrowed = self.ledger.borrowed()
        candidates = [
            r
            for r in self.running
            if r not in chosen
            # a deferred free (a KV connector writing to the blocks) makes no room this step
            and self._request_blocks_can_be_freed(r)
            and self.tier_policy.admission_victim_ok(head, self.book.get(r.request_id).shadow, memory)
        ]
        policy = self.tier_policy
        for r in candidates:  # "least work lost" reads the shadows: bring them up to date
            self.book.get(r.request_id).shadow.num_computed_tokens = r.num_computed_tokens
        candidates.sort(key=lambda r: policy.victim_key(self.book.get(r.request_id).shadow, borrowed))
        for victim in candidates:
            chosen.append(victim)
            freed = freeing.add(victim.request_id)
            if self._fits(head.tier, need, freed, len(chosen), seats):
                break
        else:
            return False
        self._preempt_all(chosen, now)
        return True

    def _preempt_all(self, victims: Sequence[Request], now: float) -> None:
        """Preempt `victims` at the step boundary, as vLLM preempts in its own pass: with a KV
        connector that hands KV off (`requires_kv_delivery`), the output of a step in flight
        is dropped, not delivered for blocks already freed. A victim may be resumed in this
        same pass, so it is not one the previous step scheduled (as vLLM's
        `reset_prefix_cache` has it): its tokens go to the model runner again."""
        for victim in victims:
            self.running.remove(victim)
            self.prev_step_scheduled_req_ids.discard(victim.request_id)
            self._preempt_request(victim, now, drop_stale_output=self.requires_kv_delivery)

    def _burst_need(self, group: Sequence[Request]) -> int:
        """Blocks vLLM wants free to admit `group` in one pass: each request's own, and the
        watermark once (each admission must leave it free, so the last one's check covers the
        group). A prompt block that an earlier request of the group takes (the same block
        hash) is not counted again: vLLM enters a block in its prefix cache as it allocates
        it, and the next admission of the pass finds it. That holds where the model has one
        full-attention KV-cache group, with neither EAGLE nor a KV connector; elsewhere a
        shared block is counted again, more than vLLM takes (a burst of P0s sharing an
        uncached system prompt preempted others for its blocks once a request)."""
        inner = self.kv_cache_manager.inner
        groups = inner.coordinator.single_type_managers
        shares = (
            len(groups) == 1
            and type(groups[0]) is FullAttentionManager  # not its subclasses (sinks, ring buffers)
            and not inner.coordinator.eagle_group_ids  # EAGLE's lookup drops a hit's last block
            and self.connector is None  # a KV load in flight caches its blocks only once loaded
        )
        taken: set[Any] = set()  # hashes of the prompt blocks the group's earlier requests hold
        need = 0
        for request in group:
            blocks, hit = self._blocks_to_admit(request)
            need += blocks - int(inner.watermark_blocks)
            if shares and inner.prefix_cache_lookup_enabled(request):
                need -= _taken_again(request, hit, taken, int(groups[0].block_size))
                taken.update(request.block_hashes)
        return need + int(inner.watermark_blocks)

    def _blocks_to_admit(self, request: Request) -> tuple[int, tuple[Any, int] | None]:
        """Blocks vLLM wants free to admit `request`, its prefix cache hit counted as vLLM
        counts it (a P0 request whose system prompt running requests hold preempted others for
        those blocks too), and that hit (its blocks by group, the tokens they hold)."""
        inner = self.kv_cache_manager.inner
        hit = None
        if inner.prefix_cache_lookup_enabled(request):  # a read: nothing is touched or counted
            hit_blocks, num_hit_tokens, _ = inner.coordinator.find_longest_cache_hit(
                request.block_hashes, int(request.num_tokens) - 1
            )
            hit = (hit_blocks, int(num_hit_tokens))
        return self._blocks_for(int(request.num_tokens), hit), hit

    def _blocks_for(self, num_tokens: int, hit: tuple[Any, int] | None = None) -> int:
        """Blocks vLLM wants free to admit a request of `num_tokens` tokens (`hit`: its prefix
        cache hit, `blocks_to_hold`)."""
        inner = getattr(self.kv_cache_manager, "inner", self.kv_cache_manager)  # wrapped after start
        lookahead = int(self.num_lookahead_tokens)
        held = blocks_to_hold(inner, num_tokens + lookahead, num_tokens, hit)
        return held + int(inner.watermark_blocks)

    def _fits(self, tier: Tier, need: int, freed: int, seats_freed: int, seats: int = 1) -> bool:
        """Whether `need` blocks and `seats` seats are free for `tier`, once `freed` blocks and
        `seats_freed` seats are."""
        # Paused streaming sessions are not in `running` but hold a seat (vLLM's own count).
        seated = len(self.running) + int(self.num_waiting_for_streaming_input)
        has_seats = seated - seats_freed + seats <= self._seat_limit()
        num_free = self.kv_cache_manager.inner.block_pool.get_num_free_blocks() + freed
        return has_seats and self.ledger.fits(tier, need, num_free)

    def _seat_limit(self) -> int:
        """The requests vLLM admits to run at once: `max_num_active_seqs` where it is set
        below `max_num_seqs` (a waiting P0 was judged to have a seat there, nobody was
        preempted, and P0-only steps with nothing to run came until a request ended: 213
        steps to its first token with 2 active seats of 8)."""
        return int(self.max_num_active_reqs)


@dataclasses.dataclass(frozen=True, slots=True)
class _LoraGate:
    """The queue's gate in vLLM's pass: a request whose adapter has no slot beside every
    running request's waits (`TierScheduler._lora_has_slot`)."""

    scheduler: TierScheduler

    def room(self) -> bool:
        s = self.scheduler
        return len(s.running) + int(s.num_waiting_for_streaming_input) < s._seat_limit()

    def admits(self, request: Request) -> bool:
        return self.scheduler._lora_has_slot(request)


def _lora_id(request: Request) -> int:
    """The request's LoRA adapter, 0 for none (the base model)."""
    lora = request.lora_request
    return int(lora.lora_int_id) if lora is not None and lora.lora_int_id > 0 else 0


_BLOCKED = (
    RequestStatus.WAITING_FOR_REMOTE_KVS,
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RequestStatus.WAITING_FOR_STREAMING_REQ,
)


def _skipped(scheduler: Scheduler, request: Request) -> bool:
    """Whether vLLM's pass skips this waiting request (`_handle_blocked_waiting_request`,
    stale output in flight), asked without changing anything: its KV still arriving, its
    grammar still compiling (or failed), a stream waiting for input."""
    status = request.status
    if status not in _BLOCKED:
        return bool(request.num_stale_output_tokens and not request.drop_stale_output)
    if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        return request.request_id not in scheduler.finished_recving_kv_req_ids
    if status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
        grammar = request.structured_output_request.grammar if request.structured_output_request else None
        return grammar is None or isinstance(grammar, Exception)
    return True


class AsyncTierScheduler(TierScheduler, AsyncScheduler):
    """`TierScheduler` for engines with async scheduling (vLLM's default where supported)."""
