"""PostgreSQL's claim in the default order as one statement (``claim_plain`` in
sql/postgres/queries.sql).

A claim without a claim policy or a route (the default) takes up to ``limit`` ready tasks
of its kinds in priority, then ready-time order, as the row path does (one index range
per kind, locked with ``SKIP LOCKED``); the row path then updates them, inserts their
events and adds the counts, each a round trip of its own in one transaction. Here the
locks, the update, the event rows (``claim``, and ``acquire`` for a kind that waits for no
resource), the counts and the counters are one statement: one round trip, one commit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from kiln.models import Task
from kiln.states import Status
from kiln.store.claims import log_claim
from kiln.store.pgtx import COUNTER_SHARDS
from kiln.store.rows import TASK_COLUMNS, task_from_row
from kiln.store.tx import Row

#: Where a claimed row's own columns end: then the status it left and its dwell there.
_SOURCE = len(TASK_COLUMNS)


def claim_args(
    worker_id: str,
    kinds: Sequence[str],
    limit: int,
    lease_ttl_s: float,
    acquire: Sequence[str],
    now: float,
) -> dict[str, Any]:
    """The named parameters of ``claim_plain``."""
    return {
        "kinds": list(dict.fromkeys(kinds)),  # each kind's line read once
        "acquire": [kind for kind in acquire if kind in kinds],
        "limit": limit,
        "now": now,
        "owner": worker_id,
        "expires": now + lease_ttl_s,
        "shard": random.randrange(COUNTER_SHARDS),
    }


def claimed_of(rows: Sequence[Row], worker_id: str) -> list[Task]:
    """The claimed tasks, in claim order, each claim (and acquire) logged."""
    claimed: list[Task] = []
    for row in rows:
        task = task_from_row(row)
        source, dwell = Status(row[_SOURCE]), float(row[_SOURCE + 1])
        log_claim(task, source, Status.WAITING_FOR_RESOURCE, dwell, worker_id)
        if task.status is Status.GENERATING:
            log_claim(task, Status.WAITING_FOR_RESOURCE, Status.GENERATING, 0.0, worker_id)
        claimed.append(task)
    return claimed
