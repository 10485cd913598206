"""Property tests: whatever text sits in a NANSENTINEL_* variable or NANSENTINEL_INJECT, the
sentinel's configuration either accepts it or raises ConfigError naming the variable; never
another exception (a traceback from every rank at start-up)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nansentinel.config import KNOWN_ENV, ConfigError, SentinelConfig, env_var

VARIABLES = sorted(KNOWN_ENV)
# Text an environment can hold (no NUL), biased towards what parsers trip on.
TRICKY = st.sampled_from([
    "", " ", "nan", "-nan", "inf", "-inf", "1e309", "-1", "0", "0x10", "1_000", "٣", "1.5",
    "9" * 5000, "true", "FALSE", "yes", "None", "[]", "{}", "é", "\t\n", "kind=grad",
    "kind=grad,rank=0,step=1", "kind=loss,host=a=b,step=1", "kind=batch,steps=5-3",
    "kind=grad,step=1;;kind=loss,step=2", ";", ",", "=", "kind=grad,step=99999999999999999999",
])
VALUES = st.one_of(TRICKY, st.text(st.characters(blacklist_characters="\x00"), max_size=60))
INJECT = st.one_of(
    VALUES,
    st.lists(
        st.lists(
            st.tuples(
                st.sampled_from(["kind", "rank", "host", "step", "steps", "value", "bogus", ""]),
                st.one_of(st.sampled_from(["grad", "loss", "batch", "nan", "inf", "-inf", "1",
                                           "2-4", "4-2", "-1", "x", "", "=", " 3 "]),
                          st.text(max_size=8)),
            ),
            max_size=5,
        ).map(lambda kv: ",".join(f"{k}={v}" for k, v in kv)),
        max_size=3,
    ).map(";".join),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VARIABLES), VALUES)
def test_any_value_of_any_variable_is_accepted_or_names_the_variable(var: str, raw: str) -> None:
    try:
        SentinelConfig.from_env({var: raw})
    except ConfigError as exc:
        assert var in str(exc), (var, raw, str(exc))


@settings(max_examples=300, deadline=None)
@given(INJECT)
def test_any_inject_spec_is_accepted_or_names_the_variable(spec: str) -> None:
    try:
        cfg = SentinelConfig.from_env({env_var("inject"): spec})
    except ConfigError as exc:
        assert env_var("inject") in str(exc), (spec, str(exc))
    else:
        assert cfg.inject == spec.strip()


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(VARIABLES), VALUES, max_size=6))
def test_several_bad_variables_still_give_one_config_error(env: dict[str, str]) -> None:
    try:
        SentinelConfig.from_env(env)
    except ConfigError as exc:
        assert any(var in str(exc) for var in env), (env, str(exc))
