"""Every numeric setting is finite and at most its documented maximum, refused at construction
with a ConfigError naming the field (and the variable): an infinite exchange timeout once hung
the watchdog's fit, an infinite linger overflowed ``time.sleep`` and hid the abort, and a
window of 10**40 overflowed ``deque``."""

from __future__ import annotations

import dataclasses
import time

import pytest

from nansentinel.config import (
    _PARSERS,
    ConfigError,
    SentinelConfig,
    env_var,
    maximum,
)
from nansentinel.decide.spikes import SpikeDetector
from nansentinel.wire.watchdog import fitted_timeout

NUMERIC = sorted(name for name, kind in _PARSERS.items() if kind in ("int", "float"))


@pytest.mark.parametrize("field", NUMERIC)
@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "1e40"])
def test_a_non_finite_or_huge_variable_names_the_variable(field: str, raw: str) -> None:
    if _PARSERS[field] == "int" and raw != "1e40":
        raw = str(10**40)  # int("inf") is already "not a valid int"
    with pytest.raises(ConfigError) as caught:
        SentinelConfig.from_env({env_var(field): raw})
    assert env_var(field) in str(caught.value)


@pytest.mark.parametrize("field", NUMERIC)
def test_a_keyword_past_the_maximum_names_the_field(field: str) -> None:
    top = maximum(field)
    past = top * 2 + 1 if _PARSERS[field] == "float" else int(top) + 1
    with pytest.raises(ConfigError, match=field):
        SentinelConfig(**{field: past})
    if _PARSERS[field] == "float":
        with pytest.raises(ConfigError, match="finite"):
            SentinelConfig(**{field: float("inf")})


def test_the_maxima_themselves_are_accepted_and_usable() -> None:
    cfg = SentinelConfig(**{
        f: (maximum(f) if _PARSERS[f] == "float" else int(maximum(f)))
        for f in NUMERIC if f not in ("max_dropped", "rollback_lr_factor")
    })
    started = time.monotonic()
    assert fitted_timeout(cfg.exchange_timeout, 60.0) is not None  # no endless bisection
    assert fitted_timeout(cfg.exchange_timeout, None) == 86400.0
    SpikeDetector(window=cfg.spike_window, warmup=cfg.spike_warmup, ratio=cfg.spike_ratio,
                  zscore=cfg.spike_zscore)
    assert time.monotonic() - started < 5


def test_every_numeric_field_is_covered_by_the_one_check() -> None:
    # A field added later (issue 52 adds some) is checked without being listed anywhere.
    assert set(NUMERIC) <= {f.name for f in dataclasses.fields(SentinelConfig)}
    for field in NUMERIC:
        assert maximum(field) > 0
