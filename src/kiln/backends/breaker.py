"""A circuit breaker for one upstream, in one process: closed → open → half-open → closed.

Closed: every call goes through; the breaker opens after ``failure_threshold`` failures in
a row, or when at least ``failure_rate`` of the last ``window`` calls failed. Open: calls
are refused without touching the upstream until ``cooldown_s`` has passed. Half-open: one
probe goes through; its success closes the breaker, its failure opens it for another
cool-down. A call admitted before the breaker opened reports into an old generation and
is ignored, so only the probe decides in half-open.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True)
class Permit:
    """One admitted call: report its outcome with :meth:`CircuitBreaker.record`."""

    generation: int
    probe: bool


class CircuitBreaker:
    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        window: int = 20,
        failure_rate: float = 0.5,
        cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.failure_rate = failure_rate
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._failures: deque[bool] = deque(maxlen=window)  # True for a failed call
        self._in_a_row = 0
        self._opened_at: float | None = None
        self._probing = False
        self._generation = 0

    @property
    def state(self) -> State:
        if self._opened_at is None:
            return "closed"
        if self._probing or self.clock() - self._opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def admit(self) -> Permit | None:
        """A permit for one call, or None: the breaker is open (or its probe is out)."""
        state = self.state
        if state == "closed":
            return Permit(self._generation, probe=False)
        if state == "half_open" and not self._probing:
            self._probing = True
            return Permit(self._generation, probe=True)
        return None

    def retry_after_s(self) -> float:
        """How long until the breaker lets a probe through (0 when it would now)."""
        if self._opened_at is None:
            return 0.0
        return max(0.0, self._opened_at + self.cooldown_s - self.clock())

    def record(self, permit: Permit, ok: bool) -> None:
        """The outcome of an admitted call: ``ok`` when the upstream answered as it should."""
        if permit.generation != self._generation:
            return  # admitted before the breaker last opened or closed: no say now
        if permit.probe:
            self._probing = False
            if ok:
                self._close()
            else:
                self._open()
            return
        self._failures.append(not ok)
        self._in_a_row = 0 if ok else self._in_a_row + 1
        full = len(self._failures) == self._failures.maxlen
        rate = sum(self._failures) / len(self._failures)
        if self._in_a_row >= self.failure_threshold or (full and rate >= self.failure_rate):
            self._open()

    def release(self, permit: Permit) -> None:
        """An admitted call ended with no verdict (cancelled): a probe may go out again."""
        if permit.probe and permit.generation == self._generation:
            self._probing = False

    def _open(self) -> None:
        self._opened_at = self.clock()
        self._generation += 1

    def _close(self) -> None:
        self._opened_at = None
        self._failures.clear()
        self._in_a_row = 0
        self._generation += 1
