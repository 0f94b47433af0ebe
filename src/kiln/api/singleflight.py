"""In-process single-flight: concurrent identical calls share one execution.

An optimisation in front of the store, never the guarantee: the store's unique indexes
decide what exists. The first caller of a key runs the call in its own task (no task or
future of its own: a submission's answer takes no extra turns of the event loop); callers
that arrive while it runs wait for the same outcome (its result or its exception). Should
the first caller be cancelled before its call ends, those waiting run the call afresh, one
of them first again (the store answers them as it would have answered the first).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class _LeaderGone(Exception):
    """The caller running the call was cancelled before it ended."""


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._flights: dict[Hashable, asyncio.Future[T]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    async def run(self, key: Hashable, call: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """``(result, led)``: ``led`` is True for the caller whose call actually ran."""
        while (flight := self._flights.get(key)) is not None:
            try:
                return await asyncio.shield(flight), False
            except _LeaderGone:
                continue  # lead it, or follow whoever leads it now
        flight = asyncio.get_running_loop().create_future()
        self._flights[key] = flight
        try:
            result = await call()
        except asyncio.CancelledError:
            _end(flight, _LeaderGone())
            raise
        except BaseException as exc:
            _end(flight, exc)
            raise
        finally:
            del self._flights[key]
        flight.set_result(result)
        return result, True


def _end(flight: asyncio.Future[T], exc: BaseException) -> None:
    """The outcome for those waiting, marked as seen (there may be none)."""
    flight.set_exception(exc)
    flight.exception()
