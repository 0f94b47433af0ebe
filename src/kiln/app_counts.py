"""Counter bumps that arrive together, written together.

A burst of identical submissions answered by single-flight counts one dedup hit per copy
(``kiln_dedup_hits``). Each copy waits until its count is in the store, as the store's own
insert-or-get would have counted it, but the copies that arrive while a write is in flight
share the next one: one store write with the summed deltas instead of one per copy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping

#: Writes summed deltas, by counter label.
Write = Callable[[Mapping[str, int]], Awaitable[None]]


class BatchedCounts:
    """``await counts.add(label)``: returns once a write that holds it committed."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self._pending: Counter[str] = Counter()
        self._next: asyncio.Future[None] | None = None
        self._writing: asyncio.Task[None] | None = None

    async def add(self, label: str, delta: int = 1) -> None:
        self._pending[label] += delta
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        written = self._next
        if self._writing is None:
            self._writing = asyncio.ensure_future(self._drain())
        await asyncio.shield(written)

    async def _drain(self) -> None:
        """Write what is pending, then what came meanwhile, until nothing is."""
        try:
            while self._next is not None:
                written, self._next = self._next, None
                counts, self._pending = self._pending, Counter()
                try:
                    await self._write(counts)
                except Exception as exc:
                    written.set_exception(exc)
                    with contextlib.suppress(Exception):  # seen by its waiters, if any
                        written.exception()
                else:
                    written.set_result(None)
        finally:
            self._writing = None
