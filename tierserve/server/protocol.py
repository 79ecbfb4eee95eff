"""Request bodies of the OpenAI-compatible API (pydantic), as much of them as tierserve serves.

Fields that change nothing here (`user`, `parallel_tool_calls`, ...) are accepted and
ignored; tools the model may not call, and a message's `name`, `tool_calls` and
`tool_call_id`, go to the chat template as vLLM gives them; fields tierserve cannot honour
(`n` > 1, `logprobs`, `echo`, callable `tools`, a `response_format` other than text,
`logit_bias`, vLLM's sampling extensions such as `min_p`, content parts other than text) are
rejected with a 400 by the handler (prepare.py) rather than silently dropped. The two
request bodies keep the fields they do not declare (`model_extra`) so that the handler can
tell which were sent; a gateway forwards such a body as it came. Numbers are bounded so that
no value can reach the engine unchecked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
UINT64_MAX = 2**64 - 1
MAX_TOKENS_BOUND = 2**31 - 1
INT64_MIN = -(2**63)
MAX_CACHE_SALT_CHARS = 1024  # vLLM's field bound (vLLM 0.32 then checks 128, for external KV stores)


# A field of several forms (a prompt: a string, strings, token ids, lists of token ids) is
# validated as the one form its value has, by its first element, and a list stops at its
# first bad element. Validated as every form, an invalid 60 KB prompt collected an error for
# each element of each and held the event loop 120 ms (2.6 s for 1 MB, in the body parser),
# before any rate limit saw it; and the first form's error named the wrong element. The tags
# are type names, which 400s leave out of `param` (errors.py).
FAST = Field(fail_fast=True)


def _prompt_form(value: Any) -> str | None:
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    if isinstance(first, str):
        return "list[str]"
    return "list[list[int]]" if isinstance(first, list) else "list[int]"


def _by_form(form: Callable[[Any], str | None], takes: str) -> Discriminator:
    """Validate a union as the member `form` names for the value (its tag); any other value
    is refused with "Input should be `takes`"."""
    return Discriminator(
        form, custom_error_type="union_type", custom_error_message=f"Input should be {takes}"
    )


def _str_or_list(list_tag: str, takes: str) -> Discriminator:
    """A string (tag "str"), or a list (tag `list_tag`)."""

    def form(value: Any) -> str | None:
        return "str" if isinstance(value, str) else list_tag if isinstance(value, list) else None

    return _by_form(form, takes)


Prompt = Annotated[
    Annotated[list[int], Tag("list[int]"), FAST]
    | Annotated[str, Tag("str")]
    | Annotated[list[str], Tag("list[str]"), FAST]
    | Annotated[list[Annotated[list[int], FAST]], Tag("list[list[int]]"), FAST],
    _by_form(
        _prompt_form,
        "a string, an array of strings, an array of integers (token ids), or an array of arrays of "
        "integers (token ids)",
    ),
]
Stop = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[str], Tag("list[str]"), FAST],
    _str_or_list("list[str]", "a string or an array of strings"),
]


class _Body(BaseModel):
    # Strict: "5" is not a number nor "yes" a boolean, nor true a token id (OpenAI refuses them).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class ContentPart(_Body):
    """One part of a message's content. Text (and an assistant's `refusal`) is served; the
    other kinds (`image_url`, `input_audio`, `file`, ...) parse too, so that the 400 can name
    the part (prepare.py) and a gateway can forward them to a replica that takes them."""

    type: str = Field(min_length=1, max_length=64)
    text: str | None = None
    refusal: str | None = None

    def served_text(self) -> str | None:
        """The part's text, or None where this server cannot take the part."""
        if self.type == "text":
            return self.text
        if self.type == "refusal":
            return self.refusal
        return None


Content = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[ContentPart], Tag("list[ContentPart]"), FAST],
    _str_or_list("list[ContentPart]", "a string or an array of content parts"),
]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    # For the chat template only (an assistant's earlier calls, the call a tool answers).
    tool_calls: list[dict[str, Any]] | None = Field(None, fail_fast=True)
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message's text, its parts one a line as vLLM joins them; a part this server
        cannot take counts as none (prepare.py refuses such a message before this is used)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.served_text() or "" for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class _SamplingBody(_Body):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    # OpenAI's newer name (chat only there): honoured on completions too, not dropped.
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # -1: no seed, as vLLM reads it (clients send it for "random"); another negative one is
    # a seed as any other.
    seed: int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    stop: Stop | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS_BOUND, description="vLLM's extension: 0 or -1 = off")
    repetition_penalty: float | None = Field(None, gt=0.0, description="vLLM's extension: 1 = off")
    # Not read here (the vLLM plug-in's tier and tenant), but an object as on vLLM and the gateway.
    vllm_xargs: dict[str, Any] | None = None
    priority: int | None = Field(None, ge=0, le=3, description="tierserve: 0 (realtime) .. 3 (background)")
    user: str | None = None
    # vLLM's: requests share cached prompt blocks only with requests of the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's sampling extensions that tierserve's engine honours.
    ignore_eos: bool | None = Field(None, description="vLLM's extension: generate past EOS up to max_tokens")
    stop_token_ids: list[int] | None = Field(
        None,
        max_length=MAX_STOP_TOKEN_IDS,
        fail_fast=True,
        description="vLLM's extension: token ids that end the output",
    )

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output limit the client set, and the field it came from (for error messages):
        max_completion_tokens where both are sent, as OpenAI reads them."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class _RequestBody(_SamplingBody):
    # Undeclared fields are kept (not validated) so that prepare.py can refuse those it
    # cannot honour; the nested objects still ignore theirs.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    prompt_field: ClassVar[str]  # the field that holds the prompt

    def reserved_output(self, max_tokens: int) -> tuple[int, str]:
        """For a token-bucket reservation of `max_tokens` output tokens: how many of them are
        the server's default rather than the client's (the share a bucket may cut to fit
        it, `RateLimiter.acquire`), and the field to lower where the request never fits:
        the client's max_tokens, or without one the prompt."""
        requested, field = self.requested_max_tokens()
        if requested is not None:
            return 0, field
        return max_tokens, self.prompt_field


class ChatCompletionRequest(_RequestBody):
    prompt_field = "messages"
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    logprobs: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_RequestBody):
    prompt_field = "prompt"
    prompt: Prompt
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None
