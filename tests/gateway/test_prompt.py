"""What the gateway reads from a body without tokenizing it."""

from __future__ import annotations

from tierserve.gateway.config import UPSTREAM_KINDS
from tierserve.gateway.priority import pass_down
from tierserve.gateway.prompt import prefix_key
from tierserve.tiers import Tier

BODY = {"model": "m", "messages": [{"role": "user", "content": "a long shared system prompt"}]}


def test_the_affinity_key_holds_the_cache_salt() -> None:
    """Requests of different salts share no cached block on a replica: one home for all of
    them gained no hit."""
    salted = {**BODY, "cache_salt": "s1"}
    assert prefix_key(salted, 512) == prefix_key({**BODY, "cache_salt": "s1"}, 512)
    assert prefix_key(salted, 512) != prefix_key({**BODY, "cache_salt": "s2"}, 512)
    assert prefix_key(salted, 512) != prefix_key(BODY, 512)
    assert prefix_key(BODY, 512) == "m\0user:a long shared system prompt"  # unsalted: as before


def test_every_kind_of_upstream_gets_the_cache_salt_as_sent() -> None:
    for kind in UPSTREAM_KINDS:
        assert pass_down(kind, {**BODY, "cache_salt": "s1"}, Tier.P1, "acme").body["cache_salt"] == "s1"
