"""A fleet of simulated engine replicas behind the gateway's own routing, in virtual time.

One event loop owns the clock (see `events`). Requests arrive from a workload stream and
go through `FleetDispatch` (the gateway's `Router` and `FlowControl`); replicas step at
their own boundaries; the gateway scrapes each serving replica's exported load every
`scrape_interval_s`, so routing sees it with the staleness it would have; the autoscaler
ticks every `interval_s`. A killed replica's requests are retried on another replica if
no token had reached the client yet (up to `max_attempts` replicas), else lost, as the
gateway does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from tierserve.bench.collector import collector_paused
from tierserve.clock import VirtualClock
from tierserve.engine import Engine
from tierserve.fleet.autoscaler import AutoscaleConfig, Autoscaler, Observation
from tierserve.fleet.dispatch import DispatchOutcome
from tierserve.fleet.events import Event, EventKind, EventQueue
from tierserve.fleet.observe import AloneTtft, FleetObserver
from tierserve.fleet.replica import Replica, ReplicaState
from tierserve.fleet.requests import (
    LOST,
    REFUSED_PREFIX,
    REJECTED,
    UNFINISHED,
    FleetRequest,
    outcome_of,
)
from tierserve.fleet.routing import build_dispatch, replica_name, replica_upstream
from tierserve.gateway.config import GatewaySettings
from tierserve.gateway.saturation import LoadSample
from tierserve.request import Request, SamplingParams
from tierserve.tiers import Tier
from tierserve.workloads.spec import RequestSpec


@dataclass(frozen=True)
class FleetConfig:
    num_replicas: int
    router: str = "tier-aware"
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    settings: GatewaySettings = field(default_factory=GatewaySettings)
    num_gpus_per_replica: int = 8
    kills: tuple[tuple[float, int], ...] = ()  # (time, replica index): that replica dies then
    drain_timeout_s: float = 600.0  # after the last arrival; what is left then is unfinished


@dataclass
class FleetResult:
    requests: list[FleetRequest]
    end_s: float
    gpu_seconds: float
    # (time, serving, starting) from the start, at every change and at the end; serving counts
    # draining replicas too, so the step curve times the GPUs per replica integrates to gpu_seconds
    replicas_over_time: list[tuple[float, int, int]]
    routed_by_reason: dict[str, int]
    num_launched: int
    # Each `kills` entry as (time, replica index, what it did): "killed" (while serving;
    # "killed while starting" or "while draining" otherwise), or why it did nothing ("not
    # launched", "already dead", "already stopped", "after the end"): an autoscaling fleet
    # may not have launched the replica by then, and a report listing the kills asked for
    # said nothing of that.
    faults: list[tuple[float, int, str]] = field(default_factory=list)


class FleetSim:
    def __init__(
        self,
        config: FleetConfig,
        build_engine: Callable[[VirtualClock], Engine],
        alone_s: AloneTtft | None = None,
    ) -> None:
        """`alone_s`: a request's TTFT alone on an idle replica, for the autoscaler's P0
        attainment (observe.py); without it every P0 request counts."""
        self.config = config
        self.clock = VirtualClock()
        self._build = build_engine
        self.events = EventQueue()
        self.replicas: dict[str, Replica] = {}
        self._tokens: dict[str, int] = {}  # replica -> generation of its live boundary event
        self.dispatch = build_dispatch(config.router, config.settings, self.clock)
        self.autoscaler = Autoscaler(config.autoscale)
        self.observer = FleetObserver(self.clock, alone_s=alone_s)
        self.requests: list[FleetRequest] = []
        self._live: dict[str, FleetRequest] = {}  # engine request id -> its fleet request
        self._num_open = 0
        self._specs: Iterator[RequestSpec] = iter(())
        self._last_arrival_s = 0.0
        self.replicas_over_time: list[tuple[float, int, int]] = []
        self.faults: list[tuple[float, int, str]] = []  # FleetResult.faults
        # Progress: called as each request ends, however (answered, refused, lost, cut at the
        # end). Counted on arrivals, a bar read 100 % while a long drain was still to run.
        self.on_end: Callable[[], None] = lambda: None
        # Skip the scrapes of an idle fleet up to its next event (`_scrape_all`); the results
        # are the same without it (tests/fleet/test_idle_gaps.py), only slower.
        self.skip_idle_scrapes = True

    # ---- the loop -------------------------------------------------------------------------

    def run(self, specs: Iterable[RequestSpec]) -> FleetResult:
        """Replay `specs` (with their arrival times) through the fleet, with the cyclic
        garbage collector paused (bench/collector.py)."""
        with collector_paused():
            return self._run(specs)

    def _run(self, specs: Iterable[RequestSpec]) -> FleetResult:
        self._specs = iter(specs)
        for _ in range(self.config.num_replicas):
            self._launch(0.0)
        for when, index in self.config.kills:
            self.events.push(when, EventKind.KILL, str(index))
        self._next_arrival()
        self.events.push(0.0, EventKind.SCRAPE)
        self.events.push(0.0, EventKind.AUTOSCALE)
        handlers: dict[EventKind, Callable[[Event], None]] = {
            EventKind.ARRIVAL: self._arrival,
            EventKind.READY: self._ready,
            EventKind.KILL: self._kill,
            EventKind.BOUNDARY: self._boundary,
            EventKind.SCRAPE: self._scrape_all,
            EventKind.AUTOSCALE: self._autoscale,
        }
        while len(self.events) and not self._done():
            ev = self.events.pop()
            if ev.time > self._deadline():
                # The run ends at the deadline, not at the last event handled before it: a
                # fast replica leaps over the step boundaries that a stepping one handles.
                self.clock.advance_to(self._deadline())
                break
            self.clock.advance_to(ev.time)
            handlers[ev.kind](ev)
        return self._result()

    def _done(self) -> bool:
        return self._num_open == 0 and self._spec is None

    def _deadline(self) -> float:
        return math.inf if self._spec is not None else self._last_arrival_s + self.config.drain_timeout_s

    def _result(self) -> FleetResult:
        now = self.clock.now()
        for fr in self.requests:
            if fr.outcome is None:
                fr.end(UNFINISHED, now)
                self.on_end()
        self._record_replicas(final=True)
        fired = {(when, index) for when, index, _ in self.faults}
        late = [
            (when, index, "after the end") for when, index in self.config.kills if (when, index) not in fired
        ]
        gpus = self.config.num_gpus_per_replica
        return FleetResult(
            self.requests,
            now,
            sum(r.gpu_seconds(now, gpus) for r in self.replicas.values()),
            self.replicas_over_time,
            dict(self.dispatch.num_routed_by_reason),
            len(self.replicas),
            self.faults + sorted(late),  # in the order they fired (a repeated kill after the first)
        )

    # ---- arrivals and routing ---------------------------------------------------------------

    def _next_arrival(self) -> None:
        self._spec = next(self._specs, None)
        if self._spec is not None:
            if self._spec.arrival_s is None:
                raise ValueError(f"spec {self._spec.index} has no arrival time (the fleet runs open loop)")
            self.events.push(self._spec.arrival_s, EventKind.ARRIVAL)

    def _arrival(self, ev: Event) -> None:
        spec = self._spec
        if spec is None:
            return
        self._last_arrival_s = self.clock.now()
        fr = FleetRequest(len(self.requests), spec, self.clock.now())
        self.requests.append(fr)
        self._num_open += 1
        self._next_arrival()
        fr.submitted_s = self.clock.now()
        self._handle(self.dispatch.submit(fr.key, fr.tier, fr.prefix))

    def _handle(self, out: DispatchOutcome) -> None:
        for key, upstream in out.routed:
            self._send(self.requests[key], self.replicas[upstream])
        for key, reason in out.refused:
            self._finish(self.requests[key], REFUSED_PREFIX + reason)

    def _send(self, fr: FleetRequest, replica: Replica) -> None:
        fr.queued_s += self.clock.now() - fr.submitted_s
        fr.attempts += 1
        fr.tried.append(replica.name)
        fr.sent_s.append(self.clock.now())
        spec = fr.live_spec
        req = Request(
            f"r{spec.index}" if fr.attempts == 1 else f"r{spec.index}.{fr.attempts}",
            spec.prompt_token_ids,
            SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
            tier=spec.tier,
            tenant=spec.tenant,
            arrival_time=self.clock.now(),  # when this replica receives it
        )
        self._live[req.request_id] = fr
        replica.send(req)
        if replica.next_boundary is None:
            replica.next_boundary = self.clock.now()
            self._schedule(replica)

    def _finish(self, fr: FleetRequest, outcome: str) -> None:
        if fr.first_token_s is None:
            self.observer.ended_without_token(fr)
        fr.end(outcome, self.clock.now())
        self.on_end()
        self._num_open -= 1

    def _end(self, fr: FleetRequest, outcome: str, upstream: str) -> None:
        self._finish(fr, outcome)
        self._handle(self.dispatch.finished(upstream, fr.tier))

    # ---- replicas -------------------------------------------------------------------------

    def _launch(self, delay_s: float) -> Replica:
        name = replica_name(len(self.replicas))  # every launch a name of its own, as a new pod's address
        replica = Replica(name, self._build, self.clock.now())
        self.replicas[name] = replica
        self.dispatch.router.add_upstream(replica_upstream(name))
        if delay_s > 0:
            self.events.push(self.clock.now() + delay_s, EventKind.READY, name)
        else:
            self._make_ready(replica)
        self._record_replicas()
        return replica

    def _ready(self, ev: Event) -> None:
        replica = self.replicas[ev.target]
        if replica.state is ReplicaState.STARTING:
            self._make_ready(replica)

    def _make_ready(self, replica: Replica) -> None:
        replica.make_ready(self.clock.now())
        self._record_replicas()
        self._scrape(replica)
        self._handle(self.dispatch.pump())

    def _schedule(self, replica: Replica) -> None:
        if replica.next_boundary is None:
            return
        token = self._tokens.get(replica.name, 0) + 1
        self._tokens[replica.name] = token
        self.events.push(replica.next_boundary, EventKind.BOUNDARY, replica.name, token)

    def _boundary(self, ev: Event) -> None:
        replica = self.replicas[ev.target]
        if self._tokens.get(replica.name) != ev.token or not replica.serving:
            return
        delivered, rejected = replica.boundary(self.clock.now(), self._quiet_until())
        for req in rejected:
            self._end(self._live.pop(req.request_id), REJECTED, replica.name)
        for out in delivered:
            fr = self._live.get(out.request.request_id)
            if fr is None:
                continue
            if fr.first_token_s is None and out.request.first_token_time is not None:
                fr.first_token_s = out.request.first_token_time
                self.observer.first_token(fr)
            if out.finished:
                del self._live[out.request.request_id]
                self._end(fr, outcome_of(out.request), replica.name)
        self._schedule(replica)
        if replica.state is ReplicaState.DRAINING and replica.next_boundary is None and not replica.inbox:
            replica.end(ReplicaState.STOPPED, self.clock.now())
            self._record_replicas()

    def _quiet_until(self) -> float:
        """Until when nothing can reach a replica or read its state, as far as the fleet
        knows now: the next arrival, scrape, tick, start-up or fault. Another replica's
        boundary can send only what waits in the gateway's queue, so with a queue there is
        no such time (a fast replica then steps)."""
        if self.dispatch.depth():
            return -math.inf
        return min(self.events.next_time(skip=EventKind.BOUNDARY), self._deadline())

    def _kill(self, ev: Event) -> None:
        name = replica_name(int(ev.target))
        replica = self.replicas.get(name)
        if replica is None or replica.state in (ReplicaState.DEAD, ReplicaState.STOPPED):
            why = "not launched" if replica is None else f"already {replica.state.value}"
            self.faults.append((self.clock.now(), int(ev.target), why))
            return
        what = "killed" if replica.state is ReplicaState.READY else f"killed while {replica.state.value}"
        self.faults.append((self.clock.now(), int(ev.target), what))
        # Every request sent here and not yet delivered as ended, including those the step in
        # flight would have ended: that step's outputs never reach the gateway.
        live = [(rid, fr) for rid, fr in self._live.items() if fr.tried[-1] == name]
        replica.end(ReplicaState.DEAD, self.clock.now())
        self._record_replicas()
        self.dispatch.router.record_failure(name, eject_now=True)
        for rid, fr in live:
            del self._live[rid]
            self.dispatch.router.finished(name, fr.tier)
            if fr.first_token_s is not None:
                self._finish(fr, LOST)  # the stream broke midway: the client sees an error event
            elif fr.attempts >= self.config.settings.max_attempts:
                self._finish(fr, REFUSED_PREFIX + "no_upstream")
            else:  # it keeps its place in the queue and the wait it has left, as in the gateway
                fr.submitted_s = self.clock.now()
                self._handle(self.dispatch.submit(fr.key, fr.tier, fr.prefix, fr.tried, fr.queued_s))
        self._handle(self.dispatch.pump())

    # ---- the gateway's scrapes and the autoscaler ------------------------------------------------

    def _scrape(self, replica: Replica) -> None:
        e = replica.exported
        router = self.dispatch.router
        router.record_sample(
            replica.name,
            LoadSample(e.num_waiting, e.num_running, e.kv_usage, self.clock.now(), e.waiting_by_tier),
        )
        replica.note_waiting(e.num_waiting)
        if replica.state is ReplicaState.READY:
            router.record_success(replica.name)

    def _scrape_all(self, ev: Event) -> None:
        now = self.clock.now()
        for replica in self.replicas.values():
            if replica.serving:
                self._scrape(replica)
        self._handle(self.dispatch.pump())
        interval = self.config.settings.scrape_interval_s
        next_scrape = now + interval
        if self.skip_idle_scrapes and self._idle():
            # Until the next event of another kind every scrape reads the same idle fleet, and
            # changes nothing this one did not: go on from the last of them before that event
            # (its time summed interval by interval, as the scrapes would have summed it). A
            # trace's gaps of hours no longer cost a scrape of every replica every interval.
            until = min(self.events.next_time(skip=EventKind.SCRAPE), self._deadline())
            while next_scrape + interval < until:
                next_scrape += interval
        self.events.push(next_scrape, EventKind.SCRAPE)

    def _idle(self) -> bool:
        """No request open anywhere (none queued at the gateway, none on a replica) and no
        replica stepping."""
        return self._num_open == 0 and all(
            r.next_boundary is None and not r.inbox for r in self.replicas.values() if r.serving
        )

    def _autoscale(self, ev: Event) -> None:
        now = self.clock.now()
        serving = [r for r in self.replicas.values() if r.state is ReplicaState.READY]
        for replica in serving:
            replica.observe_busy(now)  # its busy fraction and token load over the autoscaler's interval
        starting = [r for r in self.replicas.values() if r.state is ReplicaState.STARTING]
        states = {s.name: s for s in self.dispatch.router.states}
        newest = max((r.ready_s for r in serving if r.ready_s is not None), default=-math.inf)
        p0_attainment, p0_samples = self.observer.p0_attainment(since=newest)
        read = [sample for r in serving if (sample := states[r.name].sample) is not None]
        obs = Observation(
            now,
            len(serving),
            len(starting),
            [r.utilization for r in serving if r.utilization is not None],
            [_waiting(r, states[r.name].sample) for r in serving],
            self.dispatch.depth(Tier.P0),
            p0_attainment,
            sum(r.utilization is None for r in serving),
            p0_samples,
            kv_usage=[sample.kv_usage for sample in read],
            urgent_waiting=[_urgent_waiting(sample) for sample in read],
            queued=sum(self.dispatch.depth(tier) for tier in (Tier.P0, Tier.P1, Tier.P2)),
            token_load=[r.token_load for r in serving if r.token_load is not None],
        )
        for replica in self.replicas.values():
            replica.least_waiting = None  # the next interval's scrapes start afresh
        change = self.autoscaler.decide(obs)
        if change > 0:
            self._launch(self.config.autoscale.startup_delay_s)
        elif change < 0:  # drain the least loaded, as the gateway last saw them
            by_load = sorted(serving, key=lambda r: (r.exported.num_running + r.exported.num_waiting, r.name))
            for replica in by_load[:-change]:
                self._drain(replica)
        self.events.push(now + self.config.autoscale.interval_s, EventKind.AUTOSCALE)

    def _drain(self, replica: Replica) -> None:
        replica.state = ReplicaState.DRAINING
        self.dispatch.router.record_failure(replica.name, eject_now=True)
        if replica.next_boundary is None and not replica.inbox:
            replica.end(ReplicaState.STOPPED, self.clock.now())
        self._record_replicas()

    def _record_replicas(self, final: bool = False) -> None:
        """Note the fleet's size now, (time, serving, starting), if it changed (`final`: the
        run's end, always). Serving counts draining replicas, which hold their GPUs until they
        stop; a point replaces one taken at the same instant."""
        now = self.clock.now()
        states = [r.state for r in self.replicas.values()]
        serving = sum(s in (ReplicaState.READY, ReplicaState.DRAINING) for s in states)
        point = (now, serving, states.count(ReplicaState.STARTING))
        points = self.replicas_over_time
        if points and points[-1][0] == now:
            points[-1] = point
        elif final or not points or points[-1][1:] != point[1:]:
            points.append(point)


def _waiting(replica: Replica, sample: LoadSample | None) -> float:
    """A replica's waiting requests as the autoscaler reads them (`Observation.num_waiting`):
    the fewest any scrape found since the last tick, or the last scrape's."""
    if replica.least_waiting is not None:
        return replica.least_waiting
    return sample.num_waiting if sample is not None else 0.0


def _urgent_waiting(sample: LoadSample) -> float:
    """The requests of P0-P2 a scrape found waiting on a replica (all of its waiting ones
    where it does not export them by tier)."""
    if sample.waiting_by_tier is None:
        return sample.num_waiting
    return sum(sample.waiting_by_tier[: Tier.P3])
