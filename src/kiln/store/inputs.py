"""Uploaded inputs and idempotency keys: what retention may delete, and when.

An input (``inputs/<sha256[:2]>/<sha256>``, kiln/inputs.py) is kept once per content and
may serve many tasks. The store knows, per input, which tasks refer to it (``task_inputs``,
written with each task and deleted with it), how many uploads hold it right now (``pins``:
from storing it until its task is submitted) and when it was last used. An input may go
when no task refers to it and nobody holds it.

Deleting one takes three steps, so that an upload of the same content never finds an object
that is about to vanish: the store marks the input (``deleting_at``), the caller deletes the
object, the store forgets the input. An upload that pins a marked input waits for the
deletion to end (:attr:`InputPins.busy`) and then writes the object again; a mark left by a
caller that died is taken over after ``STALE_S``. A pin whose upload died is ignored after
``STALE_S`` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.models import JSON
from kiln.store.rows import loads
from kiln.store.tx import Concern, Driver, Tx

#: How long a deletion under way, or a pin, is honoured before it counts as abandoned.
STALE_S = 3600.0


@dataclass(frozen=True, slots=True)
class InputPins:
    """What pinning some inputs came to.

    ``write``: pinned, and the caller must write the object (the store did not know the
    input, or took over an abandoned deletion). ``busy``: a deletion is under way, nothing
    pinned; ask again once it ended. The others are pinned, and their object is there unless
    something outside kiln removed it.
    """

    write: frozenset[str] = field(default_factory=frozenset)
    busy: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class Deletion:
    """Inputs marked for deletion at ``marked_at``: delete their objects, then ``forget``."""

    sha256s: tuple[str, ...]
    marked_at: float


@dataclass(frozen=True, slots=True)
class KnownObject:
    """Content a tenant has (by sha256): an earlier upload of one of its tasks (``record``,
    that task's input record), or else an output of one of its SUCCESS tasks (``output``:
    ``{"task_id", "name", "key", "content_type", "size"}``)."""

    sha256: str
    record: JSON | None = None
    output: JSON | None = None


class Inputs(Concern[Driver]):
    """Uploaded inputs (``store.inputs``): pins while an upload waits for its task, and
    the three steps of deleting one nobody uses."""

    async def pin(self, sha256s: Sequence[str]) -> InputPins:
        """Hold each input for an upload (count one pin, mark it used now), unless its
        deletion is under way. Release with :meth:`unpin` once the task is in."""
        now = self.clock()

        async def write(tx: Tx) -> InputPins:
            fresh: set[str] = set()
            busy: set[str] = set()
            for sha256 in sorted(set(sha256s)):  # rows locked in one order
                row = await tx.one(self.q.lock_input, (sha256,))
                if row is None:
                    await tx.run(self.q.new_input, (sha256, now))
                    fresh.add(sha256)
                    continue
                deleting_at = row[1]
                if deleting_at is not None and deleting_at >= now - STALE_S:
                    busy.add(sha256)
                    continue
                await tx.run(self.q.pin_input, (now, sha256))
                if deleting_at is not None:  # an abandoned deletion: the object may be gone
                    fresh.add(sha256)
            return InputPins(frozenset(fresh), frozenset(busy))

        return await self._write(write)

    async def unpin(self, sha256s: Sequence[str]) -> None:
        """Let go of inputs :meth:`pin` held (each once per pin)."""
        now = self.clock()
        rows = [(now, sha256) for sha256 in sha256s]

        async def write(tx: Tx) -> None:
            if rows:
                await tx.many(self.q.unpin_input, rows)

        await self._write(write)

    async def claim_unused(
        self, *, used_before: float, limit: int = 500, among: Sequence[str] | None = None
    ) -> Deletion:
        """Mark for deletion up to ``limit`` inputs that no task refers to, nobody holds,
        and that were last used before ``used_before`` (or, with ``among``, those of
        ``among`` whatever their last use), oldest first."""
        now = self.clock()
        stale = now - STALE_S
        args: tuple[Any, ...]
        if among is not None:
            sql, args = self.q.unused_among, (stale, stale, sorted(set(among)))
        else:
            sql, args = self.q.unused_inputs, (used_before, stale, stale, limit)

        async def write(tx: Tx) -> Deletion:
            found = tuple(row[0] for row in await tx.all(sql, args))
            if found:
                await tx.run(self.q.mark_deleting, (now, list(found)))
            return Deletion(found, now)

        return await self._write(write)

    async def forget(self, deletion: Deletion, sha256s: Sequence[str]) -> None:
        """The objects of ``sha256s`` (of ``deletion``) are gone: forget those inputs."""
        rows = [(sha256, deletion.marked_at) for sha256 in sha256s]

        async def write(tx: Tx) -> None:
            if rows:
                await tx.many(self.q.forget_input, rows)

        await self._write(write)

    async def known(self, sha256s: Sequence[str]) -> set[str]:
        """Which of ``sha256s`` the store knows or a task refers to (the reconciler's
        question: an object under ``inputs/`` that is neither is an orphan)."""
        if not sha256s:
            return set()
        wanted = sorted(set(sha256s))
        rows = await self._rows(self.q.known_inputs, (wanted, wanted), tuple)
        return {row[0] for row in rows}

    async def find_object(self, tenant: str, sha256: str) -> KnownObject | None:
        """The content ``sha256`` as ``tenant`` has it, or None when none of its tasks has
        it as an upload (``task_inputs``) or as an output (``task_outputs``, written by
        the database when a task becomes SUCCESS). Both lookups go through an index:
        nothing is read but the rows of that content."""

        async def read(tx: Tx) -> KnownObject | None:
            row = await tx.one(self.q.tenant_input, (sha256, tenant))
            if row is not None:
                for item in loads(row[0]) or []:
                    if item.get("sha256") == sha256 and "key" not in item:
                        return KnownObject(sha256, record=dict(item))
            row = await tx.one(self.q.tenant_output, (tenant, sha256))
            if row is None:
                return None
            names = ("task_id", "name", "key", "content_type", "size")
            return KnownObject(sha256, output=dict(zip(names, row, strict=True)))

        return await self._read(read)


class Keys(Concern[Driver]):
    """Idempotency keys (``store.keys``): kept ``KILN_IDEMPOTENCY_TTL_S``, then deleted."""

    async def expire(self, *, created_before: float, limit: int = 500) -> int:
        """Delete up to ``limit`` idempotency keys made before ``created_before``, oldest
        first (``KILN_IDEMPOTENCY_TTL_S``); how many went. The same key then makes a new
        task."""

        async def write(tx: Tx) -> int:
            return await tx.run(self.q.expire_keys, (created_before, limit))

        return await self._write(write)
