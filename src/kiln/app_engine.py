"""The App's engine parts, as attributes of the App (``app.settings``, ``app.kinds``,
``app.hub``, ``app.now()``, ...), and its lifecycle: ``async with app:`` opens the engine
and closes it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Self

from kiln.bus import EventHub
from kiln.config import Settings
from kiln.engine import Engine
from kiln.kinds import TaskKind
from kiln.retry import RetryPolicy
from kiln.storage import Storage
from kiln.store import Store

__all__ = ["EngineParts"]


class EngineParts:
    """What :class:`kiln.App` shows of its :attr:`engine`, and its opening and closing."""

    engine: Engine

    @property
    def settings(self) -> Settings:
        return self.engine.settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self.engine.settings = settings

    @property
    def kinds(self) -> dict[str, TaskKind]:
        return self.engine.kinds

    @property
    def clock(self) -> Callable[[], float] | None:
        return self.engine.clock

    @property
    def rng(self) -> random.Random:
        return self.engine.rng

    @property
    def retry_policy(self) -> RetryPolicy:
        return self.engine.retry_policy

    @property
    def illegal_transitions(self) -> int:
        """Transitions the state table refused in this process."""
        return self.engine.illegal_transitions

    @property
    def cancel_listeners(self) -> list[Callable[[str], None]]:
        return self.engine.cancel_listeners

    @property
    def store(self) -> Store:
        return self.engine.store

    @property
    def storage(self) -> Storage:
        return self.engine.storage

    @property
    def hub(self) -> EventHub:
        return self.engine.hub

    @property
    def wake(self) -> asyncio.Event:
        """Set when work became claimable; workers in this process wait on it."""
        return self.engine.wake

    def now(self) -> float:
        return self.engine.now()

    async def connect(self) -> None:
        """Reach the store now (PostgreSQL: connect and apply pending migrations)."""
        await self.engine.store.last_seq()

    async def open(self) -> Self:
        self.engine.open()
        return self

    async def close(self) -> None:
        await self.engine.close()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
