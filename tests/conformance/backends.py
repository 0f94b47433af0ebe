"""The backends the conformance suite runs against.

Each backend names a fresh database by URL (what ``kiln.store.open_store`` and other
processes open) and gives a direct connection for ground truth and fault injection, in
plain SQL with ``?`` placeholders. Add a backend by adding a ``Backend`` to ``BACKENDS``.
The PostgreSQL backend gives each directory its own database, cloned from the migrated
template of the session's server (``tests/services/postgres.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from kiln.store import Clock, Store, open_store
from kiln.store.postgres import PostgresStore
from kiln.store.sqlite import SqliteStore, connect
from services.postgres import PostgresServer

Row = tuple[Any, ...]


class Connection(Protocol):
    """A direct connection to a store's database, for ground truth and fault injection."""

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]: ...

    def execute(self, sql: str, args: Sequence[Any] = ()) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    name: str
    url: Callable[[Path], str]
    connect: Callable[[Store], Connection]
    #: Plain submissions written by a submit process (kiln.store.submit_process).
    submit_process: bool = False

    def open(self, directory: Path, clock: Clock) -> Store:
        """A store on the database of ``directory`` (the same one on every call)."""
        return open_store(self.url(directory), clock=clock, submit_process=self.submit_process)

    def rows(self, store: Store, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        conn = self.connect(store)
        try:
            return conn.rows(sql, args)
        finally:
            conn.close()

    def execute(self, store: Store, sql: str, args: Sequence[Any] = ()) -> None:
        conn = self.connect(store)
        try:
            conn.execute(sql, args)
        finally:
            conn.close()


class SqliteConnection:
    def __init__(self, store: Store) -> None:
        assert isinstance(store, SqliteStore)
        self._conn = connect(store.path)

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return [tuple(row) for row in self._conn.execute(sql, tuple(args)).fetchall()]

    def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        self._conn.execute(sql, tuple(args))

    def close(self) -> None:
        self._conn.close()


def _sqlite_url(directory: Path) -> str:
    return f"sqlite:///{directory / 'kiln.db'}"


class PostgresConnection:
    def __init__(self, store: Store) -> None:
        import psycopg

        assert isinstance(store, PostgresStore)
        self._conn = psycopg.connect(store.url, autocommit=True)

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        cur = self._conn.execute(sql.replace("?", "%s"), tuple(args))  # type: ignore[arg-type]
        return [tuple(row) for row in cur.fetchall()]

    def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        self._conn.execute(sql.replace("?", "%s"), tuple(args))  # type: ignore[arg-type]

    def close(self) -> None:
        self._conn.close()


class PostgresDatabases:
    """One database per directory on the session's server (set by the fixture)."""

    server: PostgresServer | None = None
    _urls: ClassVar[dict[Path, str]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def url(cls, directory: Path) -> str:
        assert cls.server is not None, "the postgres_server fixture is not active"
        with cls._lock:  # stores open from several threads at once
            if directory not in cls._urls:
                cls._urls[directory] = cls.server.new_database()
            return cls._urls[directory]


BACKENDS = [
    Backend("sqlite", _sqlite_url, SqliteConnection),
    Backend("postgres", PostgresDatabases.url, PostgresConnection),
    # SQLite with its submit process: only for the modules marked ``submit_process``.
    Backend("sqliteprocess", _sqlite_url, SqliteConnection, submit_process=True),
]
