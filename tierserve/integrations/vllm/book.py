"""The plug-in's record of every live vLLM request: its tier, tenant and the tierserve
`Request` that stands for it in tierserve's policies.

tierserve's policies order `tierserve.request.Request` objects; each vLLM request gets one
such shadow (same id, prompt length, output budget, arrival time, tier and tenant), made
once when the request arrives and dropped when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierserve.request import Request, SamplingParams
from tierserve.tiers import Tier

if TYPE_CHECKING:
    from vllm.v1.request import Request as VllmRequest


class BookError(KeyError):
    """A request the book does not hold (or holds twice)."""


@dataclass(eq=False)
class Entry:
    vllm: VllmRequest
    shadow: Request
    first_token_seen: bool = False


class RequestBook:
    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self.num_added = 0
        self.num_ended = 0

    def add(self, req: VllmRequest, tier: Tier, tenant: str) -> Entry:
        rid = req.request_id
        if rid in self._entries:
            raise BookError(f"request {rid!r} is already in the book")
        max_tokens = req.max_tokens if req.max_tokens is not None and req.max_tokens > 0 else 1
        shadow = Request(
            request_id=rid,
            prompt_token_ids=list(req.prompt_token_ids or [0]),
            sampling=SamplingParams(max_tokens=max_tokens),
            tier=tier,
            tenant=tenant,
            arrival_time=req.arrival_time,
        )
        entry = Entry(req, shadow)
        self._entries[rid] = entry
        self.num_added += 1
        return entry

    def get(self, request_id: str) -> Entry:
        try:
            return self._entries[request_id]
        except KeyError:
            raise BookError(f"request {request_id!r} is not in the book") from None

    def find(self, request_id: str) -> Entry | None:
        return self._entries.get(request_id)

    def end(self, request_id: str) -> Entry:
        """Forget an ended request; a second end of the same request raises."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            raise BookError(f"request {request_id!r} ended twice, or never started")
        self.num_ended += 1
        return entry

    def tier(self, request_id: str) -> Tier:
        return self.get(request_id).shadow.tier

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())
