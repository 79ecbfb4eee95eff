from __future__ import annotations

import pytest

from tierserve.bench.metrics import BlockSampler, Preemption, RequestRecord
from tierserve.request import EventKind, Request, RequestStatus, SamplingParams
from tierserve.tiers import Tier

FIN, REJ, ABT = RequestStatus.FINISHED, RequestStatus.REJECTED, RequestStatus.ABORTED


def record(
    tier: Tier = Tier.P1,
    status: RequestStatus = FIN,
    arrival: float = 0.0,
    first: float | None = 1.0,
    finish: float = 5.0,
    num_output: int = 5,
    num_prompt: int = 100,
    num_cached: int = 0,
    measured: bool = True,
) -> RequestRecord:
    return RequestRecord(
        "r", 0, tier, measured, status, arrival, first, finish, num_prompt, num_output, num_cached, 0, 0
    )


def test_block_sampler_weights_by_step_time_and_keeps_peaks() -> None:
    sampler = BlockSampler()
    sampler.add(1.0, [10, 0, 0, 0], [0, 0, 0, 0])
    sampler.add(3.0, [2, 4, 0, 0], [0, 8, 0, 0])
    usage = sampler.usage()
    assert usage[Tier.P0].mean_used == pytest.approx((10 + 6) / 4)
    assert usage[Tier.P0].peak_used == 10
    assert usage[Tier.P1].mean_borrowed == pytest.approx(6.0) and usage[Tier.P1].peak_borrowed == 8
    assert sampler.peak_total == 10


def test_record_counts_preemptions_by_kind() -> None:
    req = Request("x", [1, 2, 3], SamplingParams(max_tokens=2), tier=Tier.P2, arrival_time=1.0)
    req.record(1.5, EventKind.ADMITTED)
    req.record(2.0, EventKind.PREEMPTED_SWAP, "4 blocks")
    req.record(2.5, EventKind.PREEMPTED_RECOMPUTE, "300 tokens to recompute")
    req.record(2.7, EventKind.READMITTED)
    req.record(2.9, EventKind.PREEMPTED_SWAP, "2 blocks")
    req.status, req.finish_time, req.first_token_time = FIN, 4.0, 3.0
    rec = RequestRecord.of(req, index=7, measured=True)
    assert (rec.num_swaps, rec.num_recomputes, rec.index, rec.tier) == (2, 1, 7, Tier.P2)
    assert rec.preemptions == (
        Preemption(2.0, True, 4),
        Preemption(2.5, False, 300),
        Preemption(2.9, True, 2),
    )
    assert rec.admitted_s == (1.5, 2.7)
    req.finish_reason = None
    assert RequestRecord.of(req, 7, True, "still unfinished").end_reason == "still unfinished"


def test_a_request_that_is_not_final_has_no_record() -> None:
    req = Request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="not final"):
        RequestRecord.of(req, index=0, measured=True)
