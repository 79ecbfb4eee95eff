"""A reference for P0's figures: what P0's own traffic costs P0.

The measured P0 requests alone, each taking exactly its idle TTFT of one server, served
by preemptive shortest-remaining-time-first (the order that minimises the mean slowdown)
with no other tier present and no step granularity. Where P0 requests arrive together
(the Mooncake trace's timestamps are whole seconds), some must wait for others whatever
the scheduler; this reference says how much. It is a reference, not a bound: shortest
first favours short prompts, so a policy may beat it on the long prompts' tail.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def srpt_slowdowns(jobs: Sequence[tuple[float, float]]) -> list[float]:
    """Each job's (completion - arrival) / size, in the order given; `jobs` are
    (arrival_s, size_s) with size > 0."""
    order = sorted(range(len(jobs)), key=lambda k: jobs[k][0])
    slowdowns = [0.0] * len(jobs)
    ready: list[tuple[float, int]] = []  # (remaining, job)
    now, i = 0.0, 0
    while i < len(order) or ready:
        if not ready:
            now = max(now, jobs[order[i]][0])
        while i < len(order) and jobs[order[i]][0] <= now:
            k = order[i]
            heapq.heappush(ready, (jobs[k][1], k))
            i += 1
        remaining, k = heapq.heappop(ready)
        next_arrival = jobs[order[i]][0] if i < len(order) else float("inf")
        if now + remaining <= next_arrival:
            now += remaining
            arrival, size = jobs[k]
            slowdowns[k] = (now - arrival) / size
        else:
            heapq.heappush(ready, (remaining - (next_arrival - now), k))
            now = next_arrival
    return slowdowns
