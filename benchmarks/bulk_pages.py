"""A bulk cancel of pipelines on SQLite: its total time, its longest write transaction,
and another tenant's submit latency meanwhile.

One process, as `kiln serve` runs it: a temporary SQLite file, N pipelines of 200 waiting
steps each (tenant acme), then the cancel by kind page after page (the answer's cursor,
as `kiln cancel --kind pipeline` sends it) while tenant globex submits one task after
another (20 ms apart) until the cancel is over. The longest transaction is the SQLite
writer thread's longest group commit while the cancel ran (a page, with whatever writes
queued with it). `--baseline-rev REV` runs the same measurement first on the source of
REV (`git archive`, in a child process), so both figures come from one run on one
machine. Bounded: the cancel stops after `--max-s` seconds. The last line is one JSON
object.

    .venv/bin/python benchmarks/bulk_pages.py                       # 40 pipelines
    .venv/bin/python benchmarks/bulk_pages.py --baseline-rev e0ac91a
    .venv/bin/python benchmarks/bulk_pages.py --pipelines 100 --json-only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kiln
from kiln import demo
from kiln.bulk_actions import FilterIn, bulk_action, filter_of
from kiln.store import sqlite as sqlite_store

ROOT = Path(__file__).resolve().parents[1]
STEPS = 200


def wide(n: int) -> dict[str, Any]:
    """200 steps made at once: two steps of 100 copies, neither reading the other."""
    return {
        "steps": [
            {
                "name": side,
                "kind": "image.generate",
                "repeat": 100,
                "params": {"prompt": f"{side} {n}", "width": 64, "height": 64, "steps": 2},
            }
            for side in ("left", "right")
        ]
    }


class WriterClock:
    """The writer thread's group commits, timed (the longest while ``on``)."""

    def __init__(self) -> None:
        self.on = False
        self.longest_s = 0.0
        self.commits = 0
        run = sqlite_store._DbThread._run

        def timed(thread: Any, conn: Any, batch: Any) -> Any:
            started = time.perf_counter()
            try:
                return run(thread, conn, batch)
            finally:
                if self.on and thread._writer:
                    self.commits += 1
                    self.longest_s = max(self.longest_s, time.perf_counter() - started)

        sqlite_store._DbThread._run = timed  # type: ignore[method-assign]


async def cancel_pages(app: kiln.App, max_s: float) -> tuple[list[int], bool]:
    """Cancel every pipeline, page after page; the pipelines each page cancelled."""
    found = filter_of(
        "cancel", FilterIn(kind=["pipeline"]), scope=None, everything=False, now=app.now()
    )
    pages: list[int] = []
    cursor: str | None = None
    deadline = time.perf_counter() + max_s
    while True:
        page = await bulk_action(app.engine, "cancel", found, dry_run=False, cursor=cursor)
        pages.append(int(page["cancelled"]))
        cursor = page["cursor"]
        if cursor is None:
            return pages, True
        if time.perf_counter() > deadline:
            return pages, False


async def submit_meanwhile(app: kiln.App, done: asyncio.Event) -> list[float]:
    latencies: list[float] = []
    while not done.is_set():
        started = time.perf_counter()
        params = {"prompt": f"meanwhile {len(latencies)}", "width": 64, "height": 64}
        await app.submit("image.generate", params, tenant="globex", delay_s=3600)
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.02)
    return latencies


async def measure(pipelines: int, max_s: float) -> dict[str, Any]:
    clock = WriterClock()
    with tempfile.TemporaryDirectory(prefix="kiln-bulk-") as tmp:
        root = Path(tmp)
        settings = kiln.Settings(
            data_dir=root,
            database_url=f"sqlite:///{root / 'kiln.db'}",
            storage_url=(root / "results").as_uri(),
        )
        app = kiln.App(settings=settings)
        demo.register(app)
        async with app:
            for n in range(pipelines):
                await app.submit("pipeline", wide(n), tenant="acme")
            done = asyncio.Event()
            meanwhile = asyncio.create_task(submit_meanwhile(app, done))
            clock.on = True
            started = time.perf_counter()
            pages, finished = await cancel_pages(app, max_s)
            total_s = time.perf_counter() - started
            clock.on = False
            done.set()
            latencies = await meanwhile
    return {
        "pipelines": pipelines,
        "steps": pipelines * STEPS,
        "finished": finished,
        "total_s": round(total_s, 3),
        "pages": len(pages),
        "pipelines_per_page_max": max(pages),
        "longest_transaction_s": round(clock.longest_s, 3),
        "submits_meanwhile": len(latencies),
        "submit_p50_s": round(statistics.median(latencies), 3),
        "submit_max_s": round(max(latencies), 3),
    }


def baseline(rev: str, pipelines: int, max_s: float) -> dict[str, Any]:
    """The same measurement on ``rev``'s source, in a child process."""
    with tempfile.TemporaryDirectory(prefix="kiln-baseline-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        env = {**os.environ, "PYTHONPATH": str(Path(tmp) / "src")}
        args = [
            sys.executable,
            __file__,
            "--pipelines",
            str(pipelines),
            "--max-s",
            str(max_s),
            "--json-only",
        ]
        done = subprocess.run(args, env=env, check=True, capture_output=True, text=True)
    figure: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"rev": rev, **figure}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=40, help="of 200 steps each")
    parser.add_argument("--max-s", type=float, default=600, help="stop the cancel after this")
    parser.add_argument("--baseline-rev", help="measure this git revision's source first")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    if args.baseline_rev:
        figures["before"] = baseline(args.baseline_rev, args.pipelines, args.max_s)
    figure = asyncio.run(measure(args.pipelines, args.max_s))
    if not args.baseline_rev:
        print(json.dumps(figure))
        return
    figures["after"] = figure
    if not args.json_only:
        for name, found in figures.items():
            print(
                f"{name}: {found['total_s']} s in {found['pages']} pages, longest transaction "
                f"{found['longest_transaction_s']} s; other tenant's submit p50 "
                f"{found['submit_p50_s']} s, max {found['submit_max_s']} s "
                f"({found['submits_meanwhile']} submits)"
            )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
