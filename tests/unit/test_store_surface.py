"""The store's surface stays grouped: the task lifecycle and its claims are the Store's own
methods, every other concern an object of its own on the store (docs/design.md, "The store
written once"). A new operation goes into its concern's object, or, for a new concern, into
a new object named here and in docs/design.md."""

from __future__ import annotations

import asyncio
import inspect
import time
from pathlib import Path

from kiln.states import Status
from kiln.store import bulk, inputs, load, outbox, pools, schedules, usage, workers
from kiln.store.bulk import BulkFilter
from kiln.store.queries import queries
from kiln.store.sqlite import SqliteStore
from kiln.store.sqlstore import Store
from kiln.store.tx import Concern

#: The Store's own public methods: the task lifecycle (submit, reads, leases, the fenced
#: compare-and-set, pipelines, the supervisor's reads, stats and counters, purge, the log's
#: tail), its claims and queue positions, and the driver's close.
CORE = frozenset(
    {
        "apply",
        "apply_many",
        "bump",
        "cancel_pipeline",
        "claim",
        "claim_batch",
        "close",
        "count_ghosts",
        "counters",
        "due",
        "events",
        "get",
        "get_many",
        "heartbeat",
        "last_seq",
        "lead",
        "list_tasks",
        "pipeline_steps",
        "progressed",
        "purge",
        "queue_position",
        "queue_positions",
        "read_dedup",
        "read_standing",
        "request_cancel",
        "request_yields",
        "retry_pipeline",
        "stats",
        "submit",
        "submit_pipeline",
        "tail",
        "trace",
        "watch_ready",
    }
)
#: Each other concern: the attribute of the store, and the class that holds its operations.
CONCERNS = {
    "schedules": schedules.Schedules,
    "outbox": outbox.Outbox,
    "inputs": inputs.Inputs,
    "keys": inputs.Keys,
    "workers": workers.Workers,
    "load": load.Load,
    "pools": pools.Pools,
    "limits": pools.Limits,
    "usage": usage.Usage,
    "bulk": bulk.Bulk,
}
#: What the store holds besides: the dialect's queries and the clock.
PARTS = frozenset({"q", "clock"})
#: What its driver says of itself: whether the log's events become visible in seq order.
TRAITS = frozenset({"commits_in_seq_order"})


def public(names: object) -> set[str]:
    return {name for name in dir(names) if not name.startswith("_")}


def operations(concern: type) -> set[str]:
    return {
        name
        for name, value in inspect.getmembers(concern, inspect.iscoroutinefunction)
        if not name.startswith("_")
    }


def test_the_store_has_no_flat_method_outside_the_task_and_claim_core() -> None:
    assert public(Store) == CORE | TRAITS


def test_every_other_concern_is_an_object_on_the_store() -> None:
    store = Store(queries("sqlite"), time.time)
    assert public(store) == CORE | TRAITS | PARTS | set(CONCERNS)
    for name, kind in CONCERNS.items():
        assert type(getattr(store, name)) is kind
        assert issubclass(kind, Concern)
        assert operations(kind), f"store.{name} has no operation"


def test_a_bulk_page_is_followed_by_its_drivers_hook(tmp_path: Path) -> None:
    # The SQLite driver's pause after a page is its hook, called by store.bulk with the
    # page's duration: not a second bulk_page of its own.
    took: list[float] = []

    class Recording(SqliteStore):
        async def _after_bulk_page(self, took_s: float) -> None:
            took.append(took_s)

    async def run() -> None:
        store = Recording(str(tmp_path / "kiln.db"), clock=time.time)
        try:
            found = BulkFilter(statuses=(Status.PENDING,))
            page = await store.bulk.page(found, None, 10, lambda task: None, 100)
            assert page.matched == 0
        finally:
            await store.close()

    asyncio.run(run())
    assert len(took) == 1 and took[0] >= 0.0
    assert "bulk_page" not in vars(SqliteStore)
