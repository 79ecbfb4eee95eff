"""The overdue requests of one tier, by tenant: the rescue and the aging of `hybrid`,
served in the tier's tenant-fair order.

A request is overdue once it has waited over `after_s` (since its arrival) and, with a
`until_s`, not yet that long: the rescue's window, over a quarter of the TTFT target
and short of all of it (a request past its target gains nothing from going first), or
aging's, past the tier's `aging_s` with no end. Under a queue that stays long there is
always an overdue request, so the one served must be chosen in the tenant-fair order, or
the tier runs in arrival order and a tenant that floods it takes it whatever the weights.
`pick` returns the oldest overdue request of the tenant whose start tag comes first among
the tenants that have one; with one tenant, the tier's oldest overdue request.

Fair queuing alone lets a tenant wait forever while new tenants keep coming: each starts
at the virtual time, below a tenant served before, and one-shot tenant ids arriving
faster than the tier is served would hold it back for good. Aging must not: with
`starve_s`, a tenant with an overdue request that has not been served for `starve_s`
(since its request became overdue, or came back to the queue after a preemption if that
was later, or since its last serve, `served`) goes first, the
longest held back first, so every tenant's oldest overdue request moves. The bound is a
backstop, not a share: a tenant whose fair share is under one request per `starve_s`
gets that one request, so with more tenants than the tier serves in `starve_s` the
weights count for less (all of them held back: one request each in turn).

State and cost: the requests not overdue yet sit in one heap on arrival time and move,
as time passes them, into their tenant's heap (a tenant is listed while it has one);
those past `until_s` leave the same way. The listed tenants are kept in a heap on
(start tag, oldest overdue arrival). A tenant's start tag in the tier's fair queue only
grows while it waits (every serve charges it), and its oldest overdue arrival only grows
except when a request is added, which lists the tenant again; so an entry is a lower
bound of its tenant's key, and an entry found behind its tenant's key is pushed again
with the key (lazy, O(log n) per change). `now` must not go back between calls.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from tierserve.request import Request

STALE_FLOOR = 64  # stale entries a heap may hold before it is rebuilt

Entry = tuple[float, int, Request]  # (arrival time, token, request)
TenantEntry = tuple[float, float, int, str]  # (start tag, oldest overdue arrival, version, tenant)


class OverdueByTenant:
    def __init__(self, after_s: float, until_s: float = math.inf, starve_s: float = math.inf) -> None:
        self.after_s = after_s
        self.until_s = until_s
        self.starve_s = starve_s
        self._token: dict[Request, int] = {}  # waiting request -> its live entry
        self._requeued_at: dict[Request, float] = {}  # ... back in the queue since (`add`)
        self._overdue: set[Request] = set()  # ... those moved into their tenant's heap
        self._pending: list[Entry] = []  # not overdue yet (or not looked at since)
        self._expiring: list[Entry] = []  # overdue, by arrival: to leave at `until_s`
        self._by_tenant: dict[str, list[Entry]] = {}  # overdue, per tenant (a listed tenant's)
        self._count: dict[str, int] = {}  # overdue requests per listed tenant
        self._tenants: list[TenantEntry] = []  # listed tenants
        self._version: dict[str, int] = {}  # listed tenant -> its live entry
        self._held_back: list[tuple[float, int, str]] = []  # (listed or last served, version, tenant)
        self._since: dict[str, int] = {}  # listed tenant -> its live entry there (with `starve_s`)
        self._held_since: dict[str, float] = {}  # ... and the time it holds
        # An unlisted tenant, held back from then once listed again (`hold_back_since`).
        self._relist_since: dict[str, tuple[float, Request]] = {}
        self._serial = itertools.count()

    def __len__(self) -> int:
        """Waiting requests held (overdue or not)."""
        return len(self._token)

    def num_overdue(self) -> int:
        return len(self._overdue)

    def add(self, req: Request, requeued_at: float | None = None) -> None:
        """`req` waits; `requeued_at`: back in the queue since then, after a preemption (its
        tenant is held back from then at the earliest: it was running before)."""
        self.discard(req)
        token = next(self._serial)
        self._token[req] = token
        if requeued_at is not None:
            self._requeued_at[req] = requeued_at
        self._push(self._pending, (req.arrival_time, token, req))

    def discard(self, req: Request) -> None:
        """`req` no longer waits (served or removed); its entries go when they reach a top."""
        if self._token.pop(req, None) is None:
            return
        self._requeued_at.pop(req, None)
        relist = self._relist_since.get(req.tenant)
        if relist is not None and relist[1] is req:
            del self._relist_since[req.tenant]
        if req in self._overdue:
            self._overdue.discard(req)
            self._uncount(req.tenant)

    def pick(self, now: float, start_tag: Callable[[str], float]) -> Request | None:
        """The oldest overdue request of the tenant with the smallest start tag (ties: the
        older request) among those with one, at `now`, unless a tenant has been held back
        over `starve_s` (its oldest overdue request, the longest held back first);
        `start_tag` gives a waiting tenant's tag in the tier's fair queue."""
        self._advance(now, start_tag)
        held_back = self._held_back
        while held_back:
            since, version, tenant = held_back[0]
            if self._since.get(tenant) != version:
                heapq.heappop(held_back)
                continue
            if now - since > self.starve_s:
                return self._oldest_of(tenant)
            break
        tenants = self._tenants
        while tenants:
            start, oldest, version, tenant = tenants[0]
            if self._version.get(tenant) != version:
                heapq.heappop(tenants)
                continue
            req = self._oldest_of(tenant)
            key = (start_tag(tenant), req.arrival_time)
            if key == (start, oldest):
                return req
            heapq.heappop(tenants)
            self._list(tenant, key)
        return None

    def served(self, req: Request, now: float) -> None:
        """`req` was served (taken from the queue to run, by any rule): its tenant, if it
        still has an overdue request, is held back from `now` on."""
        if self.starve_s < math.inf and req.tenant in self._count:
            self._hold_back(req.tenant, now)

    def tag_lowered(self, tenant: str, start_tag: Callable[[str], float]) -> None:
        """`tenant`'s start tag went down (a serve of it was undone): list it again at its
        key, which its entries no longer bound from below."""
        if tenant in self._count:
            self._list(tenant, (start_tag(tenant), self._oldest_of(tenant).arrival_time))

    def held_since(self, tenant: str) -> float | None:
        """Since when `tenant` is held back (None: it has no overdue request)."""
        return self._held_since.get(tenant)

    def hold_back_since(self, req: Request, since: float) -> None:
        """`req`, served a moment ago, is back (added again), not run: its tenant is held back
        from `since` again, the time `held_since` gave before the serve; a tenant the serve
        left with no overdue request, once it is listed again. Undone in the reverse order
        of the serves, the last call gives the time before them all."""
        if self.starve_s == math.inf or req not in self._token:
            return
        if req.tenant in self._count:
            self._hold_back(req.tenant, since)
        else:  # undone in reverse order: the last one is the time before the pass
            self._relist_since[req.tenant] = (since, req)

    # ---- moving requests in and out ------------------------------------------------------

    def advance(self, now: float, start_tag: Callable[[str], float]) -> None:
        """Bring the lists up to `now` (as `pick` and `oldest` do first): before a serve,
        so that `served` holds back a tenant whose request has become overdue whether or not
        a pick has looked since."""
        self._advance(now, start_tag)

    def _advance(self, now: float, start_tag: Callable[[str], float]) -> None:
        """Move the requests that `now` makes overdue into their tenants' heaps, and drop
        those it puts past `until_s`."""
        pending, live, after, until = self._pending, self._token, self.after_s, self.until_s
        while pending and now - pending[0][0] > after:
            entry = heapq.heappop(pending)
            arrival, token, req = entry
            if live.get(req) != token or now - arrival >= until:
                continue
            self._overdue.add(req)
            self._push(self._expiring, entry)
            tenant = req.tenant
            relist = self._relist_since.get(tenant)  # `hold_back_since`, for this request
            restored = None
            if relist is not None and relist[1] is req:
                del self._relist_since[tenant]
                restored = relist[0]
            heap = self._by_tenant.get(tenant)
            if heap is None:  # the tenant's first: listed
                self._by_tenant[tenant] = [entry]
                self._count[tenant] = 1
                self._list(tenant, (start_tag(tenant), arrival))
                if self.starve_s < math.inf:
                    # From when the request became overdue, not when a pick first looked:
                    # the same whenever (and however often) the tier is looked at.
                    overdue_at = max(arrival + after, self._requeued_at.get(req, -math.inf))
                    self._hold_back(tenant, overdue_at if restored is None else restored)
                continue
            if restored is not None:  # listed meanwhile by an older request: as before the serve
                self._hold_back(tenant, restored)
            self._count[tenant] += 1
            older = arrival < self._oldest_of(tenant).arrival_time  # one put back after a preemption
            heapq.heappush(heap, entry)
            if older:
                self._list(tenant, (start_tag(tenant), arrival))
            elif len(heap) > 2 * self._count[tenant] + STALE_FLOOR:
                heap[:] = [e for e in heap if live.get(e[2]) == e[1]]
                heapq.heapify(heap)
        expiring = self._expiring
        while expiring and now - expiring[0][0] >= until:
            _, token, req = heapq.heappop(expiring)
            if live.get(req) == token:
                self.discard(req)

    def _oldest_of(self, tenant: str) -> Request:
        """A listed tenant's oldest overdue request (its heap's stale top entries go)."""
        heap, live = self._by_tenant[tenant], self._token
        while True:
            _, token, req = heap[0]
            if live.get(req) == token:
                return req
            heapq.heappop(heap)

    def _uncount(self, tenant: str) -> None:
        left = self._count[tenant] - 1
        if left:
            self._count[tenant] = left
            return
        del self._count[tenant], self._by_tenant[tenant], self._version[tenant]
        self._since.pop(tenant, None)
        self._held_since.pop(tenant, None)

    def _list(self, tenant: str, key: tuple[float, float]) -> None:
        """(Re)list `tenant` at `key`: its start tag and its oldest overdue arrival."""
        version = next(self._serial)
        self._version[tenant] = version
        heapq.heappush(self._tenants, (key[0], key[1], version, tenant))
        tenants = self._tenants
        if len(tenants) > 2 * len(self._version) + STALE_FLOOR:  # in place: `pick` holds the list
            tenants[:] = [e for e in tenants if self._version.get(e[3]) == e[2]]
            heapq.heapify(tenants)

    def _hold_back(self, tenant: str, since: float) -> None:
        version = next(self._serial)
        self._since[tenant] = version
        self._held_since[tenant] = since
        heapq.heappush(self._held_back, (since, version, tenant))
        held_back = self._held_back
        if len(held_back) > 2 * len(self._since) + STALE_FLOOR:
            held_back[:] = [e for e in held_back if self._since.get(e[2]) == e[1]]
            heapq.heapify(held_back)

    def _push(self, heap: list[Entry], entry: Entry) -> None:
        heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._token) + STALE_FLOOR:
            live = self._token
            heap[:] = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(heap)

    def heap_sizes(self) -> tuple[int, int, int, int, int]:
        """Entries held, stale ones included (pending, expiring, per tenant, tenants, held
        back): the state a test can bound."""
        per_tenant = sum(len(h) for h in self._by_tenant.values())
        return len(self._pending), len(self._expiring), per_tenant, len(self._tenants), len(self._held_back)
