"""Several processes on one SQLite file (kiln.store.sqlite_share, kiln serve's worker
processes): their writers meet at the file lock in the kernel, not in SQLite's
busy_timeout polling; a writer wakes the other processes' workers; a SIGKILLed worker
process loses nothing and nothing is done twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.models import StoredOutput
from kiln.states import Event, Status
from kiln.storage import verify

from .cli_workers import CliWorkers
from .conftest import assert_one_final_state, demo_params, object_keys, successes, wait_until

pytestmark = pytest.mark.slow

#: A process that says it is ready (a file), submits ``n`` tasks once the file ``go``
#: exists, then prints its store's use of the file lock.
SUBMITTER = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    import kiln
    from kiln.config import Settings

    db, go, n = sys.argv[1], sys.argv[2], int(sys.argv[3])

    async def main():
        app = kiln.App(settings=Settings(database_url=f"sqlite:///{db}",
                                         storage_url="file:///tmp/unused"))

        @app.task("t.noop")
        async def noop(ctx, params):
            return None

        async with app:
            await app.engine.store.counters()
            open(f"{go}.ready.{os.getpid()}", "w").close()
            while not os.path.exists(go):
                await asyncio.sleep(0.005)
            for start in range(0, n, 25):
                await asyncio.gather(*(app.submit("t.noop", {"n": i, "pid": os.getpid()},
                                                  dedup=False)
                                       for i in range(start, start + 25)))
            print(json.dumps(app.engine.store.lock_stats()), flush=True)

    asyncio.run(main())
    """
)


def _app(settings: Settings) -> kiln.App:
    app = kiln.App(settings=settings)

    @app.task("t.noop")
    async def noop(ctx: object, params: object) -> None:
        return None

    return app


async def test_writers_in_two_processes_wait_on_the_file_lock_not_on_busy_polling(
    tmp_path: Path,
) -> None:
    # Given two processes that submit at the same moment on one SQLite file
    db, go = tmp_path / "kiln.db", tmp_path / "go"
    sqlite3.connect(db).close()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SUBMITTER, str(db), str(go), "400"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]

    async def both_ready() -> bool:
        return len(list(tmp_path.glob("go.ready.*"))) == 2

    await wait_until(both_ready, timeout_s=60, what="both processes to open the store")
    go.touch()
    reports = []
    for proc in procs:
        out, err = await asyncio.to_thread(proc.communicate, timeout=120)
        assert proc.returncode == 0, err.decode()
        reports.append(json.loads(out.decode().strip().splitlines()[-1]))

    # Then every write took the file lock; some waited for the other process there, in
    # the kernel; none waited on SQLite's busy_timeout polling; nothing was lost
    assert all(r["taken"] > 0 for r in reports), reports
    assert sum(r["waited"] for r in reports) > 0, reports
    assert [r["busy_waits"] for r in reports] == [0, 0], reports
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM tasks").fetchone()[0] == 800


async def test_a_writer_outside_the_file_lock_is_waited_for_and_counted(
    settings: Settings,
) -> None:
    # Given a connection that holds SQLite's write lock without the file lock (as the
    # sqlite3 shell would)
    app = _app(settings)
    async with app:
        await app.engine.store.counters()
        outside = sqlite3.connect(settings.resolved_database_url.removeprefix("sqlite:///"))
        outside.isolation_level = None
        outside.execute("BEGIN IMMEDIATE")
        try:
            # When the store writes, it waits on busy_timeout, and says so
            submit = asyncio.ensure_future(app.submit("t.noop", {}, dedup=False))
            await wait_until(
                lambda: _true(app.engine.store.lock_stats()["busy_waits"] == 1),  # type: ignore[attr-defined]
                what="the writer to find SQLite's lock held",
            )
            assert not submit.done()
        finally:
            outside.execute("COMMIT")
            outside.close()
        # Then once the outside writer let go, the write went through
        result = await submit
        assert result.created and (await app.get(result.task.id)).status is Status.PENDING


async def _true(value: bool) -> bool:
    return value


async def test_a_submission_wakes_the_workers_of_another_store_on_the_file(
    settings: Settings,
) -> None:
    # Given a second store on the same file that watches for claimable work, and the
    # marker of a process that died without closing its store
    watcher, submitter = _app(settings), _app(settings)
    async with watcher, submitter:
        heard = asyncio.Event()
        watcher.engine.store.watch_ready(heard.set)
        await submitter.engine.store.counters()
        db = settings.resolved_database_url.removeprefix("sqlite:///")
        dead = Path(f"{db}-kiln-wake") / "999999999-0"
        dead.parent.mkdir(exist_ok=True)
        dead.touch()

        # When the first one submits
        await submitter.submit("t.noop", {}, dedup=False)

        # Then the watcher hears of it (no claim loop polls here), and the dead marker is
        # cleaned away
        await asyncio.wait_for(heard.wait(), timeout=10)
        assert not dead.exists()


