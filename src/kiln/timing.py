"""When work runs: a delayed task's moment, and the ticks of a cron schedule in a time zone.

A submission may ask to run later (``run_at``: unix seconds or an RFC 3339 time;
``delay_s``: seconds from now). :func:`run_at_of` turns either into unix seconds and
refuses what cannot be meant (both, negative, not finite, more than
:data:`MAX_DELAY_S` ahead). A schedule is a cron expression (five fields, or six with
seconds first) read in an IANA time zone: :class:`Cron` checks it and gives the next tick
after a moment. The expression is evaluated by ``cronsim`` (see docs/schedules.md for why),
which keeps cron's own rules across daylight saving changes: a tick in an hour that does
not exist runs when the clocks have moved on (02:30 on a spring-forward night runs at
03:00), and a daily tick in an hour that happens twice runs once (the first time).
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import zoneinfo
from dataclasses import dataclass

from cronsim import CronSim, CronSimError

from kiln.errors import InvalidRequest

#: The furthest ahead a delayed task may be asked to run (a year).
MAX_DELAY_S = 366 * 86_400.0
#: How many ticks :meth:`Cron.next_after` looks through before it gives up (a tick that
#: only goes backwards across a daylight saving change is skipped, never returned).
_MAX_STEPS = 16


def _detail(field: str, message: str) -> list[dict[str, object]]:
    return [{"loc": ["body", field], "msg": message, "type": "value_error"}]


def _finite(field: str, value: float) -> float:
    if isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequest(f"{field} must be a finite number", details=_detail(field, "finite"))
    return float(value)


def parse_moment(value: float | int | str, field: str = "run_at") -> float:
    """Unix seconds from a number or an RFC 3339 time with its offset (``Z`` or
    ``+02:00``); InvalidRequest for anything else (no offset, not a time)."""
    if isinstance(value, str):
        try:
            moment = dt.datetime.fromisoformat(value.strip().replace("z", "Z"))
        except ValueError:
            raise InvalidRequest(
                f"{field} is not an RFC 3339 time (e.g. 2026-01-01T09:00:00Z)",
                details=_detail(field, "not an RFC 3339 time"),
            ) from None
        if moment.tzinfo is None:
            raise InvalidRequest(
                f"{field} needs a time zone offset (Z or +hh:mm)",
                details=_detail(field, "no offset"),
            )
        return moment.timestamp()
    return _finite(field, value)


def run_at_of(
    run_at: float | int | str | None, delay_s: float | int | None, now: float
) -> float | None:
    """The moment a submission asks to run at (unix seconds), or None for now.

    Refused (InvalidRequest): both given, a negative or non-finite value, a moment more
    than :data:`MAX_DELAY_S` ahead. A ``run_at`` already past runs at once."""
    if run_at is not None and delay_s is not None:
        raise InvalidRequest(
            "give run_at or delay_s, not both", details=_detail("delay_s", "with run_at")
        )
    if delay_s is not None:
        delay = _finite("delay_s", delay_s)
        if delay < 0:
            raise InvalidRequest("delay_s must not be negative", details=_detail("delay_s", "< 0"))
        moment, field = now + delay, "delay_s"
    elif run_at is not None:
        moment, field = parse_moment(run_at), "run_at"
        if moment < 0:
            raise InvalidRequest("run_at must not be negative", details=_detail("run_at", "< 0"))
    else:
        return None
    if moment - now > MAX_DELAY_S:
        raise InvalidRequest(
            f"{field} is more than a year ahead", details=_detail(field, "more than a year ahead")
        )
    return moment


#: Names the system's zone files answer to that are no IANA zone to read a schedule in:
#: ``localtime`` is whatever zone the host is set to (two servers could read one schedule
#: differently), ``posixrules`` a template of POSIX TZ rules, ``Factory`` the placeholder
#: for "no zone set" (abbreviated ``-00``).
NOT_ZONES = frozenset({"localtime", "posixrules", "Factory"})


@functools.cache
def zone_names() -> frozenset[str]:
    """The IANA zone names this machine knows (``zoneinfo.available_timezones()``, which
    leaves out the ``posix/`` and ``right/`` copies), less :data:`NOT_ZONES`."""
    return frozenset(zoneinfo.available_timezones()) - NOT_ZONES


def zone_of(name: str) -> zoneinfo.ZoneInfo:
    """The IANA time zone ``name`` (``Europe/Berlin``, ``UTC``), or InvalidRequest: a name
    outside :func:`zone_names` is refused even when ``zoneinfo`` would load a file by it."""
    try:
        if name not in zone_names():
            raise ValueError(name)
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        raise InvalidRequest(
            f"unknown time zone {name!r}: give an IANA name such as Europe/Berlin or UTC",
            details=_detail("timezone", "unknown time zone"),
        ) from None


@dataclass(frozen=True, slots=True)
class Cron:
    """A cron expression read in a time zone; build it with :meth:`parse`."""

    expression: str
    timezone: str

    @classmethod
    def parse(cls, expression: str, timezone: str, *, now: float) -> Cron:
        """Check the expression and the zone, and that the expression ever fires (within
        the next few years from ``now``); InvalidRequest otherwise."""
        cron = cls(" ".join(expression.split()), timezone)
        zone = zone_of(timezone)
        try:
            CronSim(cron.expression, dt.datetime.fromtimestamp(now, zone))
        except CronSimError as exc:
            raise InvalidRequest(
                f"bad cron expression {expression!r}: {exc}",
                details=_detail("cron", str(exc)),
            ) from None
        if cron.next_after(now) is None:
            raise InvalidRequest(
                f"the cron expression {expression!r} never fires",
                details=_detail("cron", "never fires"),
            )
        return cron

    def next_after(self, moment: float) -> float | None:
        """The first tick strictly after ``moment`` (unix seconds), or None if the
        expression has no tick left."""
        zone = zoneinfo.ZoneInfo(self.timezone)
        ticks = CronSim(self.expression, dt.datetime.fromtimestamp(moment, zone))
        try:
            for _ in range(_MAX_STEPS):
                tick = next(ticks).timestamp()
                if tick > moment:
                    return tick
        except (StopIteration, CronSimError):
            return None
        return None

    def last_at_or_before(self, moment: float) -> float | None:
        """The latest tick at or before ``moment``, or None."""
        zone = zoneinfo.ZoneInfo(self.timezone)
        start = dt.datetime.fromtimestamp(math.floor(moment) + 1, zone)
        ticks = CronSim(self.expression, start, reverse=True)
        try:
            for _ in range(_MAX_STEPS):
                tick = next(ticks).timestamp()
                if tick <= moment:
                    return tick
        except (StopIteration, CronSimError):
            return None
        return None

    def count_between(self, first: float, last: float, limit: int) -> int:
        """How many ticks ``t`` have ``first <= t < last``, counted up to ``limit``."""
        count = 0
        tick = self.next_after(first - 1)
        while tick is not None and tick < last and count < limit:
            count += 1
            tick = self.next_after(tick)
        return count
