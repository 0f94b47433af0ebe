"""A circuit breaker for one upstream dependency: closed → open → half-open → closed.

Closed: every call goes through; the breaker opens after ``failure_threshold`` failures in
a row (when set), or when at least ``min_calls`` calls are on record and ``failure_rate``
of them failed. The record holds the last ``window`` calls (when set), and only those of
the last ``window_s`` seconds (when set). Open: calls are refused without touching the
upstream until ``cooldown_s`` has passed. Half-open: one probe goes through; its success
closes the breaker, its failure opens it for another cool-down. A call admitted before the
breaker opened reports into an old generation and is ignored, so only the probe decides in
half-open.

The breaker itself lives in one process. :mod:`kiln.breakers` shares its state through the
store: ``listeners`` hear each transition this process decides, and :meth:`adopt` takes a
state another process decided.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kiln.config import Settings

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
        failure_threshold: int | None = 5,
        window: int | None = 20,
        failure_rate: float = 0.5,
        cooldown_s: float = 30.0,
        min_calls: int | None = None,
        window_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.failure_rate = failure_rate
        self.min_calls = min_calls if min_calls is not None else max(window or 1, 1)
        self.window = window
        self.window_s = window_s
        self.cooldown_s = cooldown_s
        self.clock = clock
        #: Called with the new state on each transition this process decides (not adopted).
        self.listeners: list[Callable[[State], None]] = []
        self._calls: deque[tuple[float, bool]] = deque()  # (when, failed)
        self._failed = 0
        self._in_a_row = 0
        self._opened_at: float | None = None
        self._probing = False
        self._elsewhere = False  # another process holds the half-open probe
        self._generation = 0

    @classmethod
    def from_settings(
        cls, settings: Settings, clock: Callable[[], float] = time.time
    ) -> CircuitBreaker:
        """The breaker the KILN_BREAKER_* settings describe: a failure rate over a time
        window, no count of failures in a row."""
        return cls(
            failure_threshold=None,
            window=None,
            failure_rate=settings.breaker_failure_rate,
            min_calls=settings.breaker_min_calls,
            window_s=settings.breaker_window_s,
            cooldown_s=settings.breaker_open_s,
            clock=clock,
        )

    @property
    def state(self) -> State:
        if self._opened_at is None:
            return "closed"
        if self._probing or self._elsewhere or self._due():
            return "half_open"
        return "open"

    def _due(self) -> bool:
        return self._opened_at is not None and self.clock() - self._opened_at >= self.cooldown_s

    def admit(self) -> Permit | None:
        """A permit for one call, or None: the breaker is open (or its probe is out)."""
        if self._opened_at is None:
            return Permit(self._generation, probe=False)
        if not self._probing and self._due():
            self._probing = True
            self._elsewhere = False
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
        self._remember(not ok)
        self._in_a_row = 0 if ok else self._in_a_row + 1
        in_a_row = self.failure_threshold is not None and self._in_a_row >= self.failure_threshold
        enough = len(self._calls) >= self.min_calls
        if in_a_row or (enough and self._failed / len(self._calls) >= self.failure_rate):
            self._open()

    def _remember(self, failed: bool) -> None:
        now = self.clock()
        self._calls.append((now, failed))
        self._failed += failed
        while self._calls and (
            (self.window is not None and len(self._calls) > self.window)
            or (self.window_s is not None and self._calls[0][0] <= now - self.window_s)
        ):
            self._failed -= self._calls.popleft()[1]

    def release(self, permit: Permit) -> None:
        """An admitted call ended with no verdict (cancelled): a probe may go out again."""
        if permit.probe and permit.generation == self._generation:
            self._probing = False

    def adopt(self, state: State, remaining_s: float = 0.0) -> None:
        """Take the state another process decided: open (or half-open, its probe out) for
        ``remaining_s`` more seconds, or closed. Listeners are not told."""
        if state == "closed":
            self._reset()
            return
        self._reset()
        self._opened_at = self.clock() + remaining_s - self.cooldown_s
        self._elsewhere = state == "half_open" and remaining_s > 0

    def _open(self) -> None:
        self._reset()
        self._opened_at = self.clock()
        self._tell("open")

    def _close(self) -> None:
        self._reset()
        self._tell("closed")

    def _reset(self) -> None:
        self._opened_at = None
        self._calls.clear()
        self._failed = 0
        self._in_a_row = 0
        self._probing = False
        self._elsewhere = False
        self._generation += 1

    def _tell(self, state: State) -> None:
        for listener in self.listeners:
            listener(state)
