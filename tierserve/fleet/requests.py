"""A request as the fleet's client sees it: across attempts, replicas and the gateway queue."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierserve.request import Request, RequestStatus
from tierserve.tiers import Tier
from tierserve.workloads.spec import RequestSpec

PREFIX_TOKENS = 128  # prompt tokens hashed for prefix affinity (the gateway hashes 512 characters)

COMPLETED = "completed"
LOST = "lost"  # its replica died after the first token: the stream broke
REJECTED = "rejected"  # the engine could never fit it
SHED = "shed"
UNFINISHED = "unfinished"  # still live when the run ended
REFUSED_PREFIX = "refused:"  # + queue_full, queue_timeout or no_upstream


@dataclass
class FleetRequest:
    """`spec` holds the prompt's tokens; it is let go when the request ends (`end`), so that
    a run's memory follows the requests in flight, not every request of the trace (on the
    Mooncake trace, ~0.5 MB a request before: a 300k-request run would not fit)."""

    key: int  # position in the run's list of requests
    spec: RequestSpec | None
    arrival_s: float
    index: int = field(init=False)  # the spec's index in the workload stream
    tier: Tier = field(init=False)
    attempts: int = 0  # replicas it was sent to
    tried: list[str] = field(default_factory=list)  # the replicas it was sent to, in order
    sent_s: list[float] = field(default_factory=list)  # when it was sent to each
    submitted_s: float = 0.0  # when it last reached the gateway's dispatch (a retry's: again)
    queued_s: float = 0.0  # its time in the gateway's queue over its attempts before
    first_token_s: float | None = None
    finish_s: float | None = None
    outcome: str | None = None

    def __post_init__(self) -> None:
        if self.spec is None:
            raise ValueError(f"fleet request {self.key}: no spec")
        self.index = self.spec.index
        self.tier = self.spec.tier

    @property
    def live_spec(self) -> RequestSpec:
        if self.spec is None:
            raise ValueError(f"fleet request {self.key} (spec {self.index}) has ended")
        return self.spec

    @property
    def prefix(self) -> str:
        return ",".join(map(str, self.live_spec.prompt_token_ids[:PREFIX_TOKENS]))

    @property
    def num_retries(self) -> int:
        return max(0, self.attempts - 1)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def end(self, outcome: str, now: float) -> None:
        self.outcome = outcome
        self.finish_s = now
        self.spec = None


def outcome_of(req: Request) -> str:
    if req.status is RequestStatus.FINISHED:
        return COMPLETED
    if req.status is RequestStatus.SHED:
        return SHED
    if req.status is RequestStatus.REJECTED:
        return REJECTED
    value: str = req.status.value
    return value
