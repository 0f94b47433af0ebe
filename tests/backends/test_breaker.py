"""The circuit breaker's state machine, on an injected clock."""

from __future__ import annotations

import pytest

from kiln.backends.breaker import CircuitBreaker, Permit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_breaker(clock: Clock, **options: float) -> CircuitBreaker:
    settings = {"failure_threshold": 3, "window": 10, "failure_rate": 0.5, "cooldown_s": 30.0}
    return CircuitBreaker(**{**settings, **options}, clock=clock)  # type: ignore[arg-type]


def call(breaker: CircuitBreaker, ok: bool) -> Permit:
    permit = breaker.admit()
    assert permit is not None, "the breaker refused the call"
    breaker.record(permit, ok)
    return permit


def test_it_opens_after_failures_in_a_row_and_refuses_calls(clock: Clock) -> None:
    breaker = make_breaker(clock)
    call(breaker, False)
    call(breaker, False)
    assert breaker.state == "closed"
    call(breaker, False)
    assert breaker.state == "open"
    assert breaker.admit() is None
    assert breaker.retry_after_s() == 30.0


def test_a_success_resets_the_run_of_failures(clock: Clock) -> None:
    breaker = make_breaker(clock, window=100)
    for _ in range(5):
        call(breaker, False)
        call(breaker, False)
        call(breaker, True)
    assert breaker.state == "closed"


def test_it_opens_on_the_failure_rate_over_a_full_window(clock: Clock) -> None:
    # Given a window of 10 calls and a threshold of half, failures never 3 in a row
    breaker = make_breaker(clock)
    for _ in range(4):
        call(breaker, False)
        call(breaker, True)
    call(breaker, False)
    assert breaker.state == "closed"  # 5 of 9: the window is not full yet
    # When the tenth call fails (6 of 10)
    call(breaker, False)
    # Then it opens
    assert breaker.state == "open"


def test_after_the_cool_down_one_probe_goes_through_and_its_success_closes(
    clock: Clock,
) -> None:
    breaker = make_breaker(clock)
    for _ in range(3):
        call(breaker, False)
    clock.now += 29.9
    assert (breaker.admit(), breaker.state) == (None, "open")
    assert breaker.retry_after_s() == pytest.approx(0.1)

    clock.now += 0.1
    assert breaker.state == "half_open"
    probe = breaker.admit()
    assert probe is not None and probe.probe
    assert breaker.admit() is None  # one probe at a time
    breaker.record(probe, True)

    assert breaker.state == "closed"
    call(breaker, False)
    call(breaker, False)
    assert breaker.state == "closed"  # the count of failures started again


def test_a_failed_probe_opens_it_for_another_cool_down(clock: Clock) -> None:
    breaker = make_breaker(clock)
    for _ in range(3):
        call(breaker, False)
    clock.now += 30
    call(breaker, False)
    assert breaker.state == "open"
    assert breaker.retry_after_s() == 30.0
    clock.now += 30
    assert breaker.state == "half_open"


def test_a_probe_that_ends_without_a_verdict_lets_another_go(clock: Clock) -> None:
    breaker = make_breaker(clock)
    for _ in range(3):
        call(breaker, False)
    clock.now += 30
    probe = breaker.admit()
    assert probe is not None
    breaker.release(probe)  # cancelled: no verdict
    assert breaker.admit() is not None


def test_calls_admitted_before_it_opened_do_not_decide_afterwards(clock: Clock) -> None:
    # Given a call in flight while the breaker opens
    breaker = make_breaker(clock)
    slow = breaker.admit()
    assert slow is not None
    for _ in range(3):
        call(breaker, False)
    clock.now += 30
    probe = breaker.admit()
    assert probe is not None

    # When the old call ends well, then the probe fails
    breaker.record(slow, True)
    assert breaker.state == "half_open"
    breaker.record(probe, False)

    # Then only the probe counted
    assert breaker.state == "open"


def test_a_time_window_forgets_old_failures(clock: Clock) -> None:
    # Given a breaker over the calls of the last 60 s, opening at half of at least 4
    breaker = CircuitBreaker(failure_threshold=None, window=None, min_calls=4,
                             window_s=60.0, clock=clock)  # fmt: skip
    call(breaker, False)
    call(breaker, False)
    # When those failures age out of the window, then two more calls fail, one succeeds
    clock.now += 61
    call(breaker, False)
    call(breaker, True)
    call(breaker, False)
    # Then only the three recent calls count: not enough to judge
    assert breaker.state == "closed"
    # And with a fourth recent failure, 3 of 4 failed: open
    call(breaker, False)
    assert breaker.state == "open"


def test_it_tells_its_listeners_what_it_decided_but_not_what_it_adopted(clock: Clock) -> None:
    breaker = make_breaker(clock)
    heard: list[str] = []
    breaker.listeners.append(heard.append)
    for _ in range(3):
        call(breaker, False)
    clock.now += 30
    call(breaker, True)  # the probe
    assert heard == ["open", "closed"]
    # When another process's state is adopted, nobody is told
    breaker.adopt("open", 12.0)
    assert (breaker.state, breaker.retry_after_s(), heard) == ("open", 12.0, ["open", "closed"])


def test_an_adopted_half_open_breaker_refuses_calls_until_the_probe_elsewhere_expires(
    clock: Clock,
) -> None:
    # Given a breaker another process is probing for 20 more seconds
    breaker = make_breaker(clock)
    breaker.adopt("half_open", 20.0)
    # Then this process sends nothing meanwhile
    assert (breaker.state, breaker.admit()) == ("half_open", None)
    # And once that probe's time is over, it may send the next probe
    clock.now += 20
    probe = breaker.admit()
    assert probe is not None and probe.probe
    # And adopting closed closes it, and ignores the outcome of the older permit
    breaker.adopt("closed")
    breaker.record(probe, False)
    assert breaker.state == "closed"
