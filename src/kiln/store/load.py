"""What the queue asks of the workers now: the store's side of the autoscaling signals.

One read transaction, three small queries, each through an index of live tasks only (the
claim index, the lease index, the pools' lines), so its cost follows the backlog and the
work in hand, never the finished history. :mod:`kiln.autoscaling` folds the rows, with the
worker registry, into the signals ``/metrics`` and ``/v1/stats`` show.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.store.tx import Concern, Driver, Tx


@dataclass(frozen=True, slots=True)
class QueueLoad:
    """The queue as one read saw it, at ``at`` (the store's clock)."""

    at: float
    #: (kind, ready tasks, oldest ready_at) per kind with ready tasks.
    ready: tuple[tuple[str, int, float], ...]
    #: (kind, status, ready_at) of each claimed task (WAITING_FOR_RESOURCE, GENERATING,
    #: UPLOADING).
    claimed: tuple[tuple[str, str, float], ...]
    #: (pool, held, since) of each live row of a pool's line.
    lines: tuple[tuple[str, bool, float], ...]


class Load(Concern[Driver]):
    """The queue's load (``store.load``)."""

    async def read(self) -> QueueLoad:
        """Ready tasks per kind, the claimed tasks, the pools' live lines, in one read."""
        now = self.clock()

        async def read(tx: Tx) -> QueueLoad:
            ready = await tx.all(self.q.ready_by_kind, (now,))
            claimed = await tx.all(self.q.claimed_tasks)
            lines = await tx.all(self.q.pool_line_rows, (now,))
            return QueueLoad(
                at=now,
                ready=tuple((str(k), int(n), float(oldest)) for k, n, oldest in ready),
                claimed=tuple((str(k), str(s), float(at)) for k, s, at in claimed),
                lines=tuple((str(p), bool(held), float(since)) for p, held, since in lines),
            )

        return await self._read(read)
