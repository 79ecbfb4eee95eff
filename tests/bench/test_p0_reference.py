from __future__ import annotations

import pytest

from tierserve.bench.p0_reference import srpt_slowdowns


def test_jobs_arriving_together_go_shortest_first() -> None:
    assert srpt_slowdowns([(0.0, 2.0), (0.0, 1.0)]) == pytest.approx([1.5, 1.0])


def test_a_shorter_arrival_preempts_the_job_in_service() -> None:
    # A (4 s) starts at 0; B (1 s) arrives at 1, runs at once and ends at 2; A ends at 5.
    assert srpt_slowdowns([(0.0, 4.0), (1.0, 1.0)]) == pytest.approx([1.25, 1.0])


def test_jobs_apart_in_time_never_wait() -> None:
    assert srpt_slowdowns([(0.0, 1.0), (5.0, 2.0), (10.0, 0.5)]) == pytest.approx([1.0, 1.0, 1.0])
