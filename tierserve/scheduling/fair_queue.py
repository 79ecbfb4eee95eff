"""Start-time fair queuing over flows (Goyal, Vin & Cheng, SIGCOMM 1996): the one fair
queue of tierserve, used over tenants inside a tier and over the tiers themselves.

Each flow is a queue of requests with a weight. When a flow becomes backlogged, and
again each time it is served, its head gets the start tag S = max(V, F), F being the
flow's last finish tag; serving the head sets F = S + cost / weight and advances the
virtual time V to S. The head with the smallest start tag is served next (ties: the
earlier arrival), so under backlog each flow receives service in proportion to its
weight, and a flow that was idle banks no credit.

Bounded state (issue 14): a finish tag is kept only while it can matter — for a
backlogged flow, or for an idle flow whose F is still ahead of V (its next request must
start at F, not at V). Tags at or behind V are dropped as V passes them. Tenants that
come once and never return would still pile up tags ahead of a V that does not move
(each new tenant starts at V, so V never passes them), so idle tags are also capped at
`max(IDLE_TAGS_FLOOR, IDLE_TAGS_PER_FLOW × backlogged flows)`, forgetting the smallest
first: a forgotten flow that returns starts at V instead of F, ahead by F − V, which is
the smallest such gap held. Every operation is O(log n) in the flows held (heaps with
lazy deletion); `ops` counts heap operations, the work a test can bound.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, NamedTuple, Protocol, TypeVar

from tierserve.request import Request
from tierserve.scheduling.errors import EmptyQueueError

K = TypeVar("K", bound=Hashable)
IDLE_TAGS_FLOOR = 64
IDLE_TAGS_PER_FLOW = 4
SERVES_KEPT = 256  # serves `put_back` can undo exactly (in reverse order): more than a pass pops


class Flow(Protocol):
    """What a flow must offer: a queue of requests with a head."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def head(self) -> Request | None: ...
    def append(self, req: Request) -> None: ...
    def appendleft(self, req: Request) -> None: ...
    def popleft(self) -> Request: ...
    def remove(self, req: Request) -> None: ...
    def take(self, req: Request) -> None: ...
    def put_back(self, req: Request) -> None: ...
    def keep_undo(self, on: bool) -> None: ...
    def forget_undo(self) -> None: ...


