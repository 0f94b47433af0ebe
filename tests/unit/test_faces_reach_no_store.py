"""No face reaches the store: the HTTP API (``kiln.api.*``) and the command line
(``kiln.cli.*``) call the App, never the store (docs/design.md, "One way in").

Each face module is parsed with ``ast``; the check fails on an import of ``kiln.store``
(any of its modules, at any place of the module, type-only imports included) and on any
use of an attribute named ``store`` (``app.store``, ``app.engine.store``, ``state.store``).
It runs on the real tree and on planted modules, to show it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KILN = ROOT / "src" / "kiln"
FACES = ("api", "cli")


def face_modules() -> list[Path]:
    """Every module of the faces that take requests: kiln.api.*, kiln.cli.*, kiln itself."""
    found = [KILN / "__init__.py", KILN / "__main__.py"]
    for face in FACES:
        found += sorted((KILN / face).rglob("*.py"))
    return found


def store_reaches(source: str) -> list[str]:
    """Where ``source`` reaches the store: ``line: what``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name == "kiln.store" or a.name.startswith("kiln.store.")
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            if module == "kiln.store" or module.startswith("kiln.store."):
                found.append(f"{node.lineno}: from {module} import ...")
            elif module == "kiln" and any(a.name == "store" for a in node.names):
                found.append(f"{node.lineno}: from kiln import store")
        elif isinstance(node, ast.Attribute) and node.attr == "store":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_face_module_imports_the_store_or_reaches_its_attribute() -> None:
    modules = face_modules()
    assert any(path.parent.name == "comfy" for path in modules)  # the walk finds them all
    reaches = {
        str(path.relative_to(ROOT)): found
        for path in modules
        if (found := store_reaches(path.read_text(encoding="utf-8")))
    }
    assert reaches == {}


@pytest.mark.parametrize(
    "planted",
    [
        "from kiln.store import ScheduleRecord\n",
        "from kiln.store.pools import PoolWait\n",
        "import kiln.store.usage\n",
        "from kiln import store\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.store import Store\n",
        "async def f(state):\n    return await state.app.store.schedule('x')\n",
        "async def f(app):\n    return await app.engine.store.last_seq()\n",
        "def f(app):\n    return lambda: app.store\n",
    ],
)
def test_the_check_fails_on_a_planted_reach(planted: str) -> None:
    assert store_reaches(planted) != []


def test_the_check_lets_the_app_be() -> None:
    planted = "from kiln.app import App\nasync def f(app):\n    return await app.get('t')\n"
    assert store_reaches(planted) == []
