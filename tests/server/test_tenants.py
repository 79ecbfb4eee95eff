from __future__ import annotations

import pytest

from tierserve.config import ConfigError
from tierserve.server.config import parse_serve_config
from tierserve.server.errors import ApiError
from tierserve.server.tenants import TenantResolver, decide_tier, parse_declared_tier
from tierserve.tiers import Tier

KEYED = {
    "server": {"tenant_header": True},
    "tenants": {
        "gold": {"api_keys": ["sk-gold"], "max_tier": "P0"},
        "silver": {"api_keys": ["sk-silver"], "max_tier": "P2", "default_tier": "P3"},
        "internal": {"max_tier": "P1"},
    },
}


def test_api_key_selects_its_tenant() -> None:
    resolver = TenantResolver(parse_serve_config(KEYED))
    assert resolver.resolve("Bearer sk-gold", None).name == "gold"
    assert resolver.resolve("bearer sk-silver", "internal").name == "silver"  # the key wins


@pytest.mark.parametrize("auth", ["Bearer sk-nope", None, "", "Basic sk-gold"])
def test_unknown_or_missing_key_is_401_when_keys_are_configured(auth: str | None) -> None:
    resolver = TenantResolver(parse_serve_config(KEYED))
    with pytest.raises(ApiError) as e:
        resolver.resolve(auth, None)
    assert e.value.status == 401


def test_tenant_header_names_a_tenant_only_where_allowed() -> None:
    allowed = TenantResolver(parse_serve_config(KEYED))
    assert allowed.resolve(None, "internal").name == "internal"
    with pytest.raises(ApiError) as e:
        allowed.resolve(None, "stranger")
    assert e.value.status == 401
    strict = TenantResolver(parse_serve_config({**KEYED, "server": {"tenant_header": False}}))
    with pytest.raises(ApiError) as e:
        strict.resolve(None, "internal")
    assert e.value.status == 401


def test_open_server_accepts_any_key_and_labels_tenants_by_header() -> None:
    resolver = TenantResolver(parse_serve_config({}))
    assert not resolver.requires_key
    assert resolver.resolve("Bearer whatever", None).name == "default"
    tenant = resolver.resolve(None, "team-a")
    assert tenant.name == "team-a" and tenant.max_tier is Tier.P0


def test_each_tenant_salts_the_prefix_cache_apart_unless_the_server_shares_it() -> None:
    server = {"allow_anonymous": True, "default_tenant": "gold"}
    resolver = TenantResolver(parse_serve_config({**KEYED, "server": server}))
    gold, silver = resolver.resolve("Bearer sk-gold", None), resolver.resolve("Bearer sk-silver", None)
    anonymous = resolver.resolve(None, None)
    assert anonymous.name == "gold"  # by name; yet no key shows it is gold's
    salts = [
        resolver.cache_salt(t, s) for t in (gold, silver, anonymous) for s in (None, "x", '["gold", null]')
    ]
    assert len(set(salts)) == len(salts)
    assert resolver.cache_salt(anonymous, None) is None  # keyed as the engine keys any prompt
    shared = TenantResolver(
        parse_serve_config({**KEYED, "server": {**server, "share_prefix_cache_across_tenants": True}})
    )
    assert {shared.cache_salt(t, None) for t in (gold, silver, anonymous)} == {None}
    assert len({shared.cache_salt(t, "x") for t in (gold, silver, anonymous)}) == 1
    assert shared.cache_salt(gold, "x") != shared.cache_salt(gold, "y")
    # An open server's tenants are labels anyone may send: apart, they would hide nothing.
    open_server = TenantResolver(parse_serve_config({}))
    ad_hoc = [open_server.resolve(None, name) for name in ("team-a", "team-b")]
    assert [t.name for t in ad_hoc] == ["team-a", "team-b"]
    assert {open_server.cache_salt(t, None) for t in ad_hoc} == {None}
    assert len({open_server.cache_salt(t, "x") for t in ad_hoc}) == 1


def test_declared_tenants_without_keys_are_refused_unless_anonymous_is_allowed() -> None:
    with pytest.raises(ConfigError, match="allow_anonymous"):
        parse_serve_config({"tenants": {"a": {"max_tier": "P2"}}})
    parse_serve_config({"server": {"allow_anonymous": True}, "tenants": {"a": {"max_tier": "P2"}}})


