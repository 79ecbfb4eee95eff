from __future__ import annotations

from pathlib import Path

from tierserve.config import DEFAULT_TIERS, SchedulerConfig, load_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_the_example_engine_config_loads_and_states_the_defaults() -> None:
    config = load_config(DEPLOY / "tiers.example.toml")
    assert config.scheduler == SchedulerConfig()
    assert dict(config.tiers) == DEFAULT_TIERS
    for name, options in config.policy_options.items():
        assert options == type(options)(), f"[policy.{name}] must state the defaults"
