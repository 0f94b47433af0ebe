"""The kept counts of the queue (``queue_counts``, ``queue_counts_of_tenant``) beside a
full recount of the tasks table: what a conformance test asserts after its changes."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kiln.store import Store

from .backends import Backend, Connection

QUEUED = "status IN ('PENDING', 'RETRYING')"


def _counted(rows: list[tuple[Any, ...]]) -> Counter[tuple[Any, ...]]:
    found: Counter[tuple[Any, ...]] = Counter()
    for *key, n in rows:
        found[tuple(key)] += int(n)
    return +found  # zero rows (a level emptied) are no difference


Counts = dict[str, Counter[tuple[Any, ...]]]


def kept_and_recounted(conn: Connection) -> tuple[Counts, Counts]:
    """(kept, recounted): per kind and priority, and per kind, tenant and priority."""
    kept = {
        "all": _counted(conn.rows("SELECT kind, priority, n FROM queue_counts")),
        "tenant": _counted(
            conn.rows("SELECT kind, tenant, priority, n FROM queue_counts_of_tenant")
        ),
    }
    by_level = "SELECT kind, priority, count(*) FROM tasks WHERE {} GROUP BY kind, priority"
    by_tenant = (
        "SELECT kind, tenant, priority, count(*) FROM tasks WHERE {}"
        " GROUP BY kind, tenant, priority"
    )
    recounted = {
        "all": _counted(conn.rows(by_level.format(QUEUED))),
        "tenant": _counted(conn.rows(by_tenant.format(QUEUED))),
    }
    return kept, recounted


def assert_kept_counts_agree(backend: Backend, store: Store) -> None:
    conn = backend.connect(store)
    try:
        kept, recounted = kept_and_recounted(conn)
    finally:
        conn.close()
    assert kept == recounted
