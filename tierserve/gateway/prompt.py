"""What the gateway reads from a prompt without tokenizing it: a token estimate and a prefix.

The estimate (about four characters a token) only sizes the up-front reservation on the
token buckets; the upstream's reported usage settles it. The prefix (the first
characters of the conversation, system prompt first) keys prefix affinity, with the
request's `cache_salt`: requests of different salts share no cached block on a replica.
"""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # a part's "text" may be null (the upstream refuses it; reading it must not fail)
        return "".join(t for p in value if isinstance(p, dict) and isinstance(t := p.get("text"), str))
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        return "\n".join(
            f"{m.get('role', '')}:{_text(m.get('content'))}" for m in messages if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return "\n".join(p for p in prompt if isinstance(p, str))
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt[:4096])
    return ""


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return sum(len(p) for p in prompt if isinstance(p, list))
    return max(1, -(-len(prompt_text(body)) // CHARS_PER_TOKEN))


def prefix_key(body: dict[str, Any], num_chars: int) -> str:
    salt = body.get("cache_salt")
    salted = f"{salt}\0" if isinstance(salt, str) else ""
    return f"{body.get('model', '')}\0{salted}{prompt_text(body)[:num_chars]}"
