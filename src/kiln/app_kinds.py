"""The App's task-kind registry: ``@app.task(name, ...)`` registers a handler and how its
tasks run, ``app.kind(name)`` finds one (``pipeline``, kiln's own, included)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import pydantic

from kiln import pipelines, transform
from kiln.engine import Engine
from kiln.kinds import (
    AmountsOf,
    BatchPolicy,
    Handler,
    InputCheck,
    ModelOf,
    ReviewCheck,
    TaskKind,
    find_kind,
)
from kiln.models import JSON, Timeouts
from kiln.retry import RetryPolicy

__all__ = ["KindRegistry"]


class KindRegistry:
    """The task kinds of :class:`kiln.App`, kept in its :attr:`engine`."""

    engine: Engine

    def task(
        self,
        name: str,
        *,
        params: type[pydantic.BaseModel] | None = None,
        resources: dict[str, int] | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        review: ReviewCheck | None = None,
        normalize: Callable[[JSON], JSON] | None = None,
        inputs: Sequence[str] = (),
        check: InputCheck | None = None,
        model: str | ModelOf | None = None,
        amounts: AmountsOf | None = None,
        batch: BatchPolicy | None = None,
    ) -> Callable[[Handler], Handler]:
        """Register ``handler(ctx, params)`` for tasks of kind ``name``.

        ``inputs`` names the files a task of this kind is submitted with; ``check`` refuses
        params that do not fit them (see :meth:`TaskKind.check_inputs`). ``model`` says
        which model a task needs: the name of a string param, or a function of the
        validated params (warm-model routing, docs/scheduling.md). ``amounts`` says how
        much of each pool a task takes, from its params (memory admission), over
        ``resources``. ``batch`` runs the kind's tasks in batches: the handler then takes
        lists, ``handler(ctxs, params)`` (:class:`BatchPolicy`).
        """

        def register(handler: Handler) -> Handler:
            if name in self.engine.kinds:
                raise ValueError(f"task kind {name!r} is already registered")
            options = (timeouts, retry, review, normalize, tuple(inputs), check, model)
            kind = TaskKind(name, handler, params, dict(resources or {}), *options, amounts, batch)
            self.engine.kinds[name] = kind
            return handler

        return register

    def kind(self, name: str) -> TaskKind:
        """The registered kind ``name``, or UnknownKind. ``pipeline`` is kiln's own
        (docs/pipelines.md): its params are checked step by step, no worker serves it."""
        if name == pipelines.KIND:
            return TaskKind(name, _no_handler, pipelines.Shape, normalize=self._plan_pipeline)
        return find_kind(self.engine.kinds, name)

    def _plan_pipeline(self, params: JSON) -> JSON:
        limit = self.engine.settings.max_image_pixels
        fits = functools.partial(transform.check_sheet_size, max_pixels=limit)
        return pipelines.plan(params, self.kind, transform.outputs_of, fits)


async def _no_handler(ctx: Any, params: Any) -> None:
    raise AssertionError("a pipeline is never claimed")
