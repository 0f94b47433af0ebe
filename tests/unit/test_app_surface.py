"""The App shows of its engine only what the library's users and the faces read; the
rest is the engine's own (``app.engine.store``, ``app.engine.illegal_transitions``)."""

from __future__ import annotations

import inspect

import kiln
from kiln.app_engine import EngineParts
from kiln.config import Settings

#: The engine's parts the App shows, and why: ``settings`` and ``storage`` are documented
#: for handlers (docs/uploads.md, docs/scheduling.md); ``kinds``, ``hub``, ``now`` and
#: ``cancel_listeners`` are how the faces (the API, the command line) read the engine,
#: which they reach only through the App (docs/design.md, "One way in").
SHOWN = frozenset({"settings", "storage", "kinds", "hub", "cancel_listeners"})


def test_the_app_forwards_only_the_engine_parts_it_documents() -> None:
    properties = {name for name, value in vars(EngineParts).items() if isinstance(value, property)}
    assert properties == SHOWN


def test_the_store_is_the_engines_not_the_apps(settings: Settings) -> None:
    app = kiln.App(settings=settings)
    for name in ("store", "clock", "rng", "retry_policy", "wake", "illegal_transitions"):
        assert not hasattr(app, name), name
    assert inspect.ismethod(app.now)
