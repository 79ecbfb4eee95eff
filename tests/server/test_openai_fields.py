"""Fields an OpenAI or vLLM client sends that tierserve cannot honour are refused with a 400
naming the field, never silently dropped; neutral values of them, and content it can take,
are served. Called with the official client, as users do."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.server.helpers import MODEL, LiveServer, live_server, make_state

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    server: LiveServer
    with live_server(make_state()) as server:
        yield openai.OpenAI(base_url=server.base_url, api_key="anything", max_retries=0)


def _chat(client: openai.OpenAI, **fields: Any) -> openai.types.chat.ChatCompletion:
    messages = fields.pop("messages", MESSAGES)
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=fields)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"65": 100}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"min_p": 0.1}, "min_p"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        # vLLM 0.32's, accepted silently before: each changes the reply or the output.
        ({"return_token_ids": True}, "return_token_ids"),
        ({"return_token_offsets": True}, "return_token_offsets"),
        ({"repetition_detection": {"min_pattern_size": 2}}, "repetition_detection"),
        ({"watermarking": True}, "watermarking"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"vllm_xargs": 5}, "vllm_xargs"),  # an object on vLLM and the gateway too
        ({"min_tokens": 4}, "min_tokens"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"truncate_prompt_tokens": 1}, "truncate_prompt_tokens"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"logits_processors": ["x"]}, "logits_processors"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        ({"documents": [{"title": "t", "text": "x"}]}, "documents"),
        ({"reasoning_effort": "none"}, "reasoning_effort"),  # was ignored: thinking stayed on
        ({"verbosity": "low"}, "verbosity"),
        ({"web_search_options": {}}, "web_search_options"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}]},
            "messages.0.content.1",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0"),
    ],
)
def test_a_chat_field_that_would_change_the_answer_is_refused(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **fields)
    assert e.value.param == param and f"- {param}: " in e.value.message, e.value.body


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"65": 100}}, "logit_bias"),
        ({"suffix": "END"}, "suffix"),
        ({"min_p": 0.5}, "min_p"),
        ({"truncate_prompt_tokens": 1}, "truncate_prompt_tokens"),
        ({"add_special_tokens": False}, "add_special_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"return_token_ids": True}, "return_token_ids"),
    ],
)
def test_a_completion_field_that_would_change_the_answer_is_refused(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=fields)
    assert e.value.param == param and param in e.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"logit_bias": {}, "top_logprobs": 0, "modalities": ["text"], "echo": False},
        {"min_p": 0.0, "repetition_penalty": 1.1, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": []},
        {"return_token_ids": False, "watermarking": None, "request_id": "mine", "vllm_xargs": {"tier": "P0"}},
        {"tool_choice": "auto", "function_call": "none", "user": "u", "metadata": {"a": "b"}, "store": False},
        {"logit_bias": None, "top_logprobs": None, "tool_choice": None, "service_tier": "auto", "foo": 1},
        {"skip_special_tokens": True, "add_generation_prompt": True, "continue_final_message": False},
        {
            "chat_template_kwargs": {},
            "documents": [],
            "logits_processors": [],
            "truncate_prompt_tokens": None,
        },
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": "hi", "name": "bob"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        },
    ],
)
def test_neutral_values_and_text_content_are_served(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    reply = _chat(client, **fields)
    assert reply.choices[0].message.content and reply.usage is not None


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "assistant", "content": None, "tool_calls": "get_weather()"}, "messages.0.tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": ["get_weather()"]}, "messages.0.tool_calls.0"),
        ({"role": "tool", "content": "sunny", "tool_call_id": 1}, "messages.0.tool_call_id"),
        # A call that is not a function's has no place in a template (vLLM refuses it too).
        ({"role": "assistant", "content": None, "tool_calls": [{"type": "custom"}]}, "messages"),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": "f"}]}, "messages"),
    ],
)
def test_a_tool_field_of_a_message_of_the_wrong_type_is_a_400_naming_it(
    client: openai.OpenAI, message: dict[str, Any], param: str
) -> None:
    """They reach the chat template now: a value of another type was dropped unread."""
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, messages=[message])
    assert e.value.param == param, e.value.body


def test_a_completion_with_an_empty_suffix_is_served(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, suffix="")
    assert reply.choices[0].text


def test_a_completion_with_neutral_vllm_prompt_options_is_served(client: openai.OpenAI) -> None:
    fields = {"add_special_tokens": True, "response_format": {"type": "text"}, "skip_special_tokens": True}
    reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=fields)
    assert reply.choices[0].text


def test_vllms_stop_token_ids_and_ignore_eos_are_honoured(client: openai.OpenAI) -> None:
    # The stand-in model answers "Hello, world! ..." a byte (a token) at a time: the comma
    # (44) ends the output there, included, as vLLM ends on a stop token that is not special.
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, extra_body={"stop_token_ids": [44], "ignore_eos": True}
    )
    assert reply.choices[0].message.content == "Hello," and reply.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match=r"stop_token_ids: token ids must be in \[0, 512\)"):
        _chat(client, stop_token_ids=[512])
