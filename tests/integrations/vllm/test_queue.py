"""vLLM's waiting queue ordered by a tierserve policy (needs vLLM for its RequestQueue base)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from tierserve.config import EngineConfig
from tierserve.integrations.vllm.book import BookError, RequestBook
from tierserve.integrations.vllm.queue import PolicyRequestQueue
from tierserve.scheduling import create_policy
from tierserve.tiers import Tier


def _req(rid: str, arrival: float) -> Any:
    return SimpleNamespace(request_id=rid, max_tokens=8, prompt_token_ids=[5, 6, 7], arrival_time=arrival)


def _queue() -> tuple[PolicyRequestQueue, RequestBook]:
    book = RequestBook()
    return PolicyRequestQueue(create_policy("hybrid", EngineConfig()), book), book


def test_hybrid_order_and_peek_agrees_with_pop() -> None:
    q, book = _queue()
    q.tick(100.0)
    for rid, tier, t in (("p2", Tier.P2, 1.0), ("p1", Tier.P1, 2.0), ("p0", Tier.P0, 3.0)):
        req = _req(rid, t)
        book.add(req, tier, "default")
        q.add_request(req)
    assert len(q) == 3 and {r.request_id for r in q} == {"p0", "p1", "p2"}
    order = []
    while q:
        head = q.peek_request()
        assert q.pop_request() is head
        order.append(head.request_id)
    assert order[0] == "p0"
    with pytest.raises(IndexError):
        q.peek_request()


def test_prepend_puts_a_preempted_request_back_first_in_its_tier() -> None:
    q, book = _queue()
    a, b = _req("a", 1.0), _req("b", 2.0)
    for r in (a, b):
        book.add(r, Tier.P1, "default")
    q.add_request(b)
    q.prepend_request(a)
    assert q.pop_request() is a


def test_removing_a_request_not_queued_here_is_a_no_op() -> None:
    q, book = _queue()
    a, other = _req("a", 1.0), _req("other", 1.0)
    book.add(a, Tier.P1, "default")
    book.add(other, Tier.P3, "default")  # e.g. in vLLM's kv_holding_waiting queue
    q.add_request(a)
    q.remove_requests([a, other])
    assert len(q) == 0


def test_a_request_ends_exactly_once() -> None:
    book = RequestBook()
    book.add(_req("x", 0.0), Tier.P0, "t")
    book.end("x")
    with pytest.raises(BookError):
        book.end("x")
    assert (book.num_added, book.num_ended, len(book)) == (1, 1, 0)


def test_show_only_hides_the_other_tiers_until_lifted() -> None:
    q, book = _queue()
    q.tick(100.0)
    for rid, tier in (("p1", Tier.P1), ("p0", Tier.P0)):
        req = _req(rid, 1.0)
        book.add(req, tier, "default")
        q.add_request(req)
    q.show_only(Tier.P0)
    assert q.pop_request().request_id == "p0"
    assert not q and len(q) == 1  # the P1 is still queued, unseen
    with pytest.raises(IndexError):
        q.pop_request()
    q.show_only(None)
    assert q and q.pop_request().request_id == "p1"


def test_a_tiers_waiting_requests_are_known_without_walking_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler asks for the waiting P0 requests at every step while one waits; it
    walked the whole queue for them (9 ms a step with 20,000 queued)."""
    q, book = _queue()
    q.tick(100.0)
    reqs = {rid: _req(rid, float(i)) for i, rid in enumerate(("a0", "b2", "c0", "d3", "e0"))}
    for rid, r in reqs.items():
        book.add(r, Tier(int(rid[1])), "default")
        q.add_request(r)
    monkeypatch.setattr(PolicyRequestQueue, "__iter__", lambda self: pytest.fail("walked the queue"))
    assert [r.request_id for r in q.waiting_in(Tier.P0)] == ["a0", "c0", "e0"]
    q.remove_request(reqs["c0"])
    first = q.pop_request()  # a P0 (hybrid: P0 first)
    assert {r.request_id for r in q.waiting_in(Tier.P0)} == {"a0", "e0"} - {first.request_id}
    q.prepend_request(first)
    assert {r.request_id for r in q.waiting_in(Tier.P0)} == {"a0", "e0"}
    assert [r.request_id for r in q.waiting_in(Tier.P3)] == ["d3"]
    while q:
        q.pop_request()
    assert all(q.waiting_in(t) == [] for t in Tier)


