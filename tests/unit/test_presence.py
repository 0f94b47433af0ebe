"""What a worker says of itself in the worker registry (kiln/presence.py)."""

from __future__ import annotations

import os
import socket

import kiln
from kiln.config import Settings
from kiln.models import Output


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
