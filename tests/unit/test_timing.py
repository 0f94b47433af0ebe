"""kiln.timing: a delayed task's moment, and cron ticks in a time zone (DST included)."""

from __future__ import annotations

import datetime as dt
import itertools
import zoneinfo

import pytest

from kiln.errors import InvalidRequest
from kiln.timing import MAX_DELAY_S, Cron, parse_moment, run_at_of

NOW = 1_800_000_000.0
BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")
NOT_IANA = ["localtime", "posixrules", "Factory", "posix/Europe/Berlin", "right/UTC"]


def local(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, BERLIN)


def berlin(*parts: int, fold: int = 0) -> float:
    return dt.datetime(*parts, tzinfo=BERLIN, fold=fold).timestamp()


def test_run_at_takes_unix_seconds_or_rfc_3339_with_an_offset() -> None:
    assert parse_moment(NOW) == NOW
    eight_utc = dt.datetime(2027, 1, 15, 8, tzinfo=dt.UTC).timestamp()
    assert parse_moment("2027-01-15T08:00:00Z") == eight_utc
    assert parse_moment("2027-01-15T09:00:00+01:00") == parse_moment("2027-01-15T08:00:00Z")


@pytest.mark.parametrize(
    ("run_at", "delay_s", "why"),
    [
        (NOW + 10, 10.0, "not both"),
        (-1.0, None, "negative"),
        (None, -0.5, "negative"),
        (float("inf"), None, "finite"),
        (None, float("nan"), "finite"),
        (NOW + MAX_DELAY_S + 1, None, "a year ahead"),
        (None, MAX_DELAY_S + 1, "a year ahead"),
        ("2027-01-15T08:00:00", None, "offset"),
        ("next tuesday", None, "RFC 3339"),
        (True, None, "finite"),
    ],
)
def test_impossible_moments_are_refused(run_at: object, delay_s: object, why: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        run_at_of(run_at, delay_s, NOW)  # type: ignore[arg-type]
    assert refused.value.details, why


def test_delay_counts_from_now_and_nothing_means_now() -> None:
    assert run_at_of(None, 30, NOW) == NOW + 30
    assert run_at_of(NOW - 5, None, NOW) == NOW - 5  # already past: runs at once
    assert run_at_of(None, None, NOW) is None


def test_cron_with_seconds_ticks_every_second() -> None:
    cron = Cron.parse("* * * * * *", "UTC", now=NOW)
    assert cron.next_after(NOW) == NOW + 1
    assert cron.next_after(NOW + 0.5) == NOW + 1
    assert cron.last_at_or_before(NOW + 2.5) == NOW + 2
    assert cron.count_between(NOW + 1, NOW + 11, 100) == 10
    assert cron.count_between(NOW + 1, NOW + 11, 3) == 3


@pytest.mark.parametrize(
    ("expression", "zone"),
    [
        ("bad", "UTC"),
        ("61 * * * *", "UTC"),
        ("0 0 30 2 *", "UTC"),
        ("* * * * *", "Mars/Base"),
        # names zoneinfo loads a file by (from /usr/share/zoneinfo) that are no IANA zone
        *[("* * * * *", zone) for zone in NOT_IANA],
    ],
)
def test_bad_expressions_and_zones_are_refused(expression: str, zone: str) -> None:
    with pytest.raises(InvalidRequest):
        Cron.parse(expression, zone, now=NOW)


def test_a_daily_tick_in_the_hour_skipped_by_spring_forward_runs_when_clocks_moved_on() -> None:
    # Given 02:30 every day in Berlin, where 2026-03-29 02:00 jumps to 03:00
    cron = Cron.parse("30 2 * * *", "Europe/Berlin", now=NOW)
    before = berlin(2026, 3, 28, 12)
    # When the ticks across the change are read
    first = cron.next_after(before)
    second = cron.next_after(first)  # type: ignore[arg-type]
    # Then the night of the change fires once, at 03:00 (01:00 UTC), and the next at 02:30
    assert first == berlin(2026, 3, 29, 3, 0)
    assert dt.datetime.fromtimestamp(first, dt.UTC).hour == 1  # type: ignore[arg-type]
    assert second == berlin(2026, 3, 30, 2, 30)


def test_a_daily_tick_in_the_hour_repeated_by_fall_back_fires_once() -> None:
    # Given 02:30 every day in Berlin, where 2026-10-25 03:00 goes back to 02:00
    cron = Cron.parse("30 2 * * *", "Europe/Berlin", now=NOW)
    first = cron.next_after(berlin(2026, 10, 24, 12))
    assert first == berlin(2026, 10, 25, 2, 30)
    # When the next tick is read from the first, and from inside the repeated hour
    # Then both are the next day: the repeated 02:30 does not fire again
    assert cron.next_after(first) == berlin(2026, 10, 26, 2, 30)  # type: ignore[arg-type]
    assert cron.next_after(berlin(2026, 10, 25, 2, 10, fold=1)) == berlin(2026, 10, 26, 2, 30)


def test_an_hourly_schedule_fires_every_real_hour_across_fall_back() -> None:
    cron = Cron.parse("0 * * * *", "Europe/Berlin", now=NOW)
    start = berlin(2026, 10, 25, 0, 30)
    ticks: list[float] = []
    moment = start
    for _ in range(5):
        moment = cron.next_after(moment)  # type: ignore[assignment]
        ticks.append(moment)
    # 01:00, 02:00 (summer), 02:00 (winter), 03:00, 04:00: an hour apart in real time
    assert [b - a for a, b in itertools.pairwise(ticks)] == [3600.0] * 4
    assert [local(t).hour for t in ticks] == [1, 2, 2, 3, 4]