def test_anonymous_requests_run_as_the_default_tenant_at_its_default_tier_at_most() -> None:
    config = parse_serve_config(
        {"server": {"allow_anonymous": True}, "tenants": {"a": {"max_tier": "P0", "default_tier": "P0"}}}
    )
    resolver = TenantResolver(config)
    for header in (None, "a", "b"):  # x-tenant-id cannot pick a declared tenant without its key
        tenant = resolver.resolve(None, header)
        assert tenant.name == "default"
        assert decide_tier(tenant, Tier.P0).effective is Tier.P3
    assert decide_tier(resolver.resolve(None, None), None).effective is Tier.P3


def test_anonymous_requests_beside_keys_get_the_declared_default_tenant_capped_at_its_default_tier() -> None:
    config = parse_serve_config(
        {
            "server": {"allow_anonymous": True, "default_tenant": "public"},
            "tenants": {
                "public": {"max_tier": "P0", "default_tier": "P2"},
                "gold": {"api_keys": ["sk-gold"], "max_tier": "P0"},
            },
        }
    )
    resolver = TenantResolver(config)
    assert resolver.resolve("Bearer sk-gold", None).name == "gold"
    with pytest.raises(ApiError) as e:  # a wrong key is not anonymous
        resolver.resolve("Bearer sk-nope", None)
    assert e.value.status == 401
    anonymous = resolver.resolve(None, "gold")
    assert anonymous.name == "public"
    assert decide_tier(anonymous, Tier.P0).effective is Tier.P2
    assert decide_tier(anonymous, Tier.P3).effective is Tier.P3  # lowering stays allowed


def test_a_tenant_without_max_tier_gets_the_lowest_tier() -> None:
    config = parse_serve_config({"tenants": {"a": {"api_keys": ["k"]}}})
    tenant = TenantResolver(config).resolve("Bearer k", None)
    assert tenant.max_tier is Tier.P3
    assert decide_tier(tenant, Tier.P0).effective is Tier.P3


def test_tenant_header_must_be_printable_and_short() -> None:
    resolver = TenantResolver(parse_serve_config({}))
    for bad in ("", "x" * 65, "a\x00b"):
        with pytest.raises(ApiError) as e:
            resolver.resolve(None, bad)
        assert e.value.status == 400 and e.value.param == "x-tenant-id"


@pytest.mark.parametrize(
    ("header", "priority", "expected"),
    [
        ("realtime", None, Tier.P0),
        ("P2", 0, Tier.P2),
        ("background", None, Tier.P3),
        (None, 1, Tier.P1),
        ("0", None, Tier.P0),
        (None, None, None),
    ],
)
def test_header_beats_body_priority(header: str | None, priority: int | None, expected: Tier | None) -> None:
    assert parse_declared_tier(header, priority) == expected


def test_bad_tier_header_is_400_naming_it() -> None:
    with pytest.raises(ApiError) as e:
        parse_declared_tier("urgent", None)
    assert e.value.status == 400 and e.value.param == "x-request-tier"


def test_declared_tier_is_lowered_to_the_entitlement_never_raised() -> None:
    silver = parse_serve_config(KEYED).tenants["silver"]  # max P2, default P3
    lowered = decide_tier(silver, Tier.P0)
    assert lowered.effective is Tier.P2 and lowered.lowered and lowered.entitled is Tier.P2
    kept = decide_tier(silver, Tier.P3)
    assert kept.effective is Tier.P3 and not kept.lowered
    assert decide_tier(silver, None).effective is Tier.P3


def as_asgi(text: str) -> str:
    """A header value as the ASGI server hands it over: its UTF-8 bytes read as Latin-1."""
    return text.encode("utf-8").decode("latin-1")


def test_a_utf8_tenant_header_names_its_tenant_and_is_quoted_as_sent() -> None:
    raw = {"server": {"tenant_header": True}, "tenants": {**KEYED["tenants"], "café": {"max_tier": "P1"}}}
    resolver = TenantResolver(parse_serve_config(raw))
    assert resolver.resolve(None, as_asgi("café")).name == "café"
    with pytest.raises(ApiError) as e:
        resolver.resolve(None, as_asgi("thé"))
    assert "'thé'" in e.value.message
    open_server = TenantResolver(parse_serve_config({}))
    assert open_server.resolve(None, as_asgi("équipe")).name == "équipe"


