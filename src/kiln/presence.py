"""A worker process in the store's worker registry (``store/workers.py``): registered
when it starts, its row renewed every beat (attempts in hand, models loaded), deleted when
it stops cleanly. A worker that dies stops beating; its row lapses after one lease.

A task kind's handler may say which models it holds loaded with a ``loaded_models()``
method (the ``image.generate`` handler asks its backend the same way); they are listed
with the worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata

from kiln.errors import StoreUnavailable
from kiln.kinds import TaskKind
from kiln.store import Store, WorkerRecord

log = logging.getLogger("kiln.worker")

#: How long a stopping worker waits to delete its row (else the row lapses by itself).
GONE_TIMEOUT_S = 2.0


@functools.cache
def version() -> str:
    """kiln's installed version ("0.0.0" when run from a source tree not installed)."""
    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def models_loaded(kinds: Iterable[TaskKind]) -> tuple[str, ...]:
    """The models the kinds' handlers hold loaded, each once, in the order they say."""
    found: dict[str, None] = {}
    for kind in kinds:
        loaded = getattr(kind.handler, "loaded_models", None)
        if callable(loaded):
            found.update(dict.fromkeys(str(model) for model in loaded()))
    return tuple(found)


def identity(
    worker_id: str, kinds: Mapping[str, TaskKind], slots: int, needs: Mapping[str, dict[str, int]]
) -> WorkerRecord:
    """What a worker says of itself but for what changes (attempts, models)."""
    return WorkerRecord(
        id=worker_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        version=version(),
        kinds=tuple(kinds),
        slots=slots,
        resources={k: dict(n) for k, n in needs.items() if k in kinds and any(n.values())},
    )


async def keep_present(
    store: Store,
    record: Callable[[], WorkerRecord],
    *,
    interval_s: float,
    ttl_s: float,
    peers: Callable[[list[WorkerRecord]], None] | None = None,
) -> None:
    """Say ``record()`` to the store now and every ``interval_s``, listed for ``ttl_s``
    after each, and hand ``peers`` the live workers read after each; until cancelled, then
    say the worker is gone (best effort)."""
    worker_id = record().id
    try:
        while True:
            try:
                await store.workers.seen(record(), ttl_s=ttl_s)
                if peers is not None:
                    peers(await store.workers.live())
            except Exception as exc:  # the next beat tries again; the claims go on meanwhile
                error = exc.message if isinstance(exc, StoreUnavailable) else repr(exc)
                log.warning("worker_beat_failed", extra={"error": error})
            await asyncio.sleep(interval_s)
    finally:
        try:
            async with asyncio.timeout(GONE_TIMEOUT_S):
                await store.workers.gone(worker_id)
        except Exception as exc:  # a store closed or away: the row lapses by itself
            log.debug("worker_gone_failed", extra={"error": str(exc) or type(exc).__name__})
