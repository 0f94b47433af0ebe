"""SQLite's submit process (kiln.store.submit_process): plain submissions written by a
process of their own are answered as the API's own writer answers them; when that process
is SIGKILLed (idle, stopped with submissions in its socket, mid-burst, or after it wrote
and before it answered), stalls, or cannot start, every submission is answered once and
written once, and the next process takes over; closing the store answers what a stopped
one held; a SIGKILLed API process takes its submit process with it."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conformance.factories import make_new_task
from kiln.models import SubmitResult
from kiln.store import submit_process
from kiln.store.sqlite import SqliteStore
from kiln.store.submit_process import SubmitProcess

from .conftest import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    """A store on ``tmp_path / "kiln.db"`` whose plain submissions go to a submit process."""
    opened = SqliteStore(str(tmp_path / "kiln.db"), clock=time.time, submit_process=True)
    try:
        yield opened
    finally:
        await opened.close()


def _rows(path: Path, sql: str, *args: object) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def _submitter(store: SqliteStore) -> SubmitProcess:
    assert store.submitter is not None
    return store.submitter


def _assert_written_once(path: Path, tasks: int) -> None:
    """``tasks`` task rows, each with exactly one submit event."""
    assert _rows(path, "SELECT count(*) FROM tasks") == [(tasks,)]
    per_task = _rows(
        path, "SELECT task_id, count(*) FROM events WHERE event = 'submit' GROUP BY task_id"
    )
    assert len(per_task) == tasks
    assert {count for _, count in per_task} == {1}


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (reaped, or a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


async def _started(store: SqliteStore) -> int:
    """The submit process's pid, once it is ready and answered a first submission."""
    assert await _submitter(store).wait_ready()
    first = await store.submit(make_new_task({"first": True}), place=True)
    assert first.created
    pid = _submitter(store).pid
    assert pid is not None and pid != os.getpid()
    return pid


async def _stopped(store: SqliteStore) -> int:
    """The pid of the store's submit process, started and then stopped (SIGSTOP): it holds
    what it is sent and says nothing."""
    pid = await _started(store)
    os.kill(pid, signal.SIGSTOP)
    return pid


async def test_plain_submissions_are_written_by_the_submit_process(tmp_path: Path) -> None:
    path = tmp_path / "kiln.db"
    store = SqliteStore(str(path), clock=time.time, submit_process=True)
    here = SqliteStore(str(tmp_path / "here.db"), clock=time.time)
    try:
        pid = await _started(store)
        news = [make_new_task({"n": i}) for i in range(200)]
        there = await asyncio.gather(*(store.submit(new, place=True) for new in news))
        alone = await asyncio.gather(*(here.submit(new, place=True) for new in news))
        # What the API's own writer answers, field for field but the times.
        assert [(r.created, r.deduplicated, r.placed) for r in there] == [
            (r.created, r.deduplicated, r.placed) for r in alone
        ]
        assert sorted(r.queue_position for r in there) == list(range(2, 202))  # type: ignore[type-var]
        for mine, theirs in zip(there, alone, strict=True):
            assert mine.task.id == theirs.task.id
            assert mine.task.params == theirs.task.params
            assert mine.task.status == theirs.task.status
        assert _submitter(store).counts[1] == 201  # written there, not here
        assert _submitter(store).counts[2] >= 100  # with the others of their batch
        assert store.write_batches[1] >= 201
        _assert_written_once(path, 201)

        # The same content again: the task that holds it, a counted dedup hit.
        again = await store.submit(news[0], place=True)
        assert (again.created, again.deduplicated) == (False, True)
        assert again.task.id == there[0].task.id
        assert (await store.counters())[("dedup_hits", "content")] == 1
        # A submission with an Idempotency-Key is the API writer's: the same process.
        keyed = await store.submit(make_new_task({"keyed": 1}, idempotency_key="k1"))
        assert keyed.created and _submitter(store).counts[1] == 202
        assert _submitter(store).pid == pid
    finally:
        await store.close()
        await here.close()
    assert _gone(pid)
    assert _submitter(store).lost == 0


async def test_a_stopped_then_killed_submit_process_leaves_its_submissions_to_the_api(
    store: SqliteStore,
    tmp_path: Path,
) -> None:
    submitter = _submitter(store)
    submitter.respawn_after_s = 0.0
    pid = await _stopped(store)
    news = [make_new_task({"n": i}) for i in range(50)]
    pending = [asyncio.ensure_future(store.submit(new, place=True)) for new in news]

    async def sent() -> bool:
        return len(submitter._held) == 50 and not submitter._out

    await wait_until(sent, what="the 50 submissions in the stopped process's socket")
    os.kill(pid, signal.SIGKILL)
    results: list[SubmitResult] = await asyncio.gather(*pending)
    assert all(r.created for r in results)
    assert [r.task.id for r in results] == [new.id for new in news]
    assert sorted(r.queue_position for r in results) == list(range(2, 52))  # type: ignore[type-var]
    assert (submitter.lost, submitter.settled) == (1, 50)
    _assert_written_once(tmp_path / "kiln.db", 51)

    # The next submission starts the next process (written here until it is ready).
    after = await store.submit(make_new_task({"after": True}))
    assert after.created
    assert submitter.pid not in (None, pid) and submitter.started == 2
    assert await submitter.wait_ready()
    there = await store.submit(make_new_task({"there": True}))
    assert there.created and submitter.counts[1] == 2  # one in each process
    _assert_written_once(tmp_path / "kiln.db", 53)


