"""The App's engine parts, as attributes of the App (``app.settings``, ``app.kinds``,
``app.hub``, ``app.now()``, ...), and its lifecycle: ``async with app:`` opens the engine
and closes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

from kiln.bus import EventHub
from kiln.config import Settings
from kiln.engine import Engine
from kiln.kinds import TaskKind
from kiln.storage import Storage

__all__ = ["EngineParts"]


class EngineParts:
    """What :class:`kiln.App` shows of its :attr:`engine`, and its opening and closing.

    Only what the faces and the library's users read of the engine is shown here: the
    settings and the storage (docs/uploads.md, docs/scheduling.md), the kinds, the hub,
    the clock's ``now()`` and the cancel listeners (the faces reach the engine through the
    App: docs/design.md, "One way in"). Anything else is the engine's: ``app.engine``
    (``app.engine.store``, ``app.engine.illegal_transitions``, ...).
    """

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
    def cancel_listeners(self) -> list[Callable[[str], None]]:
        return self.engine.cancel_listeners

    @property
    def storage(self) -> Storage:
        return self.engine.storage

    @property
    def hub(self) -> EventHub:
        return self.engine.hub

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
