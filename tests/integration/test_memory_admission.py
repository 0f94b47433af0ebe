"""Memory admission with real `kiln worker` processes on SQLite and PostgreSQL: a pool
that counts GiB (`KILN_POOLS=gpu-mem:8`), tasks that take what their size needs
(`KILN_GENERATE_MEMORY`), and the amount held never over the pool across processes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.config_values import parse_memory_rule
from kiln.states import Event, Status

from .cli_workers import CliWorkers
from .conftest import wait_for_status

pytestmark = pytest.mark.slow

#: 1 GiB and 6 GiB per megapixel: 256² takes 2, 512² 3, 1024² 8 (the whole pool).
RULE = "gpu-mem:1+6/mpx"
SIZES = {256: 2, 512: 3, 1024: 8}


def test_the_rule_gives_the_amounts_the_test_counts_on() -> None:
    rule = parse_memory_rule(RULE)
    assert {side: rule.units(side, side) for side in SIZES} == SIZES


async def test_a_memory_pool_is_never_over_its_amount_across_processes(
    tmp_path: Path, new_database: Callable[[], str], cli_workers: Callable[..., CliWorkers]
) -> None:
    # Given three worker processes of two slots each sharing a pool of 8 GiB
    env = {"KILN_POOLS": "gpu-mem:8", "KILN_GENERATE_MEMORY": RULE}
    workers = cli_workers(tmp_path, new_database(), **env)
    async with workers.app(pools={"gpu-mem": 8}, generate_memory=parse_memory_rule(RULE)) as app:
        # And a mix of small, middle and whole-pool pictures
        sides = [256, 512, 1024, 256, 256, 512, 1024, 256, 512, 256, 256, 512] * 2
        ids: dict[str, int] = {}
        for side in sides:
            params: dict[str, Any] = {"prompt": f"a harbour {uuid.uuid4().hex[:8]}",
                                      "width": side, "height": side, "steps": 4,
                                      "simulate": {"step_ms": 40}}  # fmt: skip
            ids[(await app.submit("image.generate", params)).task.id] = SIZES[side]
        # When they run
        for _ in range(3):
            workers.start("--concurrency", "2", "--gpus", "2")
        for task_id in ids:
            await wait_for_status(app.engine.store, task_id, Status.SUCCESS, timeout_s=180)
        spans = []
        for task_id, units in ids.items():
            events = await app.engine.store.events(task_id=task_id)
            start = next(e.at for e in events if e.status is Status.GENERATING)
            end = next(e.at for e in events if e.event is Event.GENERATED)
            spans.append((start, end, units))
    # Then the GiB generating at once never passed 8, and the small ones did share it
    edges = sorted(
        [(s, u) for s, _, u in spans] + [(e, -u) for _, e, u in spans],
        key=lambda edge: (edge[0], edge[1]),
    )  # ends before starts at a tie
    held, most = 0, 0
    for _, change in edges:
        held += change
        most = max(most, held)
    print(f"most GiB generating at once: {most} of 8")
    assert most <= 8
    assert most >= 4, "no two tasks ever shared the pool"
