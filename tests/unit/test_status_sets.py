"""Every set of statuses is named once, beside the Status enum in kiln.states.

The check parses each module of ``src/kiln`` with ``ast`` and fails on a set, tuple or list
literal that spells two or more ``Status.X`` members anywhere but states.py: such a set is a
second name for one of the sets there (or a new one that belongs there). It runs on the
real tree and on planted sources, to show it can fail. The copies that cannot import the
Python sets (the API's ``Literal`` types, the dashboard's script, the first migration's
dedup index) are compared with them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

from kiln import states
from kiln.api.bulk_actions import CancelStatus, RetryStatus
from kiln.states import (
    ACTIVE,
    BEFORE_GENERATING,
    ENDED_UNSUCCESSFULLY,
    FINAL,
    HOLDS_SLOT,
    MAY_HAVE_OUTPUTS,
    RULES,
    Event,
    Status,
)
from kiln.store.queries import queries, status_set

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "kiln"
#: Names a module may give the enum (``S = Status`` in states.py and the tests).
ENUM_NAMES = {"Status", "S"}


def status_literals(source: str) -> list[tuple[int, list[str]]]:
    """(line, members) of each set/tuple/list literal naming two or more Status members."""
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Set | ast.Tuple | ast.List):
            continue
        members = [
            element.attr
            for element in node.elts
            if isinstance(element, ast.Attribute)
            and isinstance(element.value, ast.Name)
            and element.value.id in ENUM_NAMES
        ]
        if len(members) >= 2:
            found.append((node.lineno, members))
    return found


def test_no_status_set_is_spelled_outside_states() -> None:
    spelled = [
        f"{path.relative_to(ROOT)}:{line} {members}"
        for path in sorted(SRC.rglob("*.py"))
        if path != SRC / "states.py"
        for line, members in status_literals(path.read_text(encoding="utf-8"))
    ]
    assert spelled == [], "name these sets in kiln/states.py and import them"


@pytest.mark.parametrize(
    "source",
    [
        "NOT_LIVE = frozenset({Status.FAILED, Status.TIMEOUT, Status.CANCELLED})",
        "ok = task.status in (Status.GENERATING, Status.UPLOADING)",
        "x = [S.PENDING, S.RETRYING]",
        "a, b = Status.WAITING_FOR_RESOURCE, Status.GENERATING",
    ],
)
def test_the_check_finds_a_planted_set(source: str) -> None:
    assert len(status_literals(source)) == 1


@pytest.mark.parametrize(
    "source",
    [
        "ok = task.status is Status.FAILED",
        "names = {Status.FAILED: 'failed', Status.TIMEOUT: 'expired'}",  # a mapping
        "ok = task.status in ENDED_UNSUCCESSFULLY",
    ],
)
def test_the_check_passes_what_is_no_set(source: str) -> None:
    assert status_literals(source) == []


def test_the_sets_hold_what_their_names_say() -> None:
    assert FINAL - {Status.SUCCESS} == ENDED_UNSUCCESSFULLY
    assert RULES[Event.RETRY].sources == ENDED_UNSUCCESSFULLY
    assert RULES[Event.RECOVER].sources == MAY_HAVE_OUTPUTS
    assert RULES[Event.CLAIM].sources | RULES[Event.ACQUIRE].sources == BEFORE_GENERATING
    assert HOLDS_SLOT < states.RUNNING and Status.UPLOADING not in HOLDS_SLOT
    assert frozenset(Status) - FINAL == ACTIVE


def test_the_copies_outside_python_match_the_sets() -> None:
    assert set(get_args(RetryStatus)) == ENDED_UNSUCCESSFULLY
    assert set(get_args(CancelStatus)) == ACTIVE
    script = (SRC / "dashboard" / "ui.js").read_text(encoding="utf-8")
    for name, statuses in {"RETRYABLE": ENDED_UNSUCCESSFULLY, "CANCELLABLE": ACTIVE}.items():
        body = re.search(rf"export const {name} = new Set\(\[(.*?)\]\)", script, re.S)
        assert body is not None, name
        assert set(re.findall(r'"([A-Z_]+)"', body.group(1))) == statuses, name
    for dialect in ("sqlite", "postgres"):
        init = (SRC / "store" / "sql" / dialect / "0001_init.sql").read_text(encoding="utf-8")
        assert f"status NOT IN {status_set(ENDED_UNSUCCESSFULLY)}" in init, dialect


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_the_sql_tokens_render_the_named_sets(dialect: str) -> None:
    submit = queries(dialect).dedup_lookup
    assert status_set(ENDED_UNSUCCESSFULLY) in submit
    assert "{" not in submit
