"""In-process single-flight: concurrent identical calls share one execution.

An optimisation in front of the store, never the guarantee: the store's unique indexes
decide what exists. The first caller of a key runs the call; callers that arrive while it
runs wait for the same outcome (its result or its exception).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._flights: dict[Hashable, asyncio.Future[T]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    async def run(self, key: Hashable, call: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """``(result, led)``: ``led`` is True for the caller whose call actually ran."""
        flight = self._flights.get(key)
        if flight is not None:
            return await asyncio.shield(flight), False
        flight = asyncio.ensure_future(self._fly(key, call))
        flight.add_done_callback(_retrieve)
        self._flights[key] = flight
        return await asyncio.shield(flight), True

    async def _fly(self, key: Hashable, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        finally:
            self._flights.pop(key, None)


def _retrieve(flight: asyncio.Future[T]) -> None:
    """Mark the outcome as seen, for a flight whose callers all went away."""
    if not flight.cancelled():
        flight.exception()
