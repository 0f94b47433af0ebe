"""Plain submissions written by a process of their own: SQLite's writer off the API's
interpreter lock (``KILN_SQLITE_SUBMIT_PROCESS``).

In one process the event loop and the SQLite writer thread share one interpreter lock:
while the loop parses requests and checks submissions, the writer's Python waits, and
the other way round, so a process that takes new tasks over HTTP runs on one core
whatever the machine has. With a submit process, ``kiln serve`` hands each plain
submission (:meth:`~kiln.store.sqlite_submits.Grouped.takes`) to a child process
(:mod:`kiln.store.submit_writer`) over a socket pair: the child's writer runs the same
group commit, under the same file lock as every other writer of the database
(:mod:`kiln.store.sqlite_share`), and answers each submission with its
:class:`~kiln.models.SubmitResult`, after the commit. The API's own writer thread keeps
every other write.

What crosses the socket: frames, each a 4-byte length and a :mod:`marshal` document (a
list of requests, or the child's counts and a list of answers), written once per turn
of the event loop and once per commit; tasks travel as tuples of their fields.

Submissions go to a child only once it said it is ready (a first frame, sent when its
connection is open); until then, and whenever none runs, the API's own writer takes them.

**When the child dies** (SIGKILL, a crash, a writer thread that broke: the child then
exits), the socket reads its end. The submissions it held are settled once the process
is gone (nothing of it can commit after that): a task the child wrote is answered as
written (201), any other submission is written by the API's own writer, so each is
answered once and written once. A child that holds a submission and says nothing for
:data:`STALL_S` (stopped, hung) is killed first. The next child starts
:data:`RESPAWN_AFTER_S` later, twice as late for each one in a row that died before it was
ready (up to :data:`RESPAWN_MAX_S`); one started from other code than the API's (an
upgrade on disk: :data:`PROTOCOL` differs) refuses to run. Closing the store lets the
child answer what it holds (up to :data:`EXIT_WAIT_S`), then ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import marshal
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from operator import attrgetter
from pathlib import Path
from typing import Any

from kiln.errors import StoreUnavailable
from kiln.models import NewTask, SubmitResult, Task, Timeouts
from kiln.states import Status
from kiln.store.claims import ClaimPolicy

log = logging.getLogger("kiln.store")

#: Each frame's length, before its document.
HEADER = struct.Struct("<I")
#: Seconds between the death of a submit process and the start of the next, doubled for
#: each one in a row that died before it was ready, up to :data:`RESPAWN_MAX_S`.
RESPAWN_AFTER_S = 5.0
RESPAWN_MAX_S = 300.0
#: Seconds a closing store waits for its submit process to answer and end before it
#: kills it.
EXIT_WAIT_S = 10.0
#: A submit process that held a submission this long without a word (stopped, hung) is
#: killed, and what it held settled (SQLite's own lock wait is ``busy_timeout``, 30 s).
STALL_S = 45.0
#: The folder that holds the kiln package this process runs.
_KILN_ROOT = str(Path(__file__).resolve().parents[2])
#: What an answer says it holds.
RESULT, ERROR = 0, 1

# The wire forms ---------------------------------------------------------------------------

_NEW_FIELDS = tuple(f.name for f in fields(NewTask))
_TASK_FIELDS = tuple(f.name for f in fields(Task))
#: The wire's shape: a child started from other code (an upgrade on disk) refuses to run.
PROTOCOL = hashlib.sha256(repr((_NEW_FIELDS, _TASK_FIELDS, HEADER.format)).encode()).hexdigest()[
    :16
]
_new_values = attrgetter(*_NEW_FIELDS)
_task_values = attrgetter(*_TASK_FIELDS)
_NEW_TIMEOUTS = _NEW_FIELDS.index("timeouts")
_NEW_TRACE = _NEW_FIELDS.index("trace")
_TASK_STATUS = _TASK_FIELDS.index("status")
_TASK_TIMEOUTS = _TASK_FIELDS.index("timeouts")


def _timeouts_form(timeouts: Timeouts) -> tuple[float, float, float]:
    return (timeouts.waiting_s, timeouts.generating_s, timeouts.uploading_s)


def new_form(new: NewTask) -> list[Any]:
    """A plain submission as :mod:`marshal` writes it (no trace: a plain one has none)."""
    values = list(_new_values(new))
    if values[_NEW_TRACE] is not None:
        raise ValueError("a submission with a trace context is not plain")
    values[_NEW_TIMEOUTS] = _timeouts_form(new.timeouts)
    return values


def new_of(form: list[Any]) -> NewTask:
    form[_NEW_TIMEOUTS] = Timeouts(*form[_NEW_TIMEOUTS])
    return NewTask(*form)


def task_form(task: Task) -> list[Any]:
    values = list(_task_values(task))
    values[_TASK_STATUS] = task.status.value
    values[_TASK_TIMEOUTS] = _timeouts_form(task.timeouts)
    return values


def task_of(form: list[Any]) -> Task:
    form[_TASK_STATUS] = Status(form[_TASK_STATUS])
    form[_TASK_TIMEOUTS] = Timeouts(*form[_TASK_TIMEOUTS])
    return Task(*form)


def policy_form(policy: ClaimPolicy | None) -> tuple[Any, ...] | None:
    if policy is None:
        return None
    if policy.fair:
        raise ValueError("a submission under fair turns is not plain")
    return (policy.aging_s, policy.running_cap, dict(policy.running_caps))


def policy_of(form: tuple[Any, ...] | list[Any] | None) -> ClaimPolicy | None:
    if form is None:
        return None
    aging_s, running_cap, running_caps = form
    return ClaimPolicy(aging_s=aging_s, running_cap=running_cap, running_caps=running_caps)


def result_form(request_id: int, result: SubmitResult) -> tuple[Any, ...]:
    return (
        request_id,
        RESULT,
        task_form(result.task),
        result.created,
        result.replayed,
        result.deduplicated,
        result.queue_position,
        result.placed,
    )


def error_form(request_id: int, error: BaseException) -> tuple[Any, ...]:
    """An error as the API process raises it: itself when it survives pickling, else a
    :class:`~kiln.errors.StoreUnavailable` that names it."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:
        data = pickle.dumps(StoreUnavailable(f"the submit process failed: {error!r}"))
    return (request_id, ERROR, data)


