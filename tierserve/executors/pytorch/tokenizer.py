"""Tokenizers: a byte-level one for the demo model, a wrapper over `tokenizers` for real ones."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

Message = Mapping[str, Any]  # "role" and "content" (text); "name", "tool_calls", ... where sent
Tools = Sequence[Mapping[str, Any]]


class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS first where the model uses one."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens skipped."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
    ) -> list[int]:
        """Token ids of a chat, ending where the assistant's reply should start.
        `template_kwargs`: extra variables for the chat template (vLLM's and transformers'
        `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); a ValueError where the model
        has no template to give them to, or one names a variable the template is given anyway.
        `tools`: the request's, for the template (none without one: the plain format has no
        place for them)."""
        ...


# The variables every chat template gets; `template_kwargs` may not set them.
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def no_template_for(template_kwargs: Mapping[str, Any] | None) -> None:
    """Raise ValueError for template variables given to a model without a chat template: they
    would be dropped, and the prompt would not be the one asked for."""
    if template_kwargs:
        names = ", ".join(sorted(template_kwargs))
        raise ValueError(f"chat_template_kwargs: this model has no chat template to give {names} to")


def plain_chat_text(messages: Sequence[Message]) -> str:
    """Fallback chat format for models without a template: one `role: content` line each."""
    lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
    return "\n".join([*lines, "assistant:"])


class ByteTokenizer:
    """The demo model's tokenizer: ids 0-255 are bytes, 256 is BOS, 257 EOS, 258 PAD.

    The demo model's weights are random, so the text it produces is gibberish by design;
    its vocabulary is these 259 ids, and an id above 258 (from another model's config)
    decodes to nothing.
    """

    BOS = 256
    EOS = 257
    PAD = 258

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
    ) -> list[int]:
        no_template_for(template_kwargs)
        return self.encode(plain_chat_text(messages))


class HFTokenizer:
    """A `tokenizers.Tokenizer` (tokenizer.json) plus the chat template of tokenizer_config.json."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        vocab_limit: int | None = None,
    ):
        self._tok = tokenizer
        self._eos = tuple(eos_token_ids)
        self._vocab_limit = vocab_limit  # set where the tokenizer has ids the model has not
        self._template_source = chat_template or None
        self._template = self._compile()
        self.bos_token = bos_token
        self.eos_token = eos_token

    def _compile(self) -> Any:
        if not self._template_source:
            return None
        return _template_environment().from_string(self._template_source)

    # The engine process hands its tokenizer to the server's: a compiled template does not
    # pickle (its code is generated), so its source travels and is compiled again.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._template = self._compile()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # `encode_batch` gives the same ids and lets go of the GIL while it works; `encode` holds
        # it, and a long prompt (a 1 MiB body: 0.5 s) froze every stream of the server meanwhile,
        # though large bodies are prepared on a thread of their own (server/body_gate.py).
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        ids = list(encoding.ids)
        limit = self._vocab_limit
        if limit is not None and ids and (top := max(ids)) >= limit:
            raise ValueError(
                f"the text holds the token {self._tok.id_to_token(top)!r} (id {top}), past the model's "
                f"vocabulary of {limit}: the checkpoint's tokenizer has tokens its model has no embedding for"
            )
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
    ) -> list[int]:
        if self._template is None:
            no_template_for(template_kwargs)
            return self.encode(plain_chat_text(messages))
        extra = dict(template_kwargs or {})
        if taken := sorted(TEMPLATE_VARIABLES & extra.keys()):
            hint = " (tools come from the request's `tools`)" if "tools" in taken else ""
            raise ValueError(
                f"chat_template_kwargs: {', '.join(taken)}: set by the server, not by a request{hint}"
            )
        try:
            # `tools` is None without any, as transformers gives it (a template may test
            # `tools is not none`, which an undefined variable passes).
            text = self._template.render(
                **extra,
                messages=[dict(m) for m in messages],
                tools=None if tools is None else [dict(t) for t in tools],
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ValueError:
            raise  # raise_exception's, already "chat template: ..."
        except Exception as e:  # the template failed on these messages: the caller's to fix
            raise ValueError(f"chat template: {type(e).__name__}: {e}") from None
        # The template writes BOS itself where the model wants one.
        return self.encode(text, add_special_tokens=False)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as transformers' templates get it: not HTML-escaped (Jinja's own `tojson` writes
    `<` as `\\u003c`), non-ASCII kept, with json.dumps's options."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_environment() -> Any:
    """A sandboxed Jinja environment that compiles what transformers' `apply_chat_template`
    compiles: `{% break %}` / `{% continue %}`, the `{% generation %}` block (it marks the
    assistant's tokens for training; here it renders its body), `raise_exception`,
    `strftime_now` and transformers' `tojson`."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.parser import Parser
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        tags = {"generation"}  # noqa: RUF012 (Jinja reads it from the class)

        def parse(self, parser: Parser) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationBlock]
    )
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env
