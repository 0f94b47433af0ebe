"""The store's SQL, by name, from ``.sql`` files, rendered for one dialect.

Queries live in ``sql/queries.sql`` (both dialects) and ``sql/<dialect>/queries.sql``
(what differs), as blocks::

    -- name --
    -- What the query does: (its parameters).
    SELECT ...

Parameters are written ``?`` (PostgreSQL gets ``%s``), or named, ``:name`` (PostgreSQL
gets ``%(name)s``; both drivers take a mapping of them), never both in one query.
``{NAME}`` tokens are rendered at load time: status sets from :mod:`kiln.states`
(``{CLAIMABLE}`` → ``('PENDING', 'RETRYING')``) and the few words the dialects spell
differently (``{FOR_UPDATE}``, ``{SKIP_LOCKED}``, ``{GREATEST}``, ``{IN_LIST}``, ...).
Every name is defined once per dialect: in the shared file or in the dialect's own, never
both.

SQL that is built from a request's shape (the columns a change sets, a listing's filters)
is written beside its builder with ``?`` and goes through :meth:`Queries.sql`.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from kiln.states import (
    CLAIMABLE,
    ENDED_UNSUCCESSFULLY,
    FINAL,
    HOLDS_SLOT,
    RUNNING,
    Status,
)

_BLOCK = re.compile(r"^-- ([a-z_][a-z0-9_]*) --$", re.MULTILINE)
_TOKEN = re.compile(r"\{([A-Z_]+)\}")
#: A named parameter, ``:name`` (not a ``::type`` cast, not inside a word).
_NAMED = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def status_set(statuses: frozenset[Status] | set[Status]) -> str:
    """A status set as an SQL list, in the order of the Status enum: ``('A', 'B')``."""
    return "(" + ", ".join(f"'{s}'" for s in Status if s in statuses) + ")"


_STATUS_SETS = {
    "CLAIMABLE": status_set(CLAIMABLE),
    "RUNNING": status_set(RUNNING),
    "FINAL": status_set(FINAL),
    "ENDED_UNSUCCESSFULLY": status_set(ENDED_UNSUCCESSFULLY),
    "HOLDS_SLOT": status_set(HOLDS_SLOT),
    "DEADLINE": status_set(CLAIMABLE | RUNNING),
}

_DIALECT_WORDS = {
    "sqlite": {
        "FOR_UPDATE": "",
        "FOR_SHARE": "",
        "FOR_KEY_SHARE": "",
        "SKIP_LOCKED": "",
        "GREATEST": "MAX",
        "IN_LIST": "IN (SELECT value FROM json_each(?))",
        "TRUE": "1",
        "FALSE": "0",
        "WAITING_S": "json_extract(timeouts, '$.waiting_s')",
        "GENERATING_S": "json_extract(timeouts, '$.generating_s')",
        "JOIN_POOLS": "group_concat(pool, ',')",
        "DAY": "strftime('%Y-%m-%d', ended_at, 'unixepoch')",
        "BY_DUE": "INDEXED BY tasks_due",
    },
    "postgres": {
        "FOR_UPDATE": "FOR UPDATE",
        "FOR_SHARE": "FOR SHARE",
        "FOR_KEY_SHARE": "FOR KEY SHARE",
        "SKIP_LOCKED": "FOR UPDATE SKIP LOCKED",
        "GREATEST": "GREATEST",
        "IN_LIST": "= ANY(?)",
        "TRUE": "true",
        "FALSE": "false",
        "WAITING_S": "(timeouts::jsonb->>'waiting_s')::float8",
        "GENERATING_S": "(timeouts::jsonb->>'generating_s')::float8",
        "JOIN_POOLS": "string_agg(pool, ',')",
        "DAY": "to_char(to_timestamp(ended_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
        "BY_DUE": "",
    },
}


class Queries:
    """Named SQL of one dialect: ``queries.get_task`` is ready to execute."""

    def __init__(self, dialect: str, named: dict[str, str]) -> None:
        self.dialect = dialect
        self._named = named
        self.__dict__.update(named)  # a plain attribute read on the hot path

    def __getattr__(self, name: str) -> str:
        """Only reached for a name that is not a query (the type checker's view)."""
        raise AttributeError(f"no query {name!r} for {self.dialect}")

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._named)

    def sql(self, text: str) -> str:
        """``text`` (written with ``?`` and tokens) in this dialect."""
        return _render(self.dialect, text)


@functools.lru_cache(maxsize=4096)
def _render(dialect: str, text: str) -> str:
    words = _DIALECT_WORDS[dialect]

    def token(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in _STATUS_SETS:
            return _STATUS_SETS[name]
        if name in words:
            return words[name]
        raise ValueError(f"unknown SQL token {{{name}}}")

    rendered = _TOKEN.sub(token, text)
    if dialect == "postgres":
        rendered = rendered.replace("%", "%%").replace("?", "%s")
        rendered = _NAMED.sub(r"%(\1)s", rendered)
    return rendered


def parse(text: str) -> dict[str, str]:
    """The ``-- name --`` blocks of a file, without their comment lines."""
    parts = _BLOCK.split(text)
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in found:
            raise ValueError(f"query {name!r} is defined twice")
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        found[name] = " ".join(" ".join(lines).split())
    return found


_MIGRATION = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def migrations(dialect: str) -> list[tuple[int, str, str]]:
    """(version, name, sql) of every numbered migration file of ``dialect``, in order."""
    folder = resources.files("kiln.store").joinpath("sql", dialect)
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    return sorted(found)


def _read(*path: str) -> str:
    return resources.files("kiln.store").joinpath("sql", *path).read_text(encoding="utf-8")


@functools.cache
def queries(dialect: str) -> Queries:
    """Every named query of ``dialect`` (``sqlite`` or ``postgres``), rendered."""
    shared = parse(_read("queries.sql"))
    own = parse(_read(dialect, "queries.sql"))
    twice = shared.keys() & own.keys()
    if twice:
        raise ValueError(f"queries defined in both files: {sorted(twice)}")
    named = {name: _render(dialect, sql) for name, sql in {**shared, **own}.items()}
    return Queries(dialect, named)
