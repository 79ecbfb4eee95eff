"""Every field of the installed vLLM's OpenAI requests has a place in tierserve's server:
honoured (a field of its request models, or `chat_template_kwargs`, read from the extras),
refused unless neutral, or ignored with a reason. vLLM 0.32 added fields (`return_token_ids`,
`repetition_detection`, `watermarking`, ...) that the server accepted silently, though each
changes the reply or the output; a field the next release adds fails here until it is placed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletion

from tierserve.server import prepare
from tierserve.server.protocol import ChatCompletionRequest, CompletionRequest

READ_FROM_EXTRAS = {"chat_template_kwargs"}


@pytest.mark.parametrize(
    ("vllm_model", "ours", "own_refused"),
    [
        (VllmChat, ChatCompletionRequest, prepare.CHAT_UNSUPPORTED_FIELDS),
        (VllmCompletion, CompletionRequest, prepare.COMPLETION_UNSUPPORTED_FIELDS),
    ],
    ids=["chat", "completions"],
)
def test_every_vllm_request_field_is_honoured_refused_or_ignored_with_a_reason(
    vllm_model: type, ours: type, own_refused: dict[str, tuple[object, ...]]
) -> None:
    placed = (
        set(ours.model_fields)  # type: ignore[attr-defined]
        | READ_FROM_EXTRAS
        | set(prepare.UNSUPPORTED_FIELDS)
        | set(own_refused)
        | set(prepare.IGNORED_VLLM_FIELDS)
    )
    assert sorted(set(vllm_model.model_fields) - placed) == []  # type: ignore[attr-defined]
