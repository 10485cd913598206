"""Config precedence (keyword > env > default) and errors that name the field or variable."""

from __future__ import annotations

import pytest

from nansentinel.config import ConfigError, SentinelConfig, resolve_hostname


def test_defaults() -> None:
    cfg = SentinelConfig.from_env({})
    assert cfg.policy == "skip" and cfg.max_consecutive_skips == 5
    assert cfg.metrics_port == 9410 and cfg.report_dir == "nansentinel_reports"


def test_keyword_beats_env_beats_default() -> None:
    env = {"NANSENTINEL_POLICY": "abort", "NANSENTINEL_MAX_CONSECUTIVE_SKIPS": "7"}
    assert SentinelConfig.from_env(env).policy == "abort"
    cfg = SentinelConfig.from_env(env, policy="skip")
    assert cfg.policy == "skip" and cfg.max_consecutive_skips == 7


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"NANSENTINEL_MAX_CONSECUTIVE_SKIPS": "five"},
         ["NANSENTINEL_MAX_CONSECUTIVE_SKIPS", "five"]),
        ({"NANSENTINEL_POLICY": "explode"}, ["policy", "explode", "NANSENTINEL_POLICY", "skip"]),
        ({"NANSENTINEL_METRICS_PORT": "70000"}, ["metrics_port", "NANSENTINEL_METRICS_PORT"]),
        ({"NANSENTINEL_REPORT_DIR": ""}, ["NANSENTINEL_REPORT_DIR", "empty"]),
        ({"NANSENTINEL_INJECT": "kind=grad,step=x"}, ["inject", "step", "NANSENTINEL_INJECT"]),
        ({"NANSENTINEL_EXCHANGE_TIMEOUT": "-1"}, ["exchange_timeout", "> 0"]),
        ({"NANSENTINEL_MAX_CONSECUTIVE_SKIPS": "0"}, ["max_consecutive_skips", ">= 1"]),
    ],
)
def test_malformed_env_names_the_variable(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        SentinelConfig.from_env(env)
    for word in words:
        assert word in str(info.value)


def test_unknown_keyword_suggests_the_field() -> None:
    with pytest.raises(ConfigError, match=r"polcy.*did you mean policy"):
        SentinelConfig.from_env({}, polcy="skip")


def test_unknown_env_var_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    SentinelConfig.from_env({"NANSENTINEL_POLCY": "abort"})
    assert "NANSENTINEL_POLCY" in caplog.text and "NANSENTINEL_POLICY" in caplog.text


def test_bad_keyword_values() -> None:
    with pytest.raises(ConfigError, match="policy='nope'"):
        SentinelConfig(policy="nope")
    with pytest.raises(ConfigError, match="max_consecutive_skips=True is a bool, not an integer"):
        SentinelConfig(max_consecutive_skips=True)
    with pytest.raises(ConfigError, match="given together"):
        SentinelConfig(metrics_certfile="c.pem")


def test_hostname_resolution_order() -> None:
    assert resolve_hostname("a", {"NODE_NAME": "b"}) == "a"
    assert resolve_hostname(None, {"NODE_NAME": "b"}) == "b"
    assert resolve_hostname(None, {})  # the machine's hostname
    cfg = SentinelConfig.from_env({"NANSENTINEL_HOSTNAME": "node7"})
    assert resolve_hostname(cfg.hostname, {"NODE_NAME": "b"}) == "node7"


def test_the_variable_named_is_the_one_at_fault_not_one_the_message_mentions() -> None:
    env = {"NANSENTINEL_SPIKE_WARMUP": "50", "NANSENTINEL_SPIKE_WINDOW": "40"}
    with pytest.raises(ConfigError) as info:
        SentinelConfig.from_env(env)
    assert info.value.field == "spike_warmup"
    assert str(info.value).endswith("(from environment variable NANSENTINEL_SPIKE_WARMUP)")


def test_each_field_is_its_variable_and_the_reference_table_lists_them_all() -> None:
    """One source: the dataclass. The variable is derived from the field, and the configuration
    reference's table (docs/configuration.md, linked from the README) names exactly the fields
    there are, each with its variable."""
    import dataclasses
    import re
    from pathlib import Path

    from nansentinel.config import KNOWN_ENV, env_var

    fields = {f.name for f in dataclasses.fields(SentinelConfig)}
    assert {env_var(f) for f in fields} == KNOWN_ENV
    assert env_var("metrics_port") == "NANSENTINEL_METRICS_PORT"
    with pytest.raises(KeyError, match="metrics_port"):
        env_var("metric_port")
    # Every variable reaches its field through from_env.
    cfg = SentinelConfig.from_env({env_var("strike_window"): "7", env_var("replay"): "0"})
    assert cfg.strike_window == 7 and cfg.replay is False

    root = Path(__file__).resolve().parents[2]
    reference = root / "docs" / "configuration.md"
    assert "](docs/configuration.md)" in (root / "README.md").read_text(encoding="utf-8")
    lines = reference.read_text(encoding="utf-8").splitlines()
    header = next(i for i, line in enumerate(lines)
                  if line.startswith("| field | environment variable |"))
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    assert all(row.startswith("| `") for row in rows), rows
    listed: dict[str, str] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`([a-z_]+)`", cells[0])
        variables = re.findall(r"`(NANSENTINEL_[A-Z_]+)`", cells[1])
        assert len(names) == len(variables), row
        listed.update(zip(names, variables, strict=True))
    assert set(listed) == fields, sorted(set(listed) ^ fields)
    assert all(var == env_var(name) for name, var in listed.items()), listed


def test_spikes_recover_sets_the_playbook_and_each_field_given_wins() -> None:
    """Issue 38: spikes="recover" sets its fields together; precedence is keyword > the
    field's own variable > the preset > the default; an unknown preset names the field."""
    from nansentinel.config import SPIKE_PRESETS

    recover = SPIKE_PRESETS["recover"]
    cfg = SentinelConfig.from_env({}, spikes="recover")
    assert {k: getattr(cfg, k) for k in recover} == recover
    assert SentinelConfig.from_env({"NANSENTINEL_SPIKES": "recover"}).loss_spike_ratio == 1.5
    env = {"NANSENTINEL_SPIKES": "recover", "NANSENTINEL_SPIKE_PATIENCE": "3"}
    assert SentinelConfig.from_env(env).spike_patience == 3  # its own variable > the preset
    assert SentinelConfig.from_env(env, spike_patience=1).spike_patience == 1  # keyword > both
    assert SentinelConfig.from_env({}, spikes="recover", loss_spike_action="skip"
                                   ).loss_spike_action == "skip"
    warn = SentinelConfig.from_env({})
    assert (warn.spikes, warn.loss_spike_action, warn.loss_spike_ratio,
            warn.spike_patience) == ("warn", "warn", None, 1)
    with pytest.raises(ConfigError, match=r"spikes='heal'.*warn, recover") as info:
        SentinelConfig.from_env({"NANSENTINEL_SPIKES": "heal"})
    assert "NANSENTINEL_SPIKES" in str(info.value)
    with pytest.raises(ConfigError, match="loss_spike_ratio=1"):
        SentinelConfig.from_env({}, loss_spike_ratio=1.0)
    with pytest.raises(ConfigError, match="spike_patience=0"):
        SentinelConfig.from_env({}, spike_patience=0)