async def test_a_sigkilled_worker_process_on_one_sqlite_file_loses_nothing_and_does_nothing_twice(
    tmp_path: Path,
) -> None:
    # Given two `kiln worker` processes on one SQLite file, running tasks this process
    # submits (a third process on the file)
    group = CliWorkers(
        tmp_path / "group",
        f"sqlite:///{tmp_path / 'kiln.db'}",
        KILN_LEASE_TTL_S="1",
        KILN_CONCURRENCY="4",
    )
    settings = Settings(
        data_dir=tmp_path,
        database_url=group.database_url,
        storage_url=group.storage_url,
        lease_ttl_s=1.0,
        retry_base_s=0.01,
        retry_max_s=0.05,
    )
    app = kiln.App(settings=settings)
    demo.register(app)
    try:
        async with app:
            await app.engine.store.counters()
            victim = group.start()
            group.start()
            ids = [
                (
                    await app.submit("image.generate", demo_params(f"p{i}", steps=10, step_ms=20))
                ).task.id
                for i in range(40)
            ]

            # When one of them is SIGKILLed while it runs some
            async def victim_runs() -> bool:
                found = [await app.get(i) for i in ids]
                return any(
                    t.status is Status.GENERATING and f":{victim.pid}:" in (t.lease_owner or "")
                    for t in found
                )

            await wait_until(victim_runs, timeout_s=30, what="the victim to run a task")
            group.kill(victim)

            # Then the supervisor moves its attempts on and every task succeeds once
            async with running(app.supervisor(interval_s=0.05).run()):

                async def all_done() -> bool:
                    found = [await app.get(i) for i in ids]
                    return all(t.status is Status.SUCCESS for t in found)

                await wait_until(all_done, timeout_s=90, what="every task to succeed")
            expired = await _each_succeeded_once(app, ids)
            assert expired >= 1  # the victim's attempts were taken back, not lost
    finally:
        group.stop()


async def _each_succeeded_once(app: kiln.App, ids: list[str]) -> int:
    """Every task in one final state, SUCCESS once, its outputs verified and only at its
    final attempt's place; how many expiries their logs hold."""
    expired = 0
    for task_id in ids:
        events = await assert_one_final_state(app.engine.store, task_id)
        assert len(successes(events)) == 1
        expired += sum(1 for e in events if e.event is Event.EXPIRE)
        task = await app.get(task_id)
        assert task.result is not None and task.result_prefix is not None
        for output in (StoredOutput.from_json(o) for o in task.result["outputs"]):
            assert await verify(app.storage, output)
        keys = await object_keys(app.storage, f"tasks/{task_id}/")
        assert all(k.startswith(f"{task.result_prefix}/") for k in keys), keys
    return expired


def test_kiln_serve_starts_worker_processes_and_stops_them(tmp_path: Path) -> None:
    # Given kiln serve on SQLite asked for two worker processes
    serve, port, log = _serve(tmp_path, worker_processes=2)
    try:
        # Then two `kiln worker` children run once it answers
        children: list[int] = []

        async def two_workers() -> bool:
            children[:] = [p for p in _children(serve.pid) if _is_worker(p)]
            return len(children) == 2 and _healthy(port)

        asyncio.run(wait_until(two_workers, timeout_s=60, what=f"two workers\n{log.read_text()}"))

        # And when it stops, so do they
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), log.read_text()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(timeout=10)


def test_worker_processes_drain_beside_kiln_serve_not_after_it(tmp_path: Path) -> None:
    # Given kiln serve with one worker process and a long grace, its own worker running a
    # long image.generate (a kind that takes the GPU slot runs in kiln serve itself)
    serve, port, log = _serve(tmp_path, worker_processes=1, KILN_SHUTDOWN_GRACE_S="300")
    children: list[int] = []
    try:
        children += _workers_when_ready(serve, port, log, 1)
        params = {"prompt": "a long one", "steps": 150, "simulate": {"step_ms": 2000}}
        task = _call(port, "POST", "/v1/tasks", {"kind": "image.generate", "params": params})

        async def generating() -> bool:
            return _call(port, "GET", f"/v1/tasks/{task['id']}")["status"] == "GENERATING"

        asyncio.run(wait_until(generating, timeout_s=60, what="the long task to run"))

        # When kiln serve gets SIGTERM
        serve.send_signal(signal.SIGTERM)

        # Then its worker process drains (it runs nothing) and exits while kiln serve is
        # still draining its own attempt, not once that has ended
        async def worker_gone() -> bool:
            return all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in children)

        asyncio.run(wait_until(worker_gone, timeout_s=60, what=f"the worker\n{log.read_text()}"))
        assert serve.poll() is None, log.read_text()
        # And a second SIGTERM stops kiln serve at once, its attempt given back
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, log.read_text()
        with contextlib.closing(sqlite3.connect(tmp_path / "kiln.db")) as db:
            rows = db.execute("SELECT event FROM events WHERE task_id = ?", (task["id"],))
            events = [row[0] for row in rows]
        assert events[-1] == "release" and "SUCCESS" not in events
    finally:
        _kill_all(serve, children)


