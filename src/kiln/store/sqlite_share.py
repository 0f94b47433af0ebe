"""What processes on one SQLite file share beyond the file: a write lock that waits in the
kernel, and wake-ups when one of them made work claimable.

**The write lock.** SQLite's own write lock is not waited for: a connection that finds it
taken sleeps and tries again (``busy_timeout``: 1, 2, 5, 10 … 100 ms), so two processes
that write all the time lose most of their time asleep while the file is free. Every
store's writer takes an exclusive ``flock`` on ``<database>-kiln-lock`` around its
``BEGIN IMMEDIATE`` … ``COMMIT``: a writer of another process blocks in the kernel and
runs the moment the holder lets go. The kernel drops the lock with the last descriptor of
a process that dies, SIGKILL included: nothing is left to clean up. SQLite's lock is
still taken inside it, so a writer that does not take the file lock (the ``sqlite3``
shell, an older kiln) stays correct; only then is ``busy_timeout`` waited on, and
:attr:`WriteLock.busy_waits` counts those times.

**Wake-ups.** A worker of another process learns that work became claimable without
polling: each store that watches binds a datagram socket in Linux's abstract namespace
(gone with its process) and leaves a marker of the same name in ``<database>-kiln-wake/``;
a writer that committed a claimable change sends one byte to every marker but its own
and removes the markers nobody answers on (a process that died). A watcher that misses a
byte still polls, as before, at the worker's idle interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("kiln.store")

_names = itertools.count()


class WriteLock:
    """An exclusive ``flock`` on ``<database>-kiln-lock``, with counts of its use."""

    def __init__(self, database: str) -> None:
        self.path = f"{database}-kiln-lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.taken = 0  # times this process took it
        self.waited = 0  # of those, times another process held it, so this one blocked
        self.wait_s = 0.0  # the time spent blocked
        self.held_s = 0.0  # the time it was held
        self.held_cpu_s = 0.0  # of which the holding thread ran (the rest: waits, the GIL)
        self._since = self._cpu = 0.0
        self.busy_waits = 0  # times SQLite's lock was held by a writer outside this lock

    def acquire(self) -> bool:
        """Take the lock; whether another process held it, so this one waited."""
        waited = False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            started = time.monotonic()
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # blocks in the kernel, not in a sleep
            self.wait_s += time.monotonic() - started
            self.waited += 1
            waited = True
        self.taken += 1
        self._since, self._cpu = time.monotonic(), time.thread_time()
        return waited

    def release(self) -> None:
        self.held_s += time.monotonic() - self._since
        self.held_cpu_s += time.thread_time() - self._cpu
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def stats(self) -> dict[str, float]:
        return {
            "taken": self.taken,
            "waited": self.waited,
            "wait_s": round(self.wait_s, 6),
            "held_s": round(self.held_s, 6),
            "held_cpu_s": round(self.held_cpu_s, 6),
            "busy_waits": self.busy_waits,
        }


class Wakeups:
    """Tell the other processes on a database that work became claimable, and hear them."""

    def __init__(self, database: str) -> None:
        self.folder = Path(f"{database}-kiln-wake")
        real = os.path.realpath(database)
        self._prefix = "kiln-wake-" + hashlib.sha256(real.encode()).hexdigest()[:16] + "-"
        self._sender: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._own: str | None = None
        self._receiver: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._callbacks: list[Callable[[], None]] = []
        self.sent = 0
        self.heard = 0

    # hearing

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on this event loop when another process wakes this one."""
        self._callbacks.append(callback)
        if self._receiver is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop to hear on: workers poll
        name = f"{os.getpid()}-{next(_names)}"
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            receiver.setblocking(False)
            receiver.bind(b"\0" + (self._prefix + name).encode())
            self.folder.mkdir(exist_ok=True)
            (self.folder / name).touch()
        except OSError as exc:
            receiver.close()
            log.warning("sqlite_wakeups_off", extra={"error": str(exc)})
            return
        loop.add_reader(receiver.fileno(), self._heard)
        self._receiver, self._loop, self._own = receiver, loop, name

    def _heard(self) -> None:
        assert self._receiver is not None
        with contextlib.suppress(OSError):
            while self._receiver.recv(64):
                self.heard += 1
        for callback in list(self._callbacks):
            callback()

    # telling

    def notify(self) -> None:
        """One byte to every other watcher of the database; markers of the dead removed.
        Called by the writer thread after a commit that made work claimable."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return  # nobody watches yet
        with self._send_lock:
            if self._sender is None:
                self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sender.setblocking(False)
            for name in names:
                if name == self._own:
                    continue
                try:
                    self._sender.sendto(b"!", b"\0" + (self._prefix + name).encode())
                    self.sent += 1
                except (ConnectionRefusedError, FileNotFoundError):
                    with contextlib.suppress(OSError):  # its process is gone
                        (self.folder / name).unlink()
                except OSError:
                    pass  # its queue is full: it has a wake-up to read already

    def close(self) -> None:
        if self._receiver is not None:
            if self._loop is not None and not self._loop.is_closed():
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._receiver.fileno())
            self._receiver.close()
            self._receiver = None
            with contextlib.suppress(OSError):
                (self.folder / str(self._own)).unlink()
        with self._send_lock:
            if self._sender is not None:
                self._sender.close()
                self._sender = None
