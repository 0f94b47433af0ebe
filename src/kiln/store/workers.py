"""The worker processes, as the store knows them: each keeps a row fresh with its beat.

A worker registers when it starts and says it is alive every beat (its id, host, pid,
version, kinds, slots, attempts in hand, the resources its kinds take, the models it holds
loaded). A row whose beat lapsed (``expires_at`` passed: a crash, a pause, a lost machine)
is a worker gone: it is no longer listed, and its row is deleted :data:`FORGET_AFTER_S`
later. A worker that stops cleanly deletes its row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from kiln.models import iso
from kiln.store.rows import dumps
from kiln.store.tx import Concern, Driver, Row, Tx

#: How long the row of a worker gone is kept after its beat lapsed.
FORGET_AFTER_S = 3600.0


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker process as it last said it was."""

    id: str
    host: str
    pid: int
    version: str
    kinds: tuple[str, ...]
    slots: int
    running: int = 0
    #: What each of its kinds takes (``{kind: {pool: units}}``), kinds that take none left out.
    resources: dict[str, dict[str, int]] = field(default_factory=dict)
    #: The models it holds loaded, least recently used first.
    models: tuple[str, ...] = ()
    started_at: float = 0.0
    seen_at: float = 0.0
    expires_at: float = 0.0

    def to_json(self) -> dict[str, object]:
        """The wire form (``GET /v1/workers``): times RFC 3339 UTC, as everywhere in the API."""
        return {
            "id": self.id,
            "host": self.host,
            "pid": self.pid,
            "version": self.version,
            "kinds": list(self.kinds),
            "slots": self.slots,
            "running": self.running,
            "resources": self.resources,
            "models": list(self.models),
            "started_at": iso(self.started_at),
            "last_seen_at": iso(self.seen_at),
            "expires_at": iso(self.expires_at),
        }


def worker_from_row(row: Row) -> WorkerRecord:
    return WorkerRecord(
        id=row[0],
        host=row[1],
        pid=int(row[2]),
        version=row[3],
        kinds=tuple(json.loads(row[4])),
        slots=int(row[5]),
        running=int(row[6]),
        resources=json.loads(row[7]),
        models=tuple(json.loads(row[8])),
        started_at=float(row[9]),
        seen_at=float(row[10]),
        expires_at=float(row[11]),
    )


class Workers(Concern[Driver]):
    """The worker registry (``store.workers``)."""

    async def seen(self, worker: WorkerRecord, *, ttl_s: float) -> WorkerRecord:
        """Register ``worker`` or renew its row (listed for ``ttl_s`` from now); the rows
        of workers gone long ago are deleted on the way."""
        now = self.clock()
        seen = replace(
            worker, started_at=worker.started_at or now, seen_at=now, expires_at=now + ttl_s
        )
        args = (
            seen.id,
            seen.host,
            seen.pid,
            seen.version,
            dumps(list(seen.kinds)),
            seen.slots,
            seen.running,
            dumps(seen.resources),
            dumps(list(seen.models)),
            seen.started_at,
            seen.seen_at,
            seen.expires_at,
        )

        async def write(tx: Tx) -> WorkerRecord:
            await tx.run(self.q.worker_seen, args)
            await tx.run(self.q.forget_workers, (now - FORGET_AFTER_S,))
            return seen

        return await self._write(write)

    async def gone(self, worker_id: str) -> None:
        """A worker stopped cleanly: it is no longer listed."""

        async def write(tx: Tx) -> None:
            await tx.run(self.q.worker_gone, (worker_id,))

        await self._write(write)

    async def live(self) -> list[WorkerRecord]:
        """The workers whose beat has not lapsed."""
        return await self._rows(self.q.live_workers, (self.clock(),), worker_from_row)
