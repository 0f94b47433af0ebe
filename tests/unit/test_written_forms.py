"""The forms the hot path writes by a shorter way are the ones the plain way writes: a time
in ISO 8601 to the millisecond, a task id's digits."""

from __future__ import annotations

import datetime as dt
import random

import pytest

from kiln import canonical
from kiln.models import iso

CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


def iso_the_plain_way(ts: float) -> str:
    moment = dt.datetime.fromtimestamp(ts, tz=dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def digits_the_plain_way(value: int) -> str:
    chars = []
    for _ in range(26):
        chars.append(CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def test_a_time_is_written_as_datetime_writes_it() -> None:
    rng = random.Random(25)
    edges = [0.0, 1.0, 0.0005, 0.9999994, 0.9999995, 1_796_554_817.9999996, 253_402_300_799.999]
    halves = [rng.randint(1_700_000_000, 1_800_000_000) + (rng.randint(0, 999) + 0.5) / 1000
              for _ in range(20_000)]  # fmt: skip
    anywhere = [rng.uniform(0, 4e9) for _ in range(20_000)]
    for ts in edges + halves + anywhere:
        assert iso(ts) == iso_the_plain_way(ts), ts
    assert iso(None) is None


def test_a_task_id_has_the_digits_of_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(25)
    values = [0, 1, 31, 32, 2**80, 2**128 - 1, *(rng.getrandbits(128) for _ in range(5_000))]

    class Fixed:
        value = 0

        def next(self) -> int:
            return self.value

    fixed = Fixed()
    monkeypatch.setattr(canonical, "_ids", fixed)
    for value in values:
        fixed.value = value
        assert canonical.new_id("tsk_") == "tsk_" + digits_the_plain_way(value)