def frame(document: Any) -> bytes:
    data = marshal.dumps(document)
    return HEADER.pack(len(data)) + data


def frames(buffer: bytearray) -> list[Any]:
    """The whole frames at the start of ``buffer``, taken out of it."""
    out = []
    start = 0
    while len(buffer) - start >= HEADER.size:
        (size,) = HEADER.unpack_from(buffer, start)
        end = start + HEADER.size + size
        if end > len(buffer):
            break
        out.append(marshal.loads(memoryview(buffer)[start + HEADER.size : end]))
        start = end
    if start:
        del buffer[:start]
    return out


# The API process's side ------------------------------------------------------------------


@dataclass(slots=True)
class _Held:
    """A submission sent to the child and not answered yet."""

    new: NewTask
    place: bool
    policy: ClaimPolicy | None
    future: asyncio.Future[SubmitResult]
    at: float  # when it was sent (monotonic)


#: What settles a submission the child died with: (new, place, policy) → its answer.
Settle = Callable[[NewTask, bool, ClaimPolicy | None], Awaitable[SubmitResult]]


class SubmitProcess:
    """The API process's end of one submit process at a time (see the module docstring).

    Bound to the event loop of its first submission; a submission from another loop, or
    while no child is ready (started, its connection open), is for the caller's own
    writer (:meth:`ready` says no)."""

    def __init__(self, path: str, synchronous: str, settle: Settle) -> None:
        self.path = path
        self.synchronous = synchronous
        self._settle = settle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._held: dict[int, _Held] = {}
        self._out: list[tuple[Any, ...]] = []
        self._unsent = b""
        self._inbox = bytearray()
        self._ids = itertools.count()
        self._start_after = 0.0
        self.respawn_after_s = RESPAWN_AFTER_S
        self.stall_s = STALL_S
        self._ready = False  # the running child said it is ready
        self._early_deaths = 0  # children in a row that died before they were ready
        self._heard_at = 0.0
        self._watching: asyncio.TimerHandle | None = None
        self._closing = False
        self._settling: set[asyncio.Task[None]] = set()
        #: The children's (transactions, operations, grouped submissions) so far: those of
        #: the ones that ended, and the last the running one reported.
        self._ended_counts = (0, 0, 0)
        self._counts = (0, 0, 0)
        self.started = 0  # children started
        self.lost = 0  # children that ended without being asked to
        self.settled = 0  # submissions settled here after their child died

    # lifecycle

    def ready(self) -> bool:
        """Whether the calling loop's submission goes to the child (started when due)."""
        if self._closing:
            return False
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            return False
        if self._sock is None and time.monotonic() >= self._start_after:
            self._start()
        return self._ready

    def _start(self) -> None:
        assert self._loop is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [
            sys.executable,
            "-m",
            "kiln.store.submit_writer",
            str(theirs.fileno()),
            self.path,
            self.synchronous,
            PROTOCOL,
        ]
        # The child imports the kiln this process runs, wherever it was found.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_KILN_ROOT, env.get("PYTHONPATH")]))
        try:
            self._proc = subprocess.Popen(
                command,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
                env=env,
            )
        except OSError as exc:
            ours.close()
            self._early_deaths += 1
            self._start_after = time.monotonic() + self._respawn_delay()
            log.error("sqlite_submit_process_failed", extra={"error": str(exc)})
            return
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._ready = False
        self._heard_at = time.monotonic()
        self._loop.add_reader(ours.fileno(), self._readable)
        self._watching = self._loop.call_later(self.stall_s / 3, self._watch)
        self.started += 1
        log.info("sqlite_submit_process_started", extra={"pid": self._proc.pid})

    def _respawn_delay(self) -> float:
        doubled = self.respawn_after_s * 2.0 ** max(self._early_deaths - 1, 0)
        return float(min(doubled, max(RESPAWN_MAX_S, self.respawn_after_s)))

    def _watch(self) -> None:
        """Kill a child that holds a submission and said nothing for :attr:`stall_s`."""
        self._watching = None
        if self._sock is None or self._loop is None:
            return
        now = time.monotonic()
        oldest = min((held.at for held in self._held.values()), default=now)
        if now - oldest > self.stall_s and now - self._heard_at > self.stall_s:
            proc = self._proc
            log.error(
                "sqlite_submit_process_stalled",
                extra={"pid": None if proc is None else proc.pid, "held": len(self._held)},
            )
            if proc is not None:
                proc.kill()  # its socket ends with it: the held submissions are settled
        self._watching = self._loop.call_later(self.stall_s / 3, self._watch)

    async def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Start the child if none runs, and wait until it is ready (for tests and
        benchmarks that want every plain submission to go there)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    @property
    def pid(self) -> int | None:
        """The running child's process id (None: none runs)."""
        return None if self._proc is None or self._sock is None else self._proc.pid

    @property
    def counts(self) -> tuple[int, int, int]:
        """(transactions, operations, grouped submissions) of every child so far."""
        transactions, operations, grouped = (
            a + b for a, b in zip(self._ended_counts, self._counts, strict=True)
        )
        return transactions, operations, grouped

    async def close(self) -> None:
        """Let the child answer what it holds, then end it."""
        self._closing = True
        if self._sock is not None and self._held:
            futures = [held.future for held in self._held.values()]
            await asyncio.wait(futures, timeout=EXIT_WAIT_S)
        if self._sock is not None:  # (the child may have died meanwhile)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)  # the child ends once it read everything
        proc = self._proc
        if proc is not None:
            try:
                await asyncio.to_thread(proc.wait, EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("sqlite_submit_process_killed", extra={"pid": proc.pid})
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._sock is not None:  # its end not read yet: what it still held is settled
            self._child_gone()
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        if self.started:
            transactions, operations, grouped = self.counts
            log.info(
                "sqlite_submit_process_ended",
                extra={
                    "transactions": transactions,
                    "submissions": operations,
                    "grouped": grouped,
                    "started": self.started,
                    "lost": self.lost,
                    "settled": self.settled,
                },
            )

    # submissions

    async def submit(
        self, new: NewTask, place: bool, policy: ClaimPolicy | None, now: float
    ) -> SubmitResult:
        """Write ``new`` in the child (call after :meth:`ready` said yes)."""
        assert self._loop is not None
        request_id = next(self._ids)
        future: asyncio.Future[SubmitResult] = self._loop.create_future()
        self._out.append((request_id, new_form(new), now, place, policy_form(policy)))
        self._held[request_id] = _Held(new, place, policy, future, time.monotonic())
        if len(self._out) == 1 and not self._unsent:
            self._loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        if self._sock is None or not self._out:
            return
        self._unsent += frame(self._out)
        self._out = []
        self._send()

    def _send(self) -> None:
        assert self._sock is not None and self._loop is not None
        try:
            sent = self._sock.send(self._unsent)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._child_gone()
            return
        self._unsent = self._unsent[sent:]
        if self._unsent:
            self._loop.add_writer(self._sock.fileno(), self._writable)

    def _writable(self) -> None:
        assert self._sock is not None and self._loop is not None
        self._loop.remove_writer(self._sock.fileno())
        if self._out:
            self._unsent += frame(self._out)
            self._out = []
        if self._unsent:
            self._send()

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._child_gone()
            return
        self._inbox += data
        self._heard_at = time.monotonic()
        try:
            documents = frames(self._inbox)
        except Exception:  # not what a child of this code writes: end it, settle its held
            log.exception("sqlite_submit_process_garbled")
            if self._proc is not None:
                self._proc.kill()
            self._child_gone()
            return
        for counts, answers in documents:
            transactions, operations, grouped = counts
            self._counts = (transactions, operations, grouped)
            if not self._ready:
                self._ready = True  # its first frame: its connection is open
                self._early_deaths = 0
            for answer in answers:
                self._answer(answer)

    def _answer(self, answer: list[Any]) -> None:
        held = self._held.pop(answer[0], None)
        if held is None or held.future.done():
            return  # its caller went away
        try:
            if answer[1] == ERROR:
                held.future.set_exception(pickle.loads(answer[2]))
                return
            _, _, form, created, replayed, deduplicated, position, placed = answer
            result = SubmitResult(task_of(form), created, replayed, deduplicated, position, placed)
        except Exception as exc:  # an answer this process cannot read: its caller is told
            log.exception("sqlite_submit_answer_unreadable")
            held.future.set_exception(
                StoreUnavailable(f"the submit process's answer could not be read: {exc!r}")
            )
            return
        held.future.set_result(result)

    # the child's end

    def _drop(self) -> None:
        """Forget the socket and the running child (its counts kept)."""
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None
        self._ready = False
        if self._sock is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._ended_counts = self.counts
        self._counts = (0, 0, 0)
        self._out = []
        self._unsent = b""
        self._inbox.clear()

    def _child_gone(self) -> None:
        """The socket read its end: settle what the child held, once it is gone."""
        proc, held, was_ready = self._proc, list(self._held.values()), self._ready
        self._held.clear()
        self._drop()
        if not self._closing:
            self.lost += 1
            self._early_deaths = 0 if was_ready else self._early_deaths + 1
            self._start_after = time.monotonic() + self._respawn_delay()
            log.error(
                "sqlite_submit_process_lost",
                extra={"pid": None if proc is None else proc.pid, "held": len(held)},
            )
        assert self._loop is not None
        settling = self._loop.create_task(self._settle_held(proc, held))
        self._settling.add(settling)
        settling.add_done_callback(self._settling.discard)

    async def _settle_held(self, proc: subprocess.Popen[bytes] | None, held: list[_Held]) -> None:
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(proc.wait, EXIT_WAIT_S)
            if proc.returncode is None:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        # In the order they came; one whose caller went away is settled too, as the
        # API's own writer writes a submission whose caller went away.
        for one in held:
            try:
                result = await self._settle(one.new, one.place, one.policy)
            except Exception as exc:
                if not one.future.done():
                    one.future.set_exception(exc)
                continue
            self.settled += 1
            if not one.future.done():
                one.future.set_result(result)


__all__ = ["SubmitProcess", "frame", "frames", "new_form", "new_of", "task_form", "task_of"]
