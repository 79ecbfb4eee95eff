"""A pool of open multi-turn conversations; each call hands out the next turn of one of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierserve.workloads.lengths import ConversationShape, LengthDist
from tierserve.workloads.tokens import random_ids


@dataclass(frozen=True, slots=True)
class Turn:
    conversation_id: str
    tenant: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    num_history_tokens: int  # leading prompt tokens = the previous turn's prompt + answer


@dataclass(slots=True)
class _Conversation:
    conversation_id: str
    tenant: str
    history: tuple[int, ...]  # every token so far: system prompt, user turns, (stand-in) answers
    num_turns: int = 0


class ConversationPool:
    """`shape.pool_size` conversations; a conversation that would outgrow the limit is replaced.

    The answer of a turn is not known when the next turn is made, so the history holds a
    stand-in answer of the planned length; a driver that knows the real answer swaps it in
    (the turn says how many leading tokens are history).
    """

    def __init__(
        self,
        shape: ConversationShape,
        output: LengthDist,
        rng: np.random.Generator,
        tenant_prefix: Callable[[np.random.Generator], tuple[str, tuple[int, ...]]],
    ) -> None:
        self._shape = shape
        self._output = output
        self._rng = rng
        self._tenant_prefix = tenant_prefix  # draws a tenant and returns its system prompt
        self._num_opened = 0
        self._open: list[_Conversation] = [self._new() for _ in range(shape.pool_size)]

    def _new(self) -> _Conversation:
        tenant, system_prompt = self._tenant_prefix(self._rng)
        conversation = _Conversation(f"conv-{self._num_opened}", tenant, system_prompt)
        self._num_opened += 1
        return conversation

    def next_turn(self) -> Turn:
        slot = int(self._rng.integers(len(self._open)))
        conversation = self._open[slot]
        num_user = (self._shape.user_turn if conversation.num_turns else self._shape.first_turn).sample(
            self._rng
        )
        if conversation.num_turns and len(conversation.history) + num_user > self._shape.max_prompt_tokens:
            conversation = self._open[slot] = self._new()
            num_user = self._shape.first_turn.sample(self._rng)
        num_answer = self._output.sample(self._rng)
        # The first turn's history is only the tenant's system prompt, shared by many conversations.
        num_history = len(conversation.history) if conversation.num_turns else 0
        prompt = conversation.history + random_ids(self._rng, num_user)
        conversation.history = prompt + random_ids(self._rng, num_answer)
        conversation.num_turns += 1
        return Turn(conversation.conversation_id, conversation.tenant, prompt, num_answer, num_history)
