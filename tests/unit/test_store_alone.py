"""``kiln.store.tx.alone``: an operation refused in its savepoint takes its counts back
in the tally the driver adds up, and the counts after it land there too."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from kiln.errors import Conflict
from kiln.states import Status
from kiln.store.tx import Counting, Tally, Tx, alone


class OneTally(Counting):
    """The part of a driver's transaction ``alone`` uses: the tally (the one the driver
    flushes at commit, as SQLite's connection holds it) and savepoints."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally

    @contextlib.asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        yield


async def test_a_refused_operation_takes_its_counts_back_in_the_flushed_tally() -> None:
    # Given a transaction whose driver flushes this tally at commit, one count in it
    flushed = Tally()
    tx = OneTally(flushed)
    tx.count_status("acme", Status.PENDING, 1)

    async def refused(inner: Tx) -> None:
        inner.count_status("acme", Status.PENDING, -1)
        inner.count_status("acme", Status.CANCELLED, 1)
        raise Conflict("changed meanwhile")

    async def accepted(inner: Tx) -> str:
        inner.count_status("acme", Status.RETRYING, 1)
        return "done"

    # When one operation is refused in its savepoint and the next one goes through
    assert isinstance(await alone(tx, refused), Conflict)  # type: ignore[arg-type]
    assert await alone(tx, accepted) == "done"  # type: ignore[arg-type]
    # Then the flushed tally holds the first count and the last, not the refused ones
    assert tx.tally is flushed
    assert flushed.rows("task_counts") == [("acme", "PENDING", 1), ("acme", "RETRYING", 1)]
