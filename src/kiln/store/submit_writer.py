"""The submit process: ``python -m kiln.store.submit_writer FD PATH SYNCHRONOUS PROTOCOL``.

Started by the API process's store (:mod:`kiln.store.submit_process`) with one end of a
socket pair as ``FD``. Its main thread reads the submissions from the socket and queues
them for a writer thread that is the store's own (:class:`~kiln.store.sqlite._DbThread`):
the same group commit, the same file lock and wake-ups of the other processes, the same
fall-backs (one by one, savepoints). After each commit the writer sends the answers of
its batch in one frame, with its counts; its first frame, sent once its connection is
open, says it is ready. A writer thread that breaks ends the process (exit status 1), so
that the API process settles what it held.

It lives as long as its socket: it ignores SIGINT and SIGTERM (a terminal's Ctrl-C and a
service manager's stop reach every process of the group; the API process ends it after
its own last submission), and when the socket reads its end (the API process closed it,
or died) it writes what it already read, and exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sqlite3
import sys
from dataclasses import dataclass
from typing import Any

from kiln.store.queries import queries
from kiln.store.rows import insert_parts
from kiln.store.sqlite import SqliteStore, _DbThread, _Job, connect, job_of
from kiln.store.sqlite_share import Wakeups, WriteLock
from kiln.store.sqlite_submits import Grouped
from kiln.store.sqlite_tx import kiln_connection
from kiln.store.sqlstore import Store
from kiln.store.submit_process import (
    PROTOCOL,
    error_form,
    frame,
    frames,
    new_of,
    policy_of,
    result_form,
)
from kiln.store.tx import Refused

log = logging.getLogger("kiln.store")


class _BatchClock:
    """The submit process's clock: the time the API process gave the last submission of
    the batch being written (a submission is written at the latest of its batch's times,
    as the API's own writer would read its clock once for the batch)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Store(Store):
    """The operations of a submission, without threads of their own."""

    _insert_row = SqliteStore._insert_row


@dataclass(slots=True)
class _Request(_Job):
    """A submission read from the socket: its id and the time the API process gave it."""

    request_id: int = 0
    now: float = 0.0


class _Writer(_DbThread):
    """The store's writer thread, answering over the socket instead of event loops."""

    def __init__(self, sock: socket.socket, path: str, synchronous: str) -> None:
        self.sock = sock
        self.clock = _BatchClock()
        self.store = _Store(queries("sqlite"), self.clock)
        super().__init__(
            "kiln-submit-writer",
            lambda: self._open(path, synchronous),
            writer=True,
            lock=WriteLock(path),
            wakeups=Wakeups(path),
        )

    def _open(self, path: str, synchronous: str) -> sqlite3.Connection:
        conn = connect(path, synchronous=synchronous)
        conn.execute("PRAGMA busy_timeout=0")  # SQLite's lock is free under the file lock
        self.sock.sendall(frame(((0, 0, 0), [])))  # ready
        return conn

    def run(self) -> None:
        try:
            super().run()
        except BaseException:
            log.exception("sqlite_submit_writer_failed")
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            os._exit(1)  # the API process reads the socket's end and settles what it held

    def request(self, document: list[Any]) -> _Request:
        """The job of one request; one that cannot be read is answered with its error."""
        request_id, now = document[0], document[2]
        try:
            return self._request(document)
        except Exception as exc:
            error = exc

            def refuse(conn: sqlite3.Connection) -> Any:
                raise error

            return _Request(refuse, None, None, request_id=request_id, now=now)  # type: ignore[arg-type]

    def _request(self, document: list[Any]) -> _Request:
        request_id, form, now, place, policy_doc = document
        new = new_of(form)
        policy = policy_of(policy_doc)
        prepared = insert_parts(new)
        op = self.store._submit_op(new, prepared, place, policy)
        grouped = Grouped(self.store, new, prepared, place, policy)
        fn = job_of(self.store.q, op)
        return _Request(fn, None, None, grouped, request_id=request_id, now=now)  # type: ignore[arg-type]

    def _run_transaction(
        self, conn: sqlite3.Connection, batch: list[_Job]
    ) -> list[tuple[_Job, Any, BaseException | None]]:
        self.clock.now = max(job.now for job in batch)  # type: ignore[attr-defined]
        return super()._run_transaction(conn, batch)

    def _answer(self, outcomes: list[tuple[_Job, Any, BaseException | None]]) -> None:
        answers = []
        for job, result, error in outcomes:
            request_id = job.request_id  # type: ignore[attr-defined]
            if isinstance(result, Refused):
                error = result.error
            if error is not None:
                answers.append(error_form(request_id, error))
            else:
                answers.append(result_form(request_id, result))
        conn = self.conn
        grouped = 0 if conn is None else kiln_connection(conn).grouped
        counts = (self.batches, self.operations, grouped)
        # OSError: the API process is gone; it settles what it held from the database.
        with contextlib.suppress(OSError):
            self.sock.sendall(frame((counts, answers)))


def main(argv: list[str]) -> int:
    fd, path, synchronous, protocol = int(argv[0]), argv[1], argv[2], argv[3]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="kiln submit process: %(message)s")
    sock = socket.socket(fileno=fd)
    if protocol != PROTOCOL:
        log.error(
            "started by an API process of other code (protocol %s, not %s)", protocol, PROTOCOL
        )
        return 3
    writer = _Writer(sock, path, synchronous)
    writer.start()
    inbox = bytearray()
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                break
            inbox += data
            for document in frames(inbox):
                writer.put_many([writer.request(one) for one in document])
    except OSError:
        pass  # the socket broke: as its end
    finally:
        writer.put(None)
        writer.join()
        sock.close()
        if writer.wakeups is not None:
            writer.wakeups.close()
        if writer.lock is not None:
            writer.lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
