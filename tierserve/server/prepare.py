"""From a validated body to what the engine needs: prompt token ids and sampling parameters.

Every check that depends on the model or the tier happens here, before anything is
reserved, and fails with a 4xx naming the field: unknown model, unsupported options, a
prompt or `max_tokens` beyond the context, or beyond the KV blocks the tier may hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tierserve.request import SamplingParams
from tierserve.server.errors import ApiError, bad_request, quoted
from tierserve.server.protocol import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from tierserve.server.refusals import queue_closed
from tierserve.server.state import ServerState
from tierserve.tiers import Tier

OPENAI_DEFAULT_TEMPERATURE = 1.0
T = TypeVar("T")

# Fields tierserve does not implement and whose effect a client would see (its output, or
# what comes back with it): refused with a 400 naming the field unless absent or at one of
# these neutral values, never dropped. OpenAI's fields first, then vLLM's extensions.
UNSUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    "logit_bias": (None, {}),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "modalities": (None, [], ["text"]),
    "audio": (None,),
    "echo": (None, False),  # chat: vLLM's; completions: declared, refused the same way
    "best_of": (None, 1),  # chat: vLLM's; completions: declared
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "include_stop_str_in_output": (None, False),
    "use_beam_search": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True),  # tierserve's text never shows special tokens
    "logits_processors": (None, []),
    # vLLM 0.32's: what they add to a reply (token ids, offsets, the prompt's text), change
    # the output (repetition detection, watermarking, a thinking budget, prompt embeddings)
    # or ask for a KV hand-off between engines.
    "return_token_ids": (None, False),
    "return_token_offsets": (None, False),
    "return_prompt_text": (None, False),
    "return_mm_kwargs": (None, False),
    "logprob_token_ids": (None, []),
    "repetition_detection": (None,),
    "watermarking": (None, False),
    "thinking_token_budget": (None,),
    "prompt_embeds": (None,),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
}
# vLLM's extensions of one endpoint only, refused the same way: what shapes a chat's prompt
# (its template and what goes into it), and on completions the prompt's special tokens and
# vLLM's structured output (`response_format` there; chat's is checked in `_check_options`).
CHAT_UNSUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "documents": (None, []),
    # OpenAI's, for reasoning models; vLLM gives the first to the chat template (Qwen3's
    # thinking is off at "none"). Accepted and ignored, a client turning thinking off still
    # got it: `chat_template_kwargs` ({"enable_thinking": false}) says it here.
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "add_special_tokens": (None, False),  # vLLM's chat default: the template writes them
}
COMPLETION_UNSUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    "add_special_tokens": (None, True),
    "response_format": (None, {}, {"type": "text"}),
}
# vLLM's request fields that change nothing here, accepted and not read (the rest of vLLM's
# fields are honoured, or refused above unless neutral): tests/integrations/vllm checks that
# every field of the installed vLLM's requests is in one of these places.
IGNORED_VLLM_FIELDS: dict[str, str] = {
    "request_id": "the reply's id is the server's own",
    "session_id": "no sessions",
    "length_penalty": "beam search only, which is refused",
    "truncation_side": "with truncate_prompt_tokens only, which is refused",
    "return_tokens_as_token_ids": "logprobs only, which are refused",
    "spaces_between_special_tokens": "special tokens are never in the text",
    "stream_interval": "tokens are sent as they come",
    "include_reasoning": "no reasoning parser: the text is all the model's",
    "parallel_tool_calls": "no tool calls are made",
    "media_io_kwargs": "no media input (such content parts are refused)",
    "mm_processor_kwargs": "no media input",
    "mm_payload": "no media input",
    "routed_experts_prompt_start": "an expert-routing readout it is not asked for",
}
# `tool_choice` / `function_call` values that ask for no call (or leave it to the model, which
# makes none here); anything else demands a call this server cannot make.
_NO_CALL = (None, "none", "auto")


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's extension)


def check_model(state: ServerState, model: str) -> None:
    if model != state.model.name:
        raise ApiError(
            404,
            f"The model {quoted(model)} does not exist (this server serves '{state.model.name}').",
            param="model",
            code="model_not_found",
        )


def _sent(body: ChatCompletionRequest | CompletionRequest, field: str) -> object:
    """A field's value as sent: declared ones from the model, the others from its extras."""
    if field in type(body).model_fields:
        return getattr(body, field)
    return (body.model_extra or {}).get(field)


def _check_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    own = (
        CHAT_UNSUPPORTED_FIELDS if isinstance(body, ChatCompletionRequest) else COMPLETION_UNSUPPORTED_FIELDS
    )
    for field, neutral in (UNSUPPORTED_FIELDS | own).items():
        value = _sent(body, field)
        if not _is_neutral(value, neutral):
            raise bad_request(f"{field}: not supported by this server (got {quoted(value)})", field)


def _is_neutral(value: object, neutral: tuple[object, ...]) -> bool:
    """`value` is one of `neutral`, of the same type (True == 1, yet `best_of: true` is not
    one candidate), or a float equal to one (1.0 for 1)."""
    if isinstance(value, float):
        return value in neutral
    return any(value == n and type(value) is type(n) for n in neutral)


