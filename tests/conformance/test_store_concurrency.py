"""Races on one database: identical submissions make one task (I5) and no task is claimed
twice, from many threads with their own event loops and from separate OS processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kiln.errors import KilnError
from kiln.models import NewTask
from kiln.store import Store

from .backends import Backend, Row
from .factories import KIND, make_new_task

pytestmark = pytest.mark.submit_process

CLIENT = Path(__file__).with_name("store_client.py")
THREADS = 100

#: (task id, created) of one submission, or None and the refusal's error code.
Outcome = tuple[str | None, bool | None, str | None]


async def _outcome(submission: Awaitable[Any]) -> Outcome:
    try:
        result = await submission
    except KilnError as exc:
        return None, None, exc.code
    return result.task.id, result.created, None


def _race(count: int, submit: Callable[[int], Outcome]) -> list[Outcome]:
    """Run ``submit(i)`` on ``count`` threads released together."""
    start = threading.Barrier(count)
    outcomes: list[Outcome | None] = [None] * count

    def run(i: int) -> None:
        start.wait()
        outcomes[i] = submit(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert None not in outcomes
    return [o for o in outcomes if o is not None]


def _submitter(
    mode: str, store: Store, backend: Backend, directory: Path, make: Callable[[int], NewTask]
) -> Callable[[int], Outcome]:
    """Each thread runs its own event loop, on the shared store or on a store of its own."""

    def shared(i: int) -> Outcome:
        return asyncio.run(_outcome(store.submit(make(i))))

    def own(i: int) -> Outcome:
        mine = backend.open(directory, time.time)

        async def go() -> Outcome:
            try:
                return await _outcome(mine.submit(make(i)))
            finally:
                await mine.close()

        return asyncio.run(go())

    return shared if mode == "shared" else own


def _store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"  # the directory of the conftest's store fixture


@pytest.mark.parametrize("mode", ["shared", "own"])
async def test_identical_submissions_from_many_threads_make_one_task(
    store: Store, backend: Backend, tmp_path: Path, truth: Callable[..., list[Row]], mode: str
) -> None:
    # Given 100 threads holding the same request without a key
    submit = _submitter(mode, store, backend, _store_dir(tmp_path), lambda i: make_new_task())
    # When they all submit at once
    outcomes = await asyncio.to_thread(_race, THREADS, submit)
    # Then exactly one task was created, and every caller got it
    assert [o[2] for o in outcomes] == [None] * THREADS
    assert len({o[0] for o in outcomes}) == 1
    assert [o[1] for o in outcomes].count(True) == 1
    assert truth("SELECT COUNT(*) FROM tasks") == [(1,)]
    assert truth("SELECT COUNT(*) FROM events") == [(1,)]


@pytest.mark.parametrize("mode", ["shared", "own"])
async def test_submissions_with_one_idempotency_key_from_many_threads_make_one_task(
    store: Store, backend: Backend, tmp_path: Path, truth: Callable[..., list[Row]], mode: str
) -> None:
    # Given 100 threads holding the same request with the same key (content dedup off)
    def make(i: int) -> NewTask:
        return make_new_task(idempotency_key="same-key", dedup=False)

    submit = _submitter(mode, store, backend, _store_dir(tmp_path), make)
    # When they all submit at once
    outcomes = await asyncio.to_thread(_race, THREADS, submit)
    # Then exactly one task was created and the others replayed it
    assert len({o[0] for o in outcomes}) == 1
    assert [o[1] for o in outcomes].count(True) == 1
    assert truth("SELECT COUNT(*) FROM tasks") == [(1,)]
    assert truth("SELECT COUNT(*) FROM idempotency_keys") == [(1,)]


async def test_one_key_with_two_bodies_under_concurrency_is_refused_for_the_loser(
    store: Store, truth: Callable[..., list[Row]]
) -> None:
    # Given 100 threads sharing one key, half of them with another body
    bodies = ["body-a", "body-b"]

    def make(i: int) -> NewTask:
        return make_new_task({"prompt": bodies[i % 2]}, idempotency_key="k", dedup=False)

    def submit(i: int) -> Outcome:
        return asyncio.run(_outcome(store.submit(make(i))))

    # When they all submit at once
    outcomes = await asyncio.to_thread(_race, THREADS, submit)
    # Then one body won: all its callers got the one task, all the others were refused
    ((task_id, fingerprint),) = truth("SELECT id, fingerprint FROM tasks")
    winner = next(i for i in range(2) if make(i).fingerprint == fingerprint)
    for i, (got, _, error) in enumerate(outcomes):
        if i % 2 == winner:
            assert (got, error) == (task_id, None)
        else:
            assert (got, error) == (None, "idempotency_key_reused")
    assert [o[1] for o in outcomes].count(True) == 1


# separate OS processes ---------------------------------------------------------------------


@contextmanager
def _clients(url: str, argvs: list[list[str]]) -> Iterator[list[subprocess.Popen[str]]]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(CLIENT), url, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _run_together(url: str, argvs: list[list[str]]) -> list[Any]:
    """Start the clients, release them together once all are ready, return their answers."""
    with _clients(url, argvs) as procs:
        for proc in procs:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            assert line.strip() == "ready", line + (proc.stderr.read() if proc.stderr else "")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        answers = []
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
            answers.append(json.loads(out))
        return answers


@pytest.mark.slow
@pytest.mark.parametrize("key", ["-", "one-key"], ids=["content", "idempotency_key"])
async def test_identical_submissions_from_four_processes_make_one_task(
    backend: Backend, tmp_path: Path, key: str
) -> None:
    # Given a database and four processes with 25 identical submissions each
    url = backend.url(tmp_path)
    await backend.open(tmp_path, time.time).close()  # a migrated database
    # When they all submit at once
    answers = await asyncio.to_thread(_run_together, url, [["submit", "25", "same body", key]] * 4)
    # Then there is one task, created exactly once across all processes
    outcomes = [o for answer in answers for o in answer]
    assert len(outcomes) == 100
    assert {o.get("error") for o in outcomes} == {None}
    assert len({o["id"] for o in outcomes}) == 1
    assert [o["created"] for o in outcomes].count(True) == 1


@pytest.mark.slow
async def test_one_key_with_two_bodies_from_four_processes_is_refused_for_the_loser(
    backend: Backend, tmp_path: Path
) -> None:
    # Given four processes sharing one key, two of them with another body
    url = backend.url(tmp_path)
    await backend.open(tmp_path, time.time).close()
    argvs = [["submit", "25", body, "shared-key"] for body in ("a", "b", "a", "b")]
    # When they all submit at once
    answers = await asyncio.to_thread(_run_together, url, argvs)
    # Then one body won everywhere: one task, created once; the other body was refused
    by_body: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for argv, answer in zip(argvs, answers, strict=True):
        by_body[argv[2]] += answer
    winner = "a" if any("id" in o for o in by_body["a"]) else "b"
    loser = "b" if winner == "a" else "a"
    assert len({o.get("id") for o in by_body[winner]}) == 1
    assert None not in {o.get("id") for o in by_body[winner]}
    assert [o["created"] for o in by_body[winner]].count(True) == 1
    assert by_body[loser] == [{"error": "idempotency_key_reused"}] * 50


@pytest.mark.slow
async def test_four_processes_claiming_never_take_a_task_twice(
    backend: Backend, tmp_path: Path
) -> None:
    # Given 200 PENDING tasks
    store = backend.open(tmp_path, time.time)
    try:
        submitted = await asyncio.gather(
            *(store.submit(make_new_task({"n": i})) for i in range(200))
        )
        pending = {r.task.id for r in submitted}
        assert len(pending) == 200
        # When four processes claim until nothing is left
        answers = await asyncio.to_thread(_run_together, backend.url(tmp_path), [["claim"]] * 4)
        # Then every task was claimed exactly once
        claims = [task_id for answer in answers for task_id in answer]
        assert len(claims) == 200
        assert set(claims) == pending
        tasks, _ = await store.list_tasks(tenant=None, kind=KIND, limit=500)
        assert {(t.status, t.attempt, t.epoch) for t in tasks} == {("WAITING_FOR_RESOURCE", 1, 1)}
        claim_events = [e for e in await store.events(limit=1000) if e.event == "claim"]
        assert Counter(e.task_id for e in claim_events) == Counter(claims)
    finally:
        await store.close()
