"""What a benchmark run recorded: per-request records (with their preemptions and
admissions), KV block use over the window, and the window's engine counters.
`summary` turns them into figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tierserve.request import EventKind, Request, RequestStatus, TimelineEvent
from tierserve.tiers import ALL_TIERS, Tier


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """The timeline of one final request, without its tokens (runs keep thousands)."""

    request_id: str
    index: int  # position in the workload stream
    tier: Tier
    measured: bool  # False for warm-up and cool-down requests
    status: RequestStatus
    arrival_s: float
    first_token_s: float | None
    finish_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache at first admission
    num_swaps: int
    num_recomputes: int
    end_reason: str = ""  # why it ended: the finish reason, or the rejection's message
    preemptions: tuple[Preemption, ...] = ()
    admitted_s: tuple[float, ...] = ()  # every admission and readmission
    num_memory_waits: int = 0  # passes it waited for memory a lower tier held
    # Open loop: when the workload sends it (a conversation's next turn is held until the
    # previous answer is in, then arrives later); None in a closed loop.
    scheduled_s: float | None = None

    @classmethod
    def of(
        cls,
        req: Request,
        index: int,
        measured: bool,
        end_reason: str = "",
        scheduled_s: float | None = None,
    ) -> RequestRecord:
        if not req.status.is_final or req.finish_time is None:
            raise ValueError(f"{req.request_id} is not final")
        kinds = [e.kind for e in req.events]
        if end_reason:
            reason = end_reason
        elif req.reject_reason:  # rejected or shed: the engine's message
            reason = f"{req.status.value}: {req.reject_reason}"
        else:
            reason = req.finish_reason.value if req.finish_reason else ""
        return cls(
            req.request_id,
            index,
            req.tier,
            measured,
            req.status,
            req.arrival_time,
            req.first_token_time,
            req.finish_time,
            req.num_prompt_tokens,
            req.num_output_tokens,
            req.num_cached_tokens,
            kinds.count(EventKind.PREEMPTED_SWAP),
            kinds.count(EventKind.PREEMPTED_RECOMPUTE),
            reason,
            tuple(Preemption.of(e) for e in req.events if e.kind in _PREEMPTED),
            tuple(e.time for e in req.events if e.kind in _ADMITTED),
            req.num_memory_waits,
            scheduled_s,
        )


_PREEMPTED = (EventKind.PREEMPTED_SWAP, EventKind.PREEMPTED_RECOMPUTE)
_ADMITTED = (EventKind.ADMITTED, EventKind.READMITTED)


@dataclass(frozen=True, slots=True)
class Preemption:
    time_s: float
    swapped: bool  # False: recomputed
    amount: int  # blocks swapped out, or tokens to recompute

    @classmethod
    def of(cls, event: TimelineEvent) -> Preemption:
        head = event.detail.split(" ", 1)[0]
        return cls(event.time, event.kind is EventKind.PREEMPTED_SWAP, int(head) if head.isdigit() else 0)


@dataclass(frozen=True, slots=True)
class BlockUsage:
    mean_used: float  # time-weighted over the window's steps
    peak_used: int
    mean_borrowed: float
    peak_borrowed: int


@dataclass
class BlockSampler:
    """Time-weighted KV block usage per tier, one sample per engine step."""

    _time_s: float = 0.0
    _used_s: list[float] = field(default_factory=lambda: [0.0] * len(ALL_TIERS))
    _borrowed_s: list[float] = field(default_factory=lambda: [0.0] * len(ALL_TIERS))
    _peak_used: list[int] = field(default_factory=lambda: [0] * len(ALL_TIERS))
    _peak_borrowed: list[int] = field(default_factory=lambda: [0] * len(ALL_TIERS))
    peak_total: int = 0  # most blocks in use at once, all tiers together

    def add(self, duration_s: float, used: Sequence[int], borrowed: Sequence[int]) -> None:
        self._time_s += duration_s
        self.peak_total = max(self.peak_total, sum(used))
        for t in range(len(ALL_TIERS)):
            self._used_s[t] += used[t] * duration_s
            self._borrowed_s[t] += borrowed[t] * duration_s
            self._peak_used[t] = max(self._peak_used[t], used[t])
            self._peak_borrowed[t] = max(self._peak_borrowed[t], borrowed[t])

    def usage(self) -> dict[Tier, BlockUsage]:
        span = self._time_s or 1.0
        return {
            t: BlockUsage(
                self._used_s[t] / span, self._peak_used[t], self._borrowed_s[t] / span, self._peak_borrowed[t]
            )
            for t in ALL_TIERS
        }


@dataclass(frozen=True, slots=True)
class Window:
    """Engine counters over the measurement window: first measured arrival to last measured end."""

    start_s: float
    end_s: float
    num_generated_tokens: int
    roofline_s: float
    busy_s: float
    blocks: Mapping[Tier, BlockUsage]
    peak_used_blocks: int = 0  # all tiers together

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s
