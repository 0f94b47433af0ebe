"""What a worker says of itself in the worker registry (kiln/presence.py)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

import kiln
from kiln.config import Settings
from kiln.errors import StoreUnavailable
from kiln.models import Output
from kiln.presence import keep_present
from kiln.store import WorkerRecord


class Holding:
    """A handler that holds models loaded, as a backend with a cache of pipelines does."""

    def __init__(self, *models: str) -> None:
        self.models = list(models)

    def loaded_models(self) -> list[str]:
        return self.models

    async def __call__(self, ctx: object, params: dict[str, object]) -> Output:
        return Output("x.txt", b"x", "text/plain")


def test_a_worker_says_who_it_is_what_it_takes_and_the_models_its_kinds_hold(
    settings: Settings,
) -> None:
    app = kiln.App(settings=settings.with_(kind_resources={"b.kind": {"vram-gb": 12}}))
    app.task("a.kind")(Holding("sdxl", "flux"))
    app.task("b.kind", resources={"gpu": 1})(Holding("flux", "upscaler"))

    @app.task("c.kind")
    async def plain(ctx: object, params: dict[str, object]) -> None:
        return None

    worker = app.worker(concurrency=3, worker_id="w-1")
    record = worker.presence()
    assert (record.id, record.host, record.pid) == ("w-1", socket.gethostname(), os.getpid())
    assert record.kinds == ("a.kind", "b.kind", "c.kind") and record.slots == 3
    assert record.resources == {"b.kind": {"gpu": 1, "vram-gb": 12}}
    assert record.models == ("sdxl", "flux", "upscaler")
    assert record.running == 0 and record.version


class FlakyRegistry:
    """A worker registry whose first beat fails (the database away), then answers."""

    def __init__(self) -> None:
        self.beats: list[WorkerRecord] = []
        self.stops: list[str] = []
        self.third = asyncio.Event()

    async def seen(self, record: WorkerRecord, *, ttl_s: float) -> WorkerRecord:
        if not self.beats and not self.stops:
            self.stops.append("")  # marks the failed first beat
            raise StoreUnavailable("the database does not answer")
        self.beats.append(record)
        if len(self.beats) >= 2:
            self.third.set()
        return record

    async def gone(self, worker_id: str) -> None:
        self.stops.append(worker_id)


class FlakyStore:
    """A store whose worker registry is :class:`FlakyRegistry`."""

    def __init__(self) -> None:
        self.workers = FlakyRegistry()


async def test_a_failed_beat_is_logged_the_next_goes_on_and_a_stop_says_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FlakyStore()
    record = WorkerRecord(id="w-9", host="h", pid=1, version="1", kinds=("k",), slots=1)
    beating = asyncio.create_task(
        keep_present(store, lambda: record, interval_s=0.001, ttl_s=1.0)  # type: ignore[arg-type]
    )
    await asyncio.wait_for(store.workers.third.wait(), timeout=5)
    beating.cancel()
    await asyncio.wait([beating])
    assert [r.id for r in store.workers.beats][:2] == ["w-9", "w-9"]
    assert store.workers.stops == ["", "w-9"]
    assert any(r.message == "worker_beat_failed" for r in caplog.records)
