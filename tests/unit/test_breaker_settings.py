"""The KILN_BREAKER_* and KILN_RETRY_RATE settings: defaults, parsing, refusals."""

from __future__ import annotations

import pytest

from kiln.config import Settings
from kiln.errors import ConfigError


def test_the_defaults_pause_every_kind_and_cap_no_retries() -> None:
    settings = Settings.from_env({})
    assert settings.retry_rate is None
    assert (settings.breaker_failure_rate, settings.breaker_min_calls) == (0.5, 10)
    assert (settings.breaker_window_s, settings.breaker_open_s) == (60.0, 30.0)
    assert settings.breaker_policy == {}


def test_the_settings_are_read_from_the_environment() -> None:
    settings = Settings.from_env(
        {
            "KILN_RETRY_RATE": "10",
            "KILN_BREAKER_FAILURE_RATE": "0.25",
            "KILN_BREAKER_MIN_CALLS": "4",
            "KILN_BREAKER_WINDOW_S": "30",
            "KILN_BREAKER_OPEN_S": "5",
            "KILN_BREAKER_POLICY": " image.generate = pause , image.transform=FAIL_FAST,*=pause",
        }
    )
    assert settings.retry_rate == 10.0
    assert (settings.breaker_failure_rate, settings.breaker_min_calls) == (0.25, 4)
    assert (settings.breaker_window_s, settings.breaker_open_s) == (30.0, 5.0)
    assert settings.breaker_policy == {
        "image.generate": "pause",
        "image.transform": "fail_fast",
        "*": "pause",
    }


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("KILN_BREAKER_POLICY", "image.generate=retry", "kind=pause or kind=fail_fast"),
        ("KILN_BREAKER_POLICY", "fail_fast", "kind=pause or kind=fail_fast"),
        ("KILN_BREAKER_FAILURE_RATE", "1.5", "<= 1"),
        ("KILN_BREAKER_FAILURE_RATE", "0", "> 0"),
        ("KILN_BREAKER_MIN_CALLS", "0", "a whole number >= 1"),
        ("KILN_RETRY_RATE_PER_S", "-1", "a number per second > 0"),
        ("KILN_RETRY_RATE", "-1", "a number per second > 0"),
        ("KILN_BREAKER_OPEN_S", "soon", "a number of seconds > 0"),
    ],
)
def test_a_bad_value_is_refused_with_its_name(name: str, raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        Settings.from_env({name: raw})
    assert name in str(refused.value)