def _check_options(body: ChatCompletionRequest | CompletionRequest) -> None:
    if (body.n or 1) > 1:
        raise bad_request("n: only n=1 is supported", "n")
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs:
            raise bad_request("logprobs: not supported", "logprobs")
        # Tools the model may not call (`tool_choice: "none"`) go to the chat template, as vLLM
        # gives them: the model sees them as it would there.
        if body.tools and body.tool_choice != "none":
            raise bad_request("tools: function calling is not supported", "tools")
        if body.functions:
            raise bad_request("functions: function calling is not supported", "functions")
        for field in ("tool_choice", "function_call"):
            choice = _sent(body, field)
            if choice not in _NO_CALL:
                raise bad_request(f"{field}: function calling is not supported (got {quoted(choice)})", field)
        _check_content(body)
        kind = (body.response_format or {}).get("type", "text")
        if kind != "text":
            raise bad_request(
                f"response_format: only type 'text' is supported, got {kind!r}", "response_format"
            )
    else:
        if body.echo:
            raise bad_request("echo: not supported", "echo")
        if body.logprobs is not None:
            raise bad_request("logprobs: not supported", "logprobs")
        if (body.best_of or 1) > 1:
            raise bad_request("best_of: only best_of=1 is supported", "best_of")
    _check_unsupported(body)
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    stops = body.stop_strings()
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters", "stop")


def _check_content(body: ChatCompletionRequest) -> None:
    """Every content part must be one this server takes: text (or an assistant's refusal)."""
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str) or message.content is None:
            continue
        for j, part in enumerate(message.content):
            if part.served_text() is not None:
                continue
            where = f"messages.{i}.content.{j}"
            if part.type in ("text", "refusal"):
                raise bad_request(f"{where}: a part of type {part.type!r} needs its {part.type!r}", where)
            raise bad_request(
                f"{where}: content of type {quoted(part.type)} is not supported (text only here)",
                where,
            )


def _prompt_ids(
    state: ServerState, body: ChatCompletionRequest | CompletionRequest
) -> list[int] | np.ndarray:
    tok = state.tokenizer
    if isinstance(body, ChatCompletionRequest):
        messages = [_template_message(m) for m in body.messages]
        template_kwargs = _sent(body, "chat_template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise bad_request(
                f"chat_template_kwargs: expected an object, got {quoted(template_kwargs)}",
                "chat_template_kwargs",
            )
        try:
            if body.tools is not None:
                return list(tok.apply_chat_template(messages, template_kwargs or None, tools=body.tools))
            if not template_kwargs:  # as a tokenizer without template variables is called
                return list(tok.apply_chat_template(messages))
            return list(tok.apply_chat_template(messages, template_kwargs))
        except ValueError as e:
            if str(e).startswith("chat_template_kwargs:"):
                raise bad_request(str(e), "chat_template_kwargs") from None
            raise bad_request(f"messages: {e}", "messages") from None
    prompt: Any = body.prompt
    if isinstance(prompt, str):
        return _encoded(state, prompt)
    if isinstance(prompt, np.ndarray):  # token ids of a large body (body_parser.py)
        return _checked_ids(state, prompt)
    if len(prompt) == 0:
        raise bad_request("prompt: must not be empty", "prompt")
    first = prompt[0]
    if isinstance(first, (str, list, np.ndarray)):
        if len(prompt) != 1:
            raise bad_request("prompt: only one prompt per request is supported", "prompt")
        if isinstance(first, str):
            return _encoded(state, first)
        return _checked_ids(state, first)
    return _checked_ids(state, prompt)  # ints: the body's validation made them so


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as vLLM gives it to the chat template: its text, its `name`, an assistant's
    `tool_calls` and a tool's `tool_call_id` (where sent)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.role == "assistant" and message.tool_calls:  # an empty list: a plain reply
        out["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if message.role == "tool" and message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier tool call as templates take it: its `function.arguments` an
    object, not OpenAI's JSON string (templates write `arguments | tojson`: the string was
    written quoted, escapes and all). Arguments that are not a JSON object are an empty one,
    as vLLM makes them (the call is in the conversation's history: refusing it would refuse
    every later turn too)."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request("messages: an assistant's tool_calls must be of type 'function'", "messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            arguments = {}
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _encoded(state: ServerState, text: str) -> list[int]:
    try:
        return state.tokenizer.encode(text)
    except ValueError as e:  # a token the model cannot take (tokenizer.py)
        raise bad_request(f"prompt: {e}", "prompt") from None


def _checked_ids(state: ServerState, ids: Any) -> list[int] | np.ndarray:
    """The ids, checked against the vocabulary; an array stays one (a list of a large
    prompt is made only once it passes every check, in `prepare`)."""
    vocab = state.model.vocab_size
    if isinstance(ids, np.ndarray):
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise bad_request(f"prompt: token ids must be in [0, {vocab})", "prompt")
        return ids
    checked: list[int] = list(ids)
    if checked and (min(checked) < 0 or max(checked) >= vocab):
        raise bad_request(f"prompt: token ids must be in [0, {vocab})", "prompt")
    return checked


