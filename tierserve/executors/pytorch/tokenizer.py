"""Tokenizers: a byte-level one for the demo model, a wrapper over `tokenizers` for real ones."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

Message = Mapping[str, str]


class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS first where the model uses one."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens skipped."""
        ...

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of a chat, ending where the assistant's reply should start."""
        ...


def plain_chat_text(messages: Sequence[Message]) -> str:
    """Fallback chat format for models without a template: one `role: content` line each."""
    lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
    return "\n".join([*lines, "assistant:"])


class ByteTokenizer:
    """The demo model's tokenizer: ids 0-255 are bytes, 256 is BOS, 257 EOS, 258 PAD.

    The demo model's weights are random, so the text it produces is gibberish by design;
    ids above 258 (it has 512) decode to nothing.
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

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
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
    ):
        self._tok = tokenizer
        self._eos = tuple(eos_token_ids)
        self._template = None
        self.bos_token = bos_token
        self.eos_token = eos_token
        if chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(chat_template)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        if self._template is None:
            return self.encode(plain_chat_text(messages))
        text = self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        # The template writes BOS itself where the model wants one.
        return self.encode(text, add_special_tokens=False)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")