class FifoFlow:
    """A flow whose requests are served in arrival order (one tenant's requests)."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()
        self._undo = False  # keep `_taken` (`keep_undo`)
        self._taken: deque[tuple[Request, int]] = deque(maxlen=SERVES_KEPT)  # (served, where it was)

    def keep_undo(self, on: bool) -> None:
        self._undo = on
        self._taken.clear()

    def forget_undo(self) -> None:
        self._taken.clear()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def head(self) -> Request | None:
        return self._q[0] if self._q else None

    def append(self, req: Request) -> None:
        self._q.append(req)

    def appendleft(self, req: Request) -> None:
        self._q.appendleft(req)

    def popleft(self) -> Request:
        req = self._q.popleft()
        if self._undo:
            self._taken.append((req, 0))
        return req

    def remove(self, req: Request) -> None:
        if self._q[0] is req:
            self._q.popleft()
        else:
            self._q.remove(req)

    def take(self, req: Request) -> None:
        """Serve `req` from wherever it waits (a FIFO charges nothing: it is removed)."""
        q = self._q
        where = 0 if q[0] is req else q.index(req)
        del q[where]
        if self._undo:
            self._taken.append((req, where))

    def put_back(self, req: Request) -> None:
        """Return a request served a moment ago where it was (with `keep_undo`, undone in the
        reverse order of the serves; otherwise ahead of the first request that arrived after
        it)."""
        q, taken = self._q, self._taken
        if taken and taken[-1][0] is req:
            q.insert(taken.pop()[1], req)
            return
        for i, queued in enumerate(q):
            if queued.arrival_time > req.arrival_time:
                q.insert(i, req)
                return
        q.append(req)


class Served(NamedTuple, Generic[K]):
    """A serve, as `put_back` undoes it: what it changed, as it was before."""

    req: Request
    flow: Flow  # the flow it was served from
    virtual_time: float
    finish: float  # the flow's finish tag
    start: float  # the flow's start tag
    dropped: list[tuple[K, float]]  # idle flows' finish tags the serve forgot (V passed them)


class StartTimeFairQueue(Generic[K]):
    def __init__(
        self,
        flow_of: Callable[[Request], K],
        new_flow: Callable[[], Flow],
        weight: Callable[[K, Request], float],
        cost: Callable[[Request], float],
    ) -> None:
        self._flow_of = flow_of
        self._new_flow = new_flow
        self._weight = weight
        self._cost = cost
        self.virtual_time = 0.0
        self.flows: dict[K, Flow] = {}  # backlogged flows only
        self._start: dict[K, float] = {}  # head start tag of each backlogged flow
        self._finish: dict[K, float] = {}  # last finish tag: backlogged flows, idle ones ahead of V
        self._heads: list[tuple[float, float, int, K]] = []  # (S, head arrival, version, flow)
        self._version: dict[K, int] = {}
        self._idle: list[tuple[float, int, K]] = []  # (F, version, flow) of idle flows
        self._idle_version: dict[K, int] = {}
        self._serial = itertools.count()
        self._len = 0
        self.ops = 0
        self._undo = False  # keep `_served` (`keep_undo`)
        self._touched: dict[int, Flow] = {}  # the flows served from since `forget_undo`
        self._served: deque[Served[K]] = deque(maxlen=SERVES_KEPT)  # the latest serves, for `put_back`
        self._dropping: list[tuple[K, float]] | None = None  # the serve under way's dropped idle tags

    # ---- reading -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for flow in self.flows.values():
            yield from flow

    def num_tags(self) -> int:
        return len(self._finish)

    def flow(self, key: K) -> Flow | None:
        return self.flows.get(key)

    def head_of(self, key: K) -> Request | None:
        flow = self.flows.get(key)
        return None if flow is None else flow.head()

    def start_tag(self, key: K) -> float:
        return self._start[key]

    def best(self, keys: Iterator[K] | list[K] | tuple[K, ...]) -> K | None:
        """The backlogged flow among `keys` with the smallest start tag (a linear scan:
        for a few flows, such as the tiers)."""
        best: K | None = None
        best_key: tuple[float, float] = (0.0, 0.0)
        for key in keys:
            head = self.head_of(key)
            if head is None:
                continue
            rank = (self._start[key], head.arrival_time)
            if best is None or rank < best_key:
                best, best_key = key, rank
        return best

    def next_flow(self) -> K | None:
        """The backlogged flow with the smallest start tag, over all flows (O(log n))."""
        heads = self._heads
        while heads:
            _, _, version, key = heads[0]
            if self._version.get(key) == version and key in self.flows:
                return key
            heapq.heappop(heads)
            self.ops += 1
        return None

    # ---- changing ------------------------------------------------------------------------

    def keep_undo(self, on: bool) -> None:
        """Keep, from now on, what `put_back` needs to undo a serve exactly (the serves since
        `forget_undo`, at most SERVES_KEPT): for the vLLM plug-in, whose engine puts back
        the requests it skips in a pass. Off (tierserve's own engine, which never puts one
        back), a serve keeps nothing."""
        self.forget_undo()
        self._undo = on
        for flow in self.flows.values():
            flow.keep_undo(on)

    def forget_undo(self) -> None:
        """The serves so far will not be put back (a pass is over): let go of their records
        (and of the requests and emptied flows they hold)."""
        for flow in self._touched.values():  # all of them: `_served` keeps the latest few
            flow.forget_undo()
        self._touched.clear()
        self._served.clear()

    def _new_flow_here(self) -> Flow:
        flow = self._new_flow()
        if self._undo:
            flow.keep_undo(True)
        return flow

    def append(self, req: Request) -> None:
        key = self._flow_of(req)
        flow = self.flows.get(key)
        if flow is None:
            flow = self.flows[key] = self._new_flow_here()
            flow.append(req)
            self._len += 1
            self._backlogged(key)
            return
        before = flow.head()
        flow.append(req)
        self._len += 1
        if flow.head() is not before:
            self._push_head(key)

    def appendleft(self, req: Request) -> None:
        key = self._flow_of(req)
        flow = self.flows.get(key)
        if flow is None:
            self.append(req)
            return
        flow.appendleft(req)
        self._len += 1
        self._push_head(key)

    def serve(self, key: K, *, in_order: bool = True, weight: float | None = None) -> Request:
        """Pop the head of flow `key`. An out-of-order serve (aging, a rescue) is charged to
        the flow but leaves V alone; `weight` charges at another weight than the flow's."""
        flow = self.flows.get(key)
        if flow is None:
            raise EmptyQueueError(f"flow {key!r} is empty")
        req = flow.popleft()
        self._charge(key, req, in_order=in_order, weight=weight)
        return req

    def take(self, req: Request) -> None:
        """Serve `req` itself, wherever it waits (a rescue of the oldest request): charged
        to its flow like a served head, out of order (V stays)."""
        key = self._flow_of(req)
        self.flows[key].take(req)
        self._charge(key, req, in_order=False, weight=None)

    def _charge(self, key: K, req: Request, *, in_order: bool, weight: float | None) -> None:
        """Account `req`, just taken from flow `key`, as served: the flow's finish tag, V,
        and the flow's next start tag (or its going idle)."""
        flow = self.flows[key]
        start = self._start[key]
        self._len -= 1
        if self._undo:
            dropped: list[tuple[K, float]] = []  # idle tags this serve drops, for `put_back`
            self._served.append(Served(req, flow, self.virtual_time, self._finish[key], start, dropped))
            self._touched[id(flow)] = flow
            self._dropping = dropped
        w = weight if weight is not None else self._weight(key, req)
        self._finish[key] = start + self._cost(req) / w
        if in_order and start > self.virtual_time:
            self.virtual_time = start
        if flow:
            self._start[key] = max(self.virtual_time, self._finish[key])
            self._push_head(key)
        else:
            self._went_idle(key)
        self._forget_behind()
        self._dropping = None

    def put_back(self, req: Request, *, weight: float | None = None) -> None:
        """Return `req`, served a moment ago but never run (the engine skipped it), to its
        flow, as if it had not been served. With `keep_undo`, put back in the reverse order
        of their serves (as vLLM does with the requests it skips in a pass), requests leave
        V, every tag and every flow's order as they were. Otherwise the flow's finish tag
        goes back by the request's cost (at `weight`, if it was served at another weight
        than its flow's), V stays where later serves took it, and the flow starts no earlier
        than V, as a flow newly backlogged would."""
        key = self._flow_of(req)
        served = self._served
        undo = served.pop() if served and served[-1].req is req else None  # the latest serve
        self._len += 1
        flow = self.flows.get(key)
        if flow is None:  # the flow it left, if it is the latest serve's (a fair queue keeps state)
            self.flows[key] = flow = undo.flow if undo is not None else self._new_flow_here()
            self._idle_version.pop(key, None)  # its idle-heap entry, if any, is now stale
        flow.put_back(req)
        if undo is not None:
            self.virtual_time = undo.virtual_time
            for idle_key, idle_finish in undo.dropped:
                if idle_key not in self.flows:
                    self._idle_tag(idle_key, idle_finish)
            self._finish[key], self._start[key] = undo.finish, undo.start
        else:
            finish = self._finish.get(key)
            if finish is None:  # forgotten: it starts at V, which costs it nothing
                finish = self.virtual_time
            else:
                finish -= self._cost(req) / (weight if weight is not None else self._weight(key, req))
            self._finish[key] = finish
            self._start[key] = max(self.virtual_time, finish)
        self._push_head(key)

    def popleft(self) -> Request:
        key = self.next_flow()
        if key is None:
            raise EmptyQueueError("pop from an empty queue")
        return self.serve(key)

    def remove(self, req: Request) -> None:
        key = self._flow_of(req)
        flow = self.flows[key]
        was_head = flow.head() is req
        flow.remove(req)
        self._len -= 1
        if not flow:
            self._went_idle(key)
        elif was_head:
            self._push_head(key)

    # ---- tags ----------------------------------------------------------------------------

    def _backlogged(self, key: K) -> None:
        self._idle_version.pop(key, None)  # its idle-heap entry, if any, is now stale
        self._start[key] = max(self.virtual_time, self._finish.get(key, self.virtual_time))
        self._finish.setdefault(key, self._start[key])
        self._push_head(key)

    def _push_head(self, key: K) -> None:
        head = self.flows[key].head()
        if head is None:
            return
        version = next(self._serial)
        self._version[key] = version
        heapq.heappush(self._heads, (self._start[key], head.arrival_time, version, key))
        self.ops += 1
        if len(self._heads) > 2 * len(self.flows) + IDLE_TAGS_FLOOR:  # stale entries: amortized O(1)
            self._heads = [e for e in self._heads if self._version.get(e[3]) == e[2] and e[3] in self.flows]
            heapq.heapify(self._heads)
            self.ops += len(self._heads)

    def _went_idle(self, key: K) -> None:
        del self.flows[key]
        del self._start[key]
        self._version.pop(key, None)
        finish = self._finish[key]
        if finish <= self.virtual_time:
            del self._finish[key]
            return
        self._idle_tag(key, finish)
        self._cap_idle()

    def _idle_tag(self, key: K, finish: float) -> None:
        """Keep idle flow `key`'s finish tag (ahead of V)."""
        self._finish[key] = finish
        version = next(self._serial)
        self._idle_version[key] = version
        heapq.heappush(self._idle, (finish, version, key))
        self.ops += 1
        if len(self._idle) > 2 * len(self._idle_version) + IDLE_TAGS_FLOOR:  # stale entries
            self._idle = [e for e in self._idle if self._idle_version.get(e[2]) == e[1]]
            heapq.heapify(self._idle)
            self.ops += len(self._idle)

    def _forget_behind(self) -> None:
        """Drop idle tags at or behind V: the flow would start at V anyway."""
        idle = self._idle
        while idle and idle[0][0] <= self.virtual_time:
            self._drop_idle_top()

    def _cap_idle(self) -> None:
        limit = max(IDLE_TAGS_FLOOR, IDLE_TAGS_PER_FLOW * len(self.flows))
        while len(self._idle_version) > limit:
            self._drop_idle_top()

    def _drop_idle_top(self) -> None:
        _, version, key = heapq.heappop(self._idle)
        self.ops += 1
        if self._idle_version.get(key) == version:
            del self._idle_version[key]
            finish = self._finish.pop(key)
            if self._dropping is not None:
                self._dropping.append((key, finish))