def test_a_bad_tier_header_is_quoted_as_sent_and_cut_short() -> None:
    with pytest.raises(ApiError) as e:
        parse_declared_tier(as_asgi("réaltime"), None)
    assert "'réaltime'" in e.value.message
    with pytest.raises(ApiError) as e:
        parse_declared_tier("x" * 30_000, None)
    assert len(e.value.message) < 300 and "(+29936 characters)" in e.value.message
    with pytest.raises(ApiError) as e:  # bytes that are not UTF-8 stay as they came
        parse_declared_tier(b"\xffP0".decode("latin-1"), None)
    assert "'\xffP0'" in e.value.message


def test_a_misspelt_default_tenant_is_refused_naming_the_close_one() -> None:
    """It ran the anonymous requests as a tenant of its own, with none of the limits of the
    tenant meant (start-up said only the name)."""
    raw = {
        "server": {"allow_anonymous": True, "default_tenant": "pubilc"},
        "tenants": {"public": {"max_tier": "P3", "requests_per_s": 1}, "gold": {"api_keys": ["sk-g"]}},
    }
    with pytest.raises(ConfigError, match=r"server.default_tenant: 'pubilc' .*did you mean 'public'"):
        parse_serve_config(raw)
    # Left out, the built-in name need not be declared: it is a tenant of its own, at P3.
    del raw["server"]["default_tenant"]
    assert TenantResolver(parse_serve_config(raw)).resolve(None, None).name == "default"


@pytest.mark.parametrize("weight", [1e-320, 1e-7, 1e7])
def test_a_tenant_weight_outside_a_tiers_bounds_is_refused(weight: float) -> None:
    # 1e-320 made a request's cost infinite: the tier's fair queue went first come, first served.
    with pytest.raises(ConfigError, match=r"tenants.a.weight: must be in \[1e-06, 1e\+06\]"):
        parse_serve_config({"tenants": {"a": {"api_keys": ["k"], "weight": weight}}})


@pytest.mark.parametrize("key", [" sk-a", "sk-a ", "sk\u0000a", "sk\na"])
def test_an_api_key_no_request_could_present_is_refused(key: str) -> None:
    with pytest.raises(ConfigError, match=r"tenants.a.api_keys: key .* spaces at an end or a control"):
        parse_serve_config({"tenants": {"a": {"api_keys": [key]}}})


def test_a_utf8_api_key_selects_its_tenant() -> None:
    """The ASGI server hands headers over decoded as Latin-1: a key "clé" arrived as "clÃ©"
    and every request with it was a 401 (x-tenant-id was already read as UTF-8)."""
    resolver = TenantResolver(parse_serve_config({"tenants": {"a": {"api_keys": ["clé"]}}}))
    sent = "Bearer clé".encode().decode("latin-1")
    assert resolver.resolve(sent, None).name == "a"
    # A key whose Latin-1 text reads as UTF-8 too still matches as sent.
    resolver = TenantResolver(
        parse_serve_config({"tenants": {"a": {"api_keys": ["keyÃ©", "k\tx", "k\u00a0y"]}}})
    )
    assert resolver.resolve("Bearer keyÃ©", None).name == "a"
    assert resolver.resolve("Bearer k\tx", None).name == "a"  # a tab or a no-break space inside is fine


@pytest.mark.parametrize("auth", ["sk-gold", "Basic sk-gold", "Bearer", "Token sk-gold"])
def test_a_key_sent_without_bearer_is_refused_saying_so_even_where_anonymous_is_allowed(auth: str) -> None:
    """It ran as anonymous, at the anonymous tier (P3), with no error: a paying tenant whose
    client dropped "Bearer " was moved to the lowest tier without being told."""
    config = parse_serve_config(
        {
            "server": {"allow_anonymous": True},
            "tenants": {"gold": {"api_keys": ["sk-gold"], "max_tier": "P0"}},
        }
    )
    for resolver in (TenantResolver(config), TenantResolver(parse_serve_config(KEYED))):
        with pytest.raises(ApiError) as e:
            resolver.resolve(auth, None)
        assert e.value.status == 401 and "Bearer <key>" in e.value.message
    open_server = TenantResolver(parse_serve_config({}))  # no keys: the header is not read
    assert open_server.resolve(auth, None).name == "default"