async def test_what_a_killed_submit_process_wrote_is_answered_as_written(
    store: SqliteStore,
    tmp_path: Path,
) -> None:
    """The process wrote the submissions and died before its answers were read: each is
    answered with the task it wrote (created), none written again."""
    path = tmp_path / "kiln.db"
    submitter = _submitter(store)
    pid = await _started(store)
    loop = asyncio.get_running_loop()
    assert submitter._sock is not None
    loop.remove_reader(submitter._sock.fileno())  # its answers stay unread
    news = [make_new_task({"n": i}) for i in range(30)]
    pending = [asyncio.ensure_future(store.submit(new, place=True)) for new in news]

    async def written() -> bool:
        return _rows(path, "SELECT count(*) FROM tasks") == [(31,)]

    await wait_until(written, what="the submit process to commit the 30 submissions")
    os.kill(pid, signal.SIGKILL)
    submitter._child_gone()  # what reading the socket's end does
    results: list[SubmitResult] = await asyncio.gather(*pending)
    assert all(r.created and not r.deduplicated for r in results)
    assert [r.task.id for r in results] == [new.id for new in news]
    assert sorted(r.queue_position for r in results) == list(range(2, 32))  # type: ignore[type-var]
    assert submitter.settled == 30
    _assert_written_once(path, 31)


async def test_a_submit_process_killed_mid_burst_loses_nothing_and_writes_nothing_twice(
    store: SqliteStore,
    tmp_path: Path,
) -> None:
    path = tmp_path / "kiln.db"
    submitter = _submitter(store)
    pid = await _started(store)
    # 600 submissions of 300 contents (each content twice, the copies apart), sent
    # ten at a time, about 30 in flight; the process is killed after 100 answers.
    news = [make_new_task({"n": i % 300}) for i in range(600)]
    pending: list[asyncio.Future[SubmitResult]] = []
    killed = False
    for start in range(0, 600, 10):
        pending += [asyncio.ensure_future(store.submit(new)) for new in news[start : start + 10]]
        if start >= 30:  # about 30 in flight
            await pending[start - 30]
        if not killed and sum(p.done() for p in pending) >= 100:
            os.kill(pid, signal.SIGKILL)
            killed = True
    results = await asyncio.gather(*pending)
    assert killed

    async def noticed() -> bool:
        return submitter.lost == 1

    await wait_until(noticed, what="the store to notice its submit process died")
    for i in range(300):  # both copies of a content: one task
        assert results[i].task.id == results[i + 300].task.id
    made = Counter(r.task.id for r in results if r.created)
    assert len(made) == 300 and set(made.values()) == {1}
    _assert_written_once(path, 301)


API_PROCESS = textwrap.dedent(
    """
    import asyncio, sys, time
    from kiln.store.sqlite import SqliteStore
    sys.path.insert(0, sys.argv[2])
    from conformance.factories import make_new_task

    async def main():
        store = SqliteStore(sys.argv[1], clock=time.time, submit_process=True)
        await store.submit(make_new_task({"n": 1}))
        print(store.submitter.pid, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


async def test_a_killed_api_process_takes_its_submit_process_with_it(tmp_path: Path) -> None:
    tests = Path(__file__).resolve().parents[1]
    api = subprocess.Popen(
        [sys.executable, "-c", API_PROCESS, str(tmp_path / "kiln.db"), str(tests)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert api.stdout is not None
        line = await asyncio.to_thread(api.stdout.readline)
        child = int(line)
        assert not _gone(child)
        api.kill()
        await asyncio.to_thread(api.wait)

        async def ended() -> bool:
            return _gone(child)

        await wait_until(ended, what="the submit process to end with its API process")
    finally:
        if api.poll() is None:
            api.kill()
            api.wait()
    _assert_written_once(tmp_path / "kiln.db", 1)


async def test_a_stalled_submit_process_is_killed_and_its_submissions_settled(
    store: SqliteStore,
    tmp_path: Path,
) -> None:
    submitter = _submitter(store)
    submitter.stall_s = 0.3
    pid = await _stopped(store)
    news = [make_new_task({"n": i}) for i in range(10)]
    results = await asyncio.gather(*(store.submit(new, place=True) for new in news))
    assert all(r.created for r in results)
    assert (submitter.lost, submitter.settled) == (1, 10)
    assert _gone(pid)
    _assert_written_once(tmp_path / "kiln.db", 11)


async def test_closing_the_store_answers_what_a_stopped_submit_process_held(
    store: SqliteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(submit_process, "EXIT_WAIT_S", 0.3)
    submitter = _submitter(store)
    pid = await _stopped(store)
    news = [make_new_task({"n": i}) for i in range(5)]
    pending = [asyncio.ensure_future(store.submit(new)) for new in news]

    async def sent() -> bool:
        return len(submitter._held) == 5 and not submitter._out

    await wait_until(sent, what="the 5 submissions in the stopped process's socket")
    await store.close()  # waits for their answers, then ends the process
    results: list[SubmitResult] = await asyncio.gather(*pending)
    assert all(r.created for r in results) and submitter.settled == 5
    assert _gone(pid)
    _assert_written_once(tmp_path / "kiln.db", 6)


async def test_a_submit_process_that_cannot_start_leaves_every_submission_to_the_api(
    store: SqliteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One started from other code (here: another protocol) refuses to run; the store
    writes every submission itself and tries again later, each time twice as late."""
    monkeypatch.setattr(submit_process, "PROTOCOL", "not-this-code")
    submitter = _submitter(store)
    submitter.respawn_after_s = 0.05
    assert not await submitter.wait_ready(timeout_s=1.5)
    assert submitter.started >= 2 and submitter.lost >= submitter.started - 1
    assert submitter._respawn_delay() == 0.05 * 2 ** (submitter._early_deaths - 1)
    results = await asyncio.gather(*(store.submit(make_new_task({"n": i})) for i in range(20)))
    assert all(r.created for r in results) and submitter.counts[1] == 0
    _assert_written_once(tmp_path / "kiln.db", 20)
