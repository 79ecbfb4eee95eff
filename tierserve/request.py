"""A request and everything the engine records about it."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tierserve.tiers import Tier


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks (new, or preempted by recompute)
    RUNNING = "running"  # holds device blocks; prefilling or decoding
    SWAPPED = "swapped"  # preempted by swap: its blocks are in the host pool
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"
    SHED = "shed"  # dropped by the policy under overload; `reject_reason` says why

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset(
    {RequestStatus.FINISHED, RequestStatus.REJECTED, RequestStatus.ABORTED, RequestStatus.SHED}
)


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    REJECTED = "rejected"
    ABORTED = "abort"
    SHED = "shed"  # the policy dropped it under overload (best-effort tiers only)


class EventKind(enum.Enum):
    ARRIVED = "arrived"
    ADMITTED = "admitted"
    FIRST_TOKEN = "first_token"
    PREEMPTED_SWAP = "preempted_swap"
    PREEMPTED_RECOMPUTE = "preempted_recompute"
    SWAPPED_IN = "swapped_in"
    READMITTED = "readmitted"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"
    SHED = "shed"


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    time: float
    kind: EventKind
    detail: str = ""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's penalties, subtracted from the logits of tokens already generated: `presence`
    # once for each token that has appeared, `frequency` once per appearance.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' and vLLM's: the logit of every token in the prompt or generated so far is
    # divided by it where positive, multiplied where negative (1 = off).
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """A model's own sampling settings (its generation_config.json), for the fields a request
    leaves out; None where the model sets none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    def said(self) -> str:
        """ "temperature: 0.7, top_p: 0.8" ("" where none is set), for a log line."""
        return ", ".join(f"{f}: {v:g}" for f in self.__slots__ if (v := getattr(self, f)) is not None)


@dataclass(eq=False, slots=True)
class Request:
    """One generation request.

    `tier` is the tier the tenant is entitled to: it decides which memory the request
    may hold. Aging can move a request ahead in the queue but never changes `tier`.
    `token_ids` is the prompt followed by the generated tokens; `num_computed_tokens`
    of them have their K/V in the cache.
    """

    request_id: str
    prompt_token_ids: Sequence[int]  # a tuple where it can be: the prefix cache slices it
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tier: Tier = Tier.P1
    tenant: str = "default"
    arrival_time: float = 0.0
    expected_output_tokens: int | None = None  # cost hint for fair queuing
    tenant_weight: float = 1.0  # the tenant's fair share among tenants of the same tier
    # Requests share prefix-cache blocks only with requests of the same salt (vLLM's
    # `cache_salt`); None: with every other unsalted request.
    cache_salt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # scheduling passes in which it was next in line but found no memory while a lower tier
    # held blocks (what "P0 never waits for memory held by a lower tier" counts)
    num_memory_waits: int = 0
    finish_reason: FinishReason | None = None
    reject_reason: str = ""
    admitted_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    events: list[TimelineEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt must hold at least one token")
        if self.tenant_weight <= 0:
            raise ValueError(f"request {self.request_id!r}: tenant_weight must be > 0")
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def is_prefilling(self) -> bool:
        """True until the K/V of every known token but the last sampled one is computed."""
        # `num_tokens` and `num_output_tokens` spelled out: the scheduler asks this of every
        # running request in every pass (`prefilling` below has the same test inlined).
        num_tokens = len(self.token_ids)
        return self.num_computed_tokens < num_tokens - 1 or num_tokens == self.num_prompt_tokens

    @property
    def expected_cost_tokens(self) -> int:
        """Prompt plus expected output: the cost fair queuing charges for this request."""
        expected = self.expected_output_tokens
        out = self.sampling.max_tokens if expected is None else min(expected, self.sampling.max_tokens)
        return self.num_prompt_tokens + out

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def record(self, time: float, kind: EventKind, detail: str = "") -> None:
        self.events.append(TimelineEvent(time, kind, detail))


def prefilling(requests: Iterable[Request]) -> list[Request]:
    """The requests that are `is_prefilling`, in order: the property's test inlined, since
    the scheduler, the fast simulation and hybrid's shaping ask it of every running request
    in every step."""
    return [
        r
        for r in requests
        if r.num_computed_tokens < len(r.token_ids) - 1 or len(r.token_ids) == r.num_prompt_tokens
    ]
