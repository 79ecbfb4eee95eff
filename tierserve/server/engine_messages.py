"""What crosses the pipe between the HTTP server and the engine process.

The server sends lists of commands (one list per event-loop iteration); the engine
process answers with events, at most two `StepOutputs` per engine step (the step's first
tokens on their own, then the rest). Between the two, the engine waits (briefly) for the
server's `FirstsHandled`. Everything here is pickled, so every field is plain
data: ids, token tuples, `Delta`s, snapshots. A callable (`Inspect.fn`, `EngineRecipe.backend`)
must be importable by name in the engine process: a module-level function, a class, or a
`functools.partial` of one — never a lambda.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tierserve.config import EngineConfig
from tierserve.engine import Engine
from tierserve.request import Request, SamplingDefaults
from tierserve.server.backends import Backend
from tierserve.server.state_metrics import EngineSnapshot
from tierserve.server.streams import Delta
from tierserve.server.tokenizer import Tokenizer
from tierserve.tiers import Tier

# ---- how the engine process builds its engine ----------------------------------------------


@dataclass(frozen=True)
class EngineRecipe:
    """Everything the engine process needs to build its engine (made by the server)."""

    engine_config: EngineConfig
    policy: str
    backend: Callable[[], Backend]  # e.g. a `BackendSpec`: the model is loaded in the engine process
    ttft_targets: Mapping[Tier, float]
    clock_origin: float  # the server's `WallClock` origin, so both processes tell the same time
    log_level: str = "INFO"


# ---- server -> engine ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: Request
    entitled: Tier


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class FinishRequest:
    """End the request as stopped (a stop string appeared in its text)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Inspect:
    """Run `fn(engine)` between two steps and answer with its (picklable) result."""

    call_id: int
    fn: Callable[[Engine], Any]


@dataclass(frozen=True, slots=True)
class ScrapeMetrics:
    """Answer with the engine process's metric families (for `/metrics`)."""

    call_id: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Abort what is left, answer nothing more, exit 0."""


@dataclass(frozen=True, slots=True)
class FirstsHandled:
    """The handlers of the first tokens of the step that returned at `returned_at` have run
    (their chunks are on the sockets): the engine process may take the CPU back."""

    returned_at: float


BetweenSteps = AddRequest | AbortRequest | FinishRequest | Inspect | ScrapeMetrics | Shutdown
"""The commands the engine process applies between two steps, in the order they came."""
Command = BetweenSteps | FirstsHandled


# ---- engine -> server ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineReady:
    """The engine is built; what the HTTP side needs to know about it."""

    pid: int
    model_name: str
    vocab_size: int
    max_model_len: int
    block_size: int
    ceiling_blocks: Mapping[Tier, int]
    tokenizer: Tokenizer
    context_note: str = ""  # why max_model_len is below the model's positions (`ExecutorSpec`)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)  # `ExecutorSpec`


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The engine could not be built (a bad model, device or config); the message says why."""

    message: str
    bad_setting: bool = False  # a bad --model, --gpu, --device: the user's to fix, not a failure


@dataclass(slots=True)
class StepOutputs:
    """One batch of results, applied by the server in field order.

    `firsts` holds (request id, first tokens' delta), `tokens` (request id, new token ids),
    urgent tiers first; `ends` the final delta of each request that ended (finished,
    aborted, refused). `returned_at`
    (`time.monotonic()`) and `returned` (the engine clock) say when the step that made the
    tokens returned. `snapshot` and `applied` (adds taken off the pipe, by tier) come with
    the second message of a step and when the engine goes idle."""

    accepted: list[str] = field(default_factory=list)
    firsts: list[tuple[str, Delta]] = field(default_factory=list)
    tokens: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    ends: list[tuple[str, Delta]] = field(default_factory=list)
    returned_at: float = 0.0
    returned: float = 0.0
    snapshot: EngineSnapshot | None = None
    applied: tuple[int, ...] | None = None
    num_step_errors: int = 0


@dataclass(frozen=True, slots=True)
class Answer:
    """The result of an `Inspect` or `ScrapeMetrics`; `error` is set if it raised."""

    call_id: int
    result: Any = None
    error: BaseException | None = None


Event = EngineReady | EngineFailed | StepOutputs | Answer