def test_a_request_the_book_has_forgotten_still_leaves_the_queue() -> None:
    """vLLM frees a preempted request that its last step's output stops (the plug-in ends
    its book entry then) before it takes the request out of the waiting queue: the queue
    kept it, and the next step's peek raised BookError in the engine core."""
    q, book = _queue()
    a, b = _req("a", 1.0), _req("b", 2.0)
    for r, tier in ((a, Tier.P1), (b, Tier.P2)):
        book.add(r, tier, "default")
        q.add_request(r)
    book.end("a")
    q.remove_request(a)
    assert len(q) == 1 and q.waiting_in(Tier.P1) == [] and q.peek_request() is b


def test_a_request_vllm_skips_pass_after_pass_costs_its_tenant_nothing() -> None:
    """vLLM skips a waiting request it cannot run yet (grammar compiling, connector undecided,
    LoRA without a slot) by popping it and putting it back at the end of the pass. Charged as
    served at every such pass, its tenant fell behind: here b, its first request skipped for
    30 passes while one request a pass was admitted, got 1 of the 30 against a's 29."""
    q, book = _queue()
    for i in range(40):
        for tenant, offset in (("a", 0.0), ("b", 0.0005)):
            req = _req(f"{tenant}{i}", 0.001 * i + offset)
            book.add(req, Tier.P2, tenant)
            q.add_request(req)
    now, admitted = 1.0, []
    for _ in range(30):
        now += 0.01
        q.tick(now)
        skipped = []
        while True:
            req = q.pop_request()
            if req.request_id != "b0":
                admitted.append(req.request_id[0])
                break
            skipped.append(req)
        q.prepend_requests(reversed(skipped))  # as vLLM: the last skipped first
        q.end_pass()
    assert abs(admitted.count("a") - admitted.count("b")) <= 2, f"not half each: {admitted}"
    q.tick(now + 0.01)
    first = [q.pop_request().request_id for _ in range(2)]
    assert "b0" in first, f"b0, runnable again, waited behind {first}"


@pytest.mark.parametrize("skipped", [True, False])
def test_only_a_request_put_back_in_the_pass_that_popped_it_is_refunded(skipped: bool) -> None:
    """Tenants a and b, one P1 request each; a's goes first (it arrived first). Put back in the
    same pass, it was skipped: it goes first again. Put back after the pass, it ran and was
    preempted: its tenant was served, so b's request goes first."""
    q, book = _queue()
    a, b = _req("a", 1.0), _req("b", 2.0)
    for r, tenant in ((a, "ta"), (b, "tb")):
        book.add(r, Tier.P1, tenant)
        q.add_request(r)
    q.tick(10.0)
    assert q.pop_request() is a
    if not skipped:
        q.end_pass()
        q.tick(10.1)
    q.prepend_request(a)
    q.end_pass()
    q.tick(10.2)
    order = [q.pop_request() for _ in range(2)]
    assert order == ([a, b] if skipped else [b, a])


class _Gate:
    def __init__(self, admits: Any, room: bool = True) -> None:
        self.admits, self.has_room = admits, room

    def room(self) -> bool:
        return self.has_room


def test_a_gate_skips_a_request_for_the_pass_and_puts_it_back_uncharged() -> None:
    q, book = _queue()
    q.tick(100.0)
    reqs = {}
    for rid, tier, t in (("a0", Tier.P0, 1.0), ("b0", Tier.P0, 2.0), ("c1", Tier.P1, 3.0)):
        reqs[rid] = _req(rid, t)
        book.add(reqs[rid], tier, "default")
        q.add_request(reqs[rid])
    q.gate = _Gate(lambda r: r.request_id != "a0")  # a0 may not run this pass (its adapter, say)
    q.gate.has_room = False  # no seat free: vLLM admits nobody, the gate skips nobody
    assert q.peek_request().request_id == "a0" and len(q) == 3
    q.gate.has_room = True
    assert q and q.peek_request().request_id == "b0"
    assert len(q) == 3 and {r.request_id for r in q} == {"a0", "b0", "c1"}  # still queued
    assert q.pop_request().request_id == "b0"
    q.remove_request(reqs["c1"])  # ended meanwhile
    assert not q  # a0 is held for the pass: vLLM's loop sees an empty queue
    q.gate = None
    q.end_pass()
    assert len(q) == 1 and q.peek_request().request_id == "a0"
    # What the gate skipped went back as it was: the same order as a queue never gated.
    q2, book2 = _queue()
    q2.tick(100.0)
    for rid, tier, t in (("a0", Tier.P0, 1.0), ("c1", Tier.P1, 3.0)):
        r = _req(rid, t)
        book2.add(r, tier, "default")
        q2.add_request(r)
    q.tick(101.0)
    q.add_request(reqs["c1"])
    q2.tick(101.0)
    assert [r.request_id for r in q] == [r.request_id for r in q2]
