"""The one way a status changes stays small: features add contributions, not parameters.

Parsed with ``ast`` (and the named queries read as the store reads them): the engine's
``apply`` and the store's ``Change`` keep to their budgets, the GPU-seconds of the ledger
are one SQL text, and PostgreSQL's statements over arrays are built from a description,
never by editing SQL text.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from kiln.store.queries import queries
from kiln.store.records import Change

ROOT = Path(__file__).resolve().parents[2]
KILN = ROOT / "src" / "kiln"
#: What a feature once added to a change as a field of its own.
FEATURE_FIELDS = {"usage", "loading_s", "pipeline_id", "counters", "leader", "bump_epoch"}


def _function(path: Path, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"no {cls}.{name} in {path}")


def test_engine_apply_takes_at_most_eight_parameters_in_at_most_sixty_lines() -> None:
    apply = _function(KILN / "engine.py", "Engine", "apply")
    arguments = apply.args
    parameters = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs][1:]
    assert len(parameters) <= 8, [a.arg for a in parameters]
    assert apply.end_lineno is not None
    assert apply.end_lineno - apply.lineno + 1 <= 60


def test_the_engine_class_is_under_four_hundred_lines_and_formatted() -> None:
    source = (KILN / "engine.py").read_text(encoding="utf-8")
    (engine,) = [
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Engine"
    ]
    assert engine.end_lineno is not None
    assert engine.end_lineno - engine.lineno + 1 < 400
    assert "fmt: skip" not in source


def test_a_change_carries_the_features_data_as_effects_not_fields() -> None:
    names = {f.name for f in dataclasses.fields(Change)}
    assert "effects" in names
    assert not names & FEATURE_FIELDS, names & FEATURE_FIELDS
    assert len(names) <= 8, names


def test_the_ledgers_gpu_seconds_are_one_sql_text() -> None:
    for dialect in ("sqlite", "postgres"):
        named = queries(dialect)
        writers = [n for n in named.names if "INSERT INTO usage_ledger" in getattr(named, n)]
        assert writers == ["usage_row"], (dialect, writers)
        reads = [
            n
            for n in named.names
            if re.search(r"from_status = 'GENERATING'", getattr(named, n))
            and "usage_ledger" in getattr(named, n)
        ]
        assert reads == ["usage_row"], (dialect, reads)


def test_postgres_statements_over_arrays_are_not_edited_sql_text() -> None:
    for module in ("pgbatch.py", "pgstep.py", "postgres.py"):
        tree = ast.parse((KILN / "store" / module).read_text(encoding="utf-8"))
        edits = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("replace", "removeprefix", "removesuffix")
        ]
        assert edits == [], (module, edits)