def _kill_all(serve: subprocess.Popen[bytes], children: list[int]) -> None:
    """SIGKILL what is left of kiln serve and its worker processes."""
    if serve.poll() is None:
        serve.kill()
        serve.wait(timeout=10)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _workers_when_ready(
    serve: subprocess.Popen[bytes], port: int, log: Path, count: int
) -> list[int]:
    """The pids of kiln serve's ``count`` worker processes, once they run and it answers."""
    children: list[int] = []

    async def ready() -> bool:
        children[:] = [p for p in _children(serve.pid) if _is_worker(p)]
        return len(children) == count and _healthy(port)

    asyncio.run(wait_until(ready, timeout_s=60, what=f"{count} workers\n{log.read_text()}"))
    return children


def _call(port: int, method: str, path: str, body: object = None) -> dict[str, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        found: dict[str, object] = json.loads(answer.read())
        return found


def test_worker_processes_drain_and_exit_when_kiln_serve_is_sigkilled(tmp_path: Path) -> None:
    # Given kiln serve on SQLite with one worker process beside it
    serve, port, log = _serve(tmp_path, worker_processes=1)
    children: list[int] = []
    try:
        children += _workers_when_ready(serve, port, log, 1)

        # When kiln serve dies without a word
        serve.kill()
        serve.wait(timeout=10)

        # Then its worker process hears it (its stdin ends), drains and exits by itself
        async def gone() -> bool:
            return all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in children)

        asyncio.run(wait_until(gone, timeout_s=60, what=f"the worker to exit\n{log.read_text()}"))
        assert '"parent_gone"' in log.read_text()
    finally:
        _kill_all(serve, children)


def _serve(
    tmp_path: Path, *, worker_processes: int, **settings: str
) -> tuple[subprocess.Popen[bytes], int, Path]:
    """``kiln serve`` on a fresh SQLite data dir with that many worker processes (and
    ``settings``, KILN_ variables), its output in ``serve.log``: the process, its port, the
    log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_DATA_DIR=str(tmp_path), KILN_LOG_FORMAT="json", **settings)
    port = _free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "kiln", "serve", "--port", str(port)]
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [*command, "--worker-processes", str(worker_processes)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    return serve, port, log


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _is_worker(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    args = argv[:-1]  # the command line ends with a NUL
    return b"worker" in args and args[args.index(b"worker") - 1] == b"kiln"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _blocked_on(path: Path) -> bool:
    """Whether some process waits for a flock on ``path`` (a ``->`` line of /proc/locks)."""
    inode = os.stat(path).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and "FLOCK" in fields and fields[-3].rsplit(":", 1)[-1] == str(inode):
            return True
    return False


async def test_writes_queued_while_another_process_holds_the_lock_share_one_commit(
    settings: Settings,
) -> None:
    # Given another process's turn at the file lock (taken here, as it would take it), and
    # this store's writer waiting for it with one submission
    import fcntl

    app = _app(settings)
    async with app:
        store = app.engine.store
        await store.counters()
        db = settings.resolved_database_url.removeprefix("sqlite:///")
        holder = os.open(f"{db}-kiln-lock", os.O_RDWR)
        fcntl.flock(holder, fcntl.LOCK_EX)
        before = store.write_batches  # type: ignore[attr-defined]
        try:
            first = asyncio.ensure_future(app.submit("t.noop", {"n": 0}, dedup=False))

            async def writer_waits() -> bool:
                return _blocked_on(Path(f"{db}-kiln-lock"))

            await wait_until(writer_waits, what="the writer to wait for the file lock")
            # When nine more are queued meanwhile, and the lock is let go
            rest = [
                asyncio.ensure_future(app.submit("t.noop", {"n": i}, dedup=False))
                for i in range(1, 10)
            ]

            async def nine_queued() -> bool:
                return bool(store._writer._jobs.qsize() == 9)  # type: ignore[attr-defined]

            await wait_until(nine_queued, what="the nine to reach the writer's queue")
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)
            os.close(holder)
        done = [await first, *[await r for r in rest]]

        # Then all ten were committed in the one transaction that waited
        assert all(d.created for d in done)
        after = store.write_batches  # type: ignore[attr-defined]
        assert (after[0] - before[0], after[1] - before[1]) == (1, 10)
