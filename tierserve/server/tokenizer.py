"""The tokenizer interface the server needs, and the placeholder tokenizer of the sim backend.

The torch executor's tokenizers (byte-level for the demo model, `tokenizers` for real
ones) satisfy `Tokenizer` structurally. The simulated backend produces placeholder
token ids, so its tokenizer only has to count prompt tokens realistically (about four
bytes of English per token, as Llama-3's tokenizer does) and render ids as words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from tierserve.executors.pytorch.tokenizer import Message, Tools, no_template_for


class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
    ) -> list[int]:
        """`template_kwargs`: extra variables for the chat template (vLLM's and transformers'
        `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); a ValueError where the model
        has no template to give them to. `tools`: the request's, for the template."""
        ...


_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "elit", "sed", "do", "tempor", "ut")


class PlaceholderTokenizer:
    """About one token per four UTF-8 bytes; every id decodes to a filler word."""

    BYTES_PER_TOKEN = 4

    def __init__(self, vocab_size: int = 128000) -> None:
        self._vocab_size = vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        data += b"\0" * (-len(data) % self.BYTES_PER_TOKEN)
        words = np.frombuffer(data, dtype="<u4")  # little-endian words: ids do not depend on the host
        ids: list[int] = (words % self._vocab_size).tolist()
        return [1, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(" " + _WORDS[t % len(_WORDS)] for t in token_ids)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
    ) -> list[int]:
        no_template_for(template_kwargs)
        lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
        return self.encode("\n".join([*lines, "assistant:"]))