def _max_tokens(
    state: ServerState,
    body: ChatCompletionRequest | CompletionRequest,
    tier: Tier,
    num_prompt: int,
    prompt_param: str,
) -> int:
    """The prompt and its output against the model's context and the tier's KV ceiling:
    the output's length (the server's default where the body names none), or the 400."""
    tier_tokens = state.ceiling_blocks[tier] * state.block_size
    if tier_tokens == 0:  # a ceiling of 0 turned it off: no prompt is too long, the tier is closed
        raise ApiError(
            400,
            f"Tier {tier.name} is not served here: it may hold no block of the KV cache "
            f"(tiers.{tier.name}.ceiling).",
            code="tier_closed",
        )
    if state.config.limits.queue_caps[tier] == 0:
        raise queue_closed(tier)
    context = state.model.max_model_len
    if num_prompt >= context:
        raise ApiError(
            400,
            f"{prompt_param}: the prompt is {num_prompt} tokens; the model's context is {context}"
            f"{state.model.context_note} (room is needed for at least one output token)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if num_prompt >= tier_tokens:
        raise ApiError(
            400,
            f"{prompt_param}: the prompt is {num_prompt} tokens; tier {tier.name} may hold at most "
            f"{tier_tokens} tokens of KV cache",
            param=prompt_param,
            code="context_length_exceeded",  # the tier's share of the cache is its context
        )
    max_tokens, field = body.requested_max_tokens()
    if max_tokens is None:
        max_tokens = min(
            state.config.server.default_max_tokens, context - num_prompt, tier_tokens - num_prompt
        )
    elif num_prompt + max_tokens > context:
        raise ApiError(
            400,
            f"{field}: {max_tokens} + the prompt's {num_prompt} tokens exceeds the model's context "
            f"of {context} tokens{state.model.context_note}",
            param=field,
            code="context_length_exceeded",
        )
    elif num_prompt + max_tokens > tier_tokens:
        raise ApiError(
            400,
            f"{field}: {max_tokens} + the prompt's {num_prompt} tokens exceeds the "
            f"{tier_tokens} tokens of KV cache tier {tier.name} may hold",
            param=field,
            code="context_length_exceeded",  # as for the prompt: the tier's share is its context
        )
    return max_tokens


def _given(asked: T | None, model_default: T | None, default: T) -> T:
    """The request's value, else the model's default, else the API's."""
    return asked if asked is not None else model_default if model_default is not None else default


def _check_num_messages(body: ChatCompletionRequest, max_messages: int) -> None:
    """A cap on a chat's messages, checked before the chat template renders them: the
    template's work grows with each message, and an attack trial's bodies of 1,550 short
    messages (63 KB, under the size that is parsed off the event loop) each held the event
    loop for 25-36 ms before their 400."""
    if len(body.messages) > max_messages:
        raise bad_request(
            f"messages: at most {max_messages} messages per request (server.max_chat_messages), "
            f"got {len(body.messages)}",
            "messages",
        )


def prepare(state: ServerState, body: ChatCompletionRequest | CompletionRequest, tier: Tier) -> Prepared:
    if isinstance(body, ChatCompletionRequest):
        _check_num_messages(body, state.config.server.max_chat_messages)
    _check_options(body)
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    ids = _prompt_ids(state, body)
    if len(ids) == 0:
        raise bad_request(f"{prompt_param}: the prompt is empty", prompt_param)
    max_tokens = _max_tokens(state, body, tier, len(ids), prompt_param)
    model = state.model.sampling_defaults  # generation_config.json's, where the request gives none
    temperature = _given(body.temperature, model.temperature, OPENAI_DEFAULT_TEMPERATURE)
    stop_ids = tuple(body.stop_token_ids or ())
    vocab = state.model.vocab_size
    if stop_ids and (min(stop_ids) < 0 or max(stop_ids) >= vocab):
        raise bad_request(f"stop_token_ids: token ids must be in [0, {vocab})", "stop_token_ids")
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=_given(body.top_p, model.top_p, 1.0),
            top_k=max(_given(body.top_k, model.top_k, 0), 0),
            repetition_penalty=_given(body.repetition_penalty, model.repetition_penalty, 1.0),
            seed=None if body.seed == -1 else body.seed,  # vLLM's "no seed"
            presence_penalty=_given(body.presence_penalty, model.presence_penalty, 0.0),
            frequency_penalty=_given(body.frequency_penalty, model.frequency_penalty, 0.0),
            stop_token_ids=stop_ids,
            ignore_eos=bool(body.ignore_eos),
        )
    except ValueError as e:
        raise bad_request(str(e), None) from None
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    return Prepared(
        ids,
        sampling,
        tuple(s for s in body.stop_strings() if s),
        bool(body.stream),
        include_usage,
        # As vLLM: continuous_usage_stats counts only with include_usage.
        continuous_usage=include_usage and bool(options and options.continuous_usage_stats),
    )
