"""Weighted fair queuing across all four tiers (weights 16/8/4/2 by default)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling.base import Policy
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.scheduling.sfq import TierFairQueues
from tierserve.tiers import ALL_TIERS


def expected_cost(req: Request) -> float:
    return float(req.expected_cost_tokens)


class FairQueuePolicy(Policy):
    """A policy whose waiting requests live in one set of tier fair queues, `self._sfq`."""

    _sfq: TierFairQueues

    def _push(self, req: Request, now: float) -> None:
        self._sfq.append(req)

    def _push_front(self, req: Request, now: float) -> None:
        self._sfq.appendleft(req)

    def _put_back(self, req: Request, now: float) -> None:
        self._sfq.put_back(req)

    def keep_undo(self, on: bool = True) -> None:
        super().keep_undo(on)
        self._sfq.keep_undo(on)

    def forget_undo(self) -> None:
        self._sfq.forget_undo()

    def _remove(self, req: Request) -> None:
        self._sfq.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._sfq)


class WfqPolicy(FairQueuePolicy):
    name: ClassVar[str] = "wfq"
    leaps_decodes: ClassVar[bool] = True  # no step hooks; peek on an empty queue changes nothing
    leaps_while_waiting: ClassVar[bool] = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        weights = [config.tiers[t].wfq_weight for t in ALL_TIERS]
        self._sfq = TierFairQueues(weights, expected_cost)

    def peek(self, now: float) -> Request | None:
        tier = self._sfq.best(ALL_TIERS)
        return None if tier is None else self._sfq.head_of(tier)

    def _pop(self, now: float) -> Request:
        tier = self._sfq.best(ALL_TIERS)
        if tier is None:
            raise EmptyQueueError("pop from an empty queue")
        return self._sfq.serve(tier)
