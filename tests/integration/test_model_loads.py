"""A handler's model load as its attempt's stage, timed per model (kiln/model_loads.py)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import kiln
from kiln.app import running
from kiln.bus import ProgressEvent
from kiln.config import Settings
from kiln.errors import Permanent
from kiln.model_loads import ModelLoadMetrics
from kiln.states import Status
from kiln.worker import Context


class Loader:
    """A kind that loads the model its params name once per process, then keeps it."""

    def __init__(self) -> None:
        self.loaded: dict[str, object] = {}

    def loaded_models(self) -> list[str]:
        return list(self.loaded)

    async def __call__(self, ctx: Context, params: dict[str, Any]) -> None:
        model = str(params["model"])
        if model not in self.loaded:
            async with ctx.loading_model(model):
                if model == "broken":
                    raise Permanent("the checkpoint is damaged", code="model_not_found")
                self.loaded[model] = object()


async def test_a_model_load_is_a_stage_timed_per_model_and_a_failed_one_counts_nothing(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = kiln.App(settings=settings)
    app.task("test.load")(Loader())
    stages: list[tuple[str, str | None]] = []
    publish = app.engine.publish_progress

    def published(event: ProgressEvent) -> None:  # every live progress, as streams get it
        stages.append((event.task_id, event.stage))
        publish(event)

    monkeypatch.setattr(app.engine, "publish_progress", published)
    async with app:
        # Given three tasks: two on model a (loaded once), one on a damaged checkpoint
        ids = [(await app.submit("test.load", {"model": m, "n": n})).task.id
               for n, m in enumerate(["a", "a", "broken"])]  # fmt: skip
        worker = app.worker(concurrency=1, idle_poll_s=(0.01, 0.05))
        # When a worker runs them
        async with running(worker.run()):
            done = [await app.wait(task_id, timeout_s=30) for task_id in ids]
    # Then the first showed the loading_model stage, the second loaded nothing
    assert [t.status for t in done] == [Status.SUCCESS, Status.SUCCESS, Status.FAILED]
    assert (ids[0], "loading_model") in stages and (ids[1], "loading_model") not in stages
    # And model a's one load was timed; the failed load counts nothing
    assert set(worker.model_loads.by_model) == {"a"}
    assert worker.model_loads.by_model["a"].count == 1
    assert worker.presence().models == ("a",)
    # And the histogram says so
    registry = CollectorRegistry()
    registry.register(ModelLoadMetrics(worker.model_loads))
    text = generate_latest(registry).decode()
    assert 'kiln_model_load_seconds_count{model="a"} 1.0' in text
    assert 'kiln_model_load_seconds_bucket{le="+Inf",model="a"} 1.0' in text
