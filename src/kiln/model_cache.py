"""The models one worker process holds loaded, within a memory budget.

A handler that loads models keeps them in a :class:`ModelCache` and uses one through it::

    async with cache.use(ctx, name, load, size_gb=6.5) as pipe:
        ...

The first use of a model loads it, as the attempt's ``loading_model`` stage
(``ctx.loading_model``: timed in ``kiln_model_load_seconds``); later uses find it loaded.
Before a load, the least recently used models no attempt is using are unloaded until the
new one fits ``KILN_MODEL_MEMORY_GB`` and the cache holds fewer than
``KILN_MAX_LOADED_MODELS`` (:data:`DEFAULT_MAX_MODELS` unless set: a process with no memory
limit still holds a bounded number, however many model names its tasks bring); when the
room is held by models in use, the load waits for them. One model loads once however
many attempts ask for it at the same time. The cache says what it holds with
:meth:`ModelCache.loaded_models` (least recently used first), which is what the worker
registry lists and what warm-model routing reads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from kiln.worker import Context

M = TypeVar("M")
log = logging.getLogger("kiln.worker")

#: The most models a cache holds loaded at once unless told otherwise
#: (``KILN_MAX_LOADED_MODELS``'s default).
DEFAULT_MAX_MODELS = 8


@dataclass(slots=True)
class _Entry(Generic[M]):
    model: M
    size_gb: float
    users: int = 0


class ModelCache(Generic[M]):
    """Loaded models by name, least recently used first, within ``budget_gb`` (None: no
    memory limit) and at most ``max_models`` of them (loads under way counted).
    ``unload(name, model)`` frees what a model holds when it is evicted."""

    def __init__(
        self,
        budget_gb: float | None = None,
        unload: Callable[[str, M], None] | None = None,
        *,
        max_models: int = DEFAULT_MAX_MODELS,
    ) -> None:
        if max_models < 1:
            raise ValueError("a model cache holds at least one model")
        self.budget_gb = budget_gb
        self.max_models = max_models
        self._unload = unload
        self._entries: collections.OrderedDict[str, _Entry[M]] = collections.OrderedDict()
        #: Room taken by loads under way: (models, GiB).
        self._reserved: tuple[int, float] = (0, 0.0)
        self._loading: dict[str, asyncio.Lock] = {}
        self._released = asyncio.Condition()
        #: Models unloaded to make room, over this cache's life.
        self.evictions = 0

    def loaded_models(self) -> list[str]:
        """The models held, least recently used first."""
        return list(self._entries)

    @property
    def used_gb(self) -> float:
        return sum(entry.size_gb for entry in self._entries.values())

    @contextlib.asynccontextmanager
    async def use(
        self, ctx: Context, name: str, load: Callable[[], Awaitable[M]], *, size_gb: float
    ) -> AsyncIterator[M]:
        """``name``'s model, loaded first when it is not held; it is not evicted while in
        use."""
        entry = await self._held(ctx, name, load, size_gb)
        entry.users += 1
        try:
            yield entry.model
        finally:
            entry.users -= 1
            async with self._released:
                self._released.notify_all()

    async def _held(
        self, ctx: Context, name: str, load: Callable[[], Awaitable[M]], size_gb: float
    ) -> _Entry[M]:
        entry = self._entries.get(name)
        if entry is None:
            lock = self._loading.setdefault(name, asyncio.Lock())
            async with lock:  # one load per model; the others wait for it
                entry = self._entries.get(name)
                if entry is None:
                    await self._make_room(name, size_gb)
                    try:
                        async with ctx.loading_model(name):
                            model = await load()
                        entry = self._entries[name] = _Entry(model, size_gb)
                    finally:
                        await self._unreserve(size_gb)
        self._entries.move_to_end(name)
        return entry

    def _fits(self, size_gb: float) -> bool:
        """Whether one more model of ``size_gb`` fits beside those held and loading."""
        count, reserved_gb = self._reserved
        if len(self._entries) + count >= self.max_models:
            return False
        budget = self.budget_gb
        return budget is None or self.used_gb + reserved_gb + size_gb <= budget

    async def _make_room(self, name: str, size_gb: float) -> None:
        """Unload idle models, least recently used first, until one more of ``size_gb``
        fits; wait for models in use (or loading) to be released while it does not. The
        room found is reserved until the load ends."""
        budget = self.budget_gb
        if budget is not None and size_gb > budget:
            log.warning(
                "model_over_budget", extra={"model": name, "size_gb": size_gb, "budget_gb": budget}
            )
        async with self._released:
            while not self._fits(size_gb):
                for held in list(self._entries):
                    entry = self._entries[held]
                    if entry.users == 0:
                        self._evict(held, entry)
                    if self._fits(size_gb):
                        break
                if self._fits(size_gb) or not (self._entries or self._reserved[0]):
                    break
                await self._released.wait()
            count, reserved_gb = self._reserved
            self._reserved = (count + 1, reserved_gb + size_gb)

    async def _unreserve(self, size_gb: float) -> None:
        async with self._released:
            count, reserved_gb = self._reserved
            self._reserved = (count - 1, reserved_gb - size_gb)
            self._released.notify_all()

    def _evict(self, name: str, entry: _Entry[M]) -> None:
        del self._entries[name]
        self.evictions += 1
        log.info("model_unloaded", extra={"model": name, "size_gb": entry.size_gb})
        if self._unload is not None:
            self._unload(name, entry.model)
