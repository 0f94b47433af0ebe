"""The chaos run's client side: what it submits, replays and cancels, through ``kiln.App``.

Each task gets a category, drawn from :data:`MIX`. Every submission's answer is checked
as it comes back against I5 (a new task is created, a replay returns the original, an
identical request returns its live or successful twin, a burst of identical requests
makes one task); what disagrees is kept in ``problems`` for the report.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import kiln
from kiln.errors import AlreadyFinal, IdempotencyKeyReused
from kiln.models import SubmitResult, Timeouts
from kiln.states import ACTIVE, Status

KIND = "image.generate"
TENANTS = ("acme", "globex", "initech")
#: Categories and their shares; the rest of the tasks are ``plain``.
MIX = (
    ("retryable", 0.15),  # the first 1-2 attempts fail with a retryable error
    ("permanent", 0.06),  # every attempt fails with a permanent error
    ("stall", 0.03),  # the first attempt hangs in GENERATING; the generating timeout ends it
    ("cancel_pending", 0.08),  # cancelled right after it was accepted
    ("cancel_running", 0.06),  # a slow task, cancelled once GENERATING
    ("burst", 0.04),  # submitted as BURST identical requests at once
)
KEYED_SHARE = 0.12  # plain and retryable tasks sent with an Idempotency-Key
DUPLICATE_SHARE = 0.08  # plain tasks sent again later, identical
BURST = 4
BATCH = 10
POLL_S = 0.05


@dataclass(frozen=True)
class Spec:
    category: str
    tenant: str
    params: dict[str, Any]
    max_attempts: int = 3
    timeouts: Timeouts | None = None
    key: str | None = None


def make_spec(i: int, rng: random.Random) -> Spec:
    roll, category = rng.random(), "plain"
    for name, share in MIX:
        if roll < share:
            category = name
            break
        roll -= share
    simulate: dict[str, Any] = {"step_ms": rng.randint(5, 25)}
    steps, max_attempts, timeouts = rng.randint(3, 8), 3, None
    if category == "retryable":
        simulate["fail_attempts"] = rng.choice((1, 2))
        max_attempts = simulate["fail_attempts"] + 2
    elif category == "permanent":
        simulate["permanent"] = True
    elif category == "stall":
        simulate["stall_attempts"] = 1
        timeouts = Timeouts(generating_s=1.0)
    elif category == "cancel_running":
        steps, simulate["step_ms"] = 16, 60
    params = {"prompt": f"chaos {i} {category}", "width": 64, "height": 64, "steps": steps,
              "seed": i, "simulate": simulate, "model": f"m{i % 3}"}  # fmt: skip
    keyed = category in ("plain", "retryable") and rng.random() < KEYED_SHARE
    return Spec(category, TENANTS[i % len(TENANTS)], params, max_attempts, timeouts,
                f"chaos-key-{i}" if keyed else None)  # fmt: skip


class Submitter:
    def __init__(self, app: kiln.App, rng: random.Random, tasks: int, backlog: int) -> None:
        self.app = app
        self.rng = rng
        self.tasks = tasks
        self.backlog = backlog
        self.created: set[str] = set()
        self.permanent: set[str] = set()
        self.problems: list[str] = []
        self.finished = False
        self.counts: Counter[str] = Counter()
        self.categories: Counter[str] = Counter()
        self._stopping = False
        self._twins: dict[tuple[str, str], set[str]] = {}
        self._keyed: list[tuple[Spec, str]] = []
        self._duplicates: list[Spec] = []
        self._to_cancel: set[str] = set()

    def stop(self) -> None:
        self._stopping = True

    def figures(self) -> dict[str, Any]:
        return {
            "tasks": len(self.created),
            "submissions": self.counts["submissions"],
            "dedup_hits": self.counts["dedup_hits"],
            "replays": self.counts["replays"],
            "key_reuse_refused": self.counts["key_reuse_refused"],
            "bursts": self.counts["bursts"],
            "cancelled_pending": self.counts["cancelled_pending"],
            "cancelled_running": self.counts["cancelled_running"],
            "cancel_missed": self.counts["cancel_missed"],
            "permanent": len(self.permanent),
            "categories": dict(sorted(self.categories.items())),
        }

    # submitting

    async def submit_all(self) -> None:
        """Submit the tasks in small batches, keeping about ``backlog`` PENDING."""
        try:
            for start in range(0, self.tasks, BATCH):
                if not await self._room():
                    return
                specs = [
                    make_spec(i, self.rng) for i in range(start, min(start + BATCH, self.tasks))
                ]
                await asyncio.gather(*(self._submit_new(spec) for spec in specs))
                await self._resubmit_some()
        finally:
            self.finished = True

    async def _room(self) -> bool:
        while not self._stopping:
            counts = (await self.app.store.stats(tenant=None, ghost_after_s=60)).counts
            if counts.get(str(Status.PENDING), 0) < self.backlog:
                return True
            await asyncio.sleep(POLL_S)
        return False

    async def _submit(self, spec: Spec) -> SubmitResult:
        self.counts["submissions"] += 1
        return await self.app.submit(
            KIND, spec.params, tenant=spec.tenant, idempotency_key=spec.key,
            max_attempts=spec.max_attempts, timeouts=spec.timeouts,
        )  # fmt: skip

    async def _submit_new(self, spec: Spec) -> None:
        self.categories[spec.category] += 1
        if spec.category == "burst":
            results = await asyncio.gather(*(self._submit(spec) for _ in range(BURST)))
            self.counts["bursts"] += 1
            made = [r for r in results if r.created]
            if len(made) != 1 or len({r.task.id for r in results}) != 1:
                answered = sorted({r.task.id for r in results})
                self.problems.append(
                    f"a burst of {BURST} identical requests made {len(made)} tasks: {answered}"
                )
        else:
            results = [await self._submit(spec)]
        for result in results:
            if result.created:
                self._record_created(spec, result)
        first = results[0]
        if not any(r.created for r in results):
            self.problems.append(f"new content ({spec.params['prompt']}) answered with "
                                 f"existing task {first.task.id}")  # fmt: skip
            return
        await self._follow_up(spec, first.task.id)

    def _record_created(self, spec: Spec, result: SubmitResult) -> None:
        task = result.task
        self.created.add(task.id)
        self._twins.setdefault((spec.tenant, spec.params["prompt"]), set()).add(task.id)
        if spec.category == "permanent":
            self.permanent.add(task.id)

    async def _follow_up(self, spec: Spec, task_id: str) -> None:
        if spec.category == "cancel_pending":
            await self._cancel(task_id)
        elif spec.category == "cancel_running":
            self._to_cancel.add(task_id)
        if spec.key is not None:
            self._keyed.append((spec, task_id))
        elif spec.category == "plain" and self.rng.random() < DUPLICATE_SHARE:
            self._duplicates.append(spec)

    # replays and duplicates of earlier submissions

    async def _resubmit_some(self) -> None:
        if self._keyed and self.rng.random() < 0.5:
            spec, task_id = self._keyed.pop(self.rng.randrange(len(self._keyed)))
            if self.rng.random() < 0.25:
                await self._reuse_key(spec)
            else:
                await self._replay(spec, task_id)
        if self._duplicates and self.rng.random() < 0.5:
            await self._duplicate(self._duplicates.pop(self.rng.randrange(len(self._duplicates))))

    async def _replay(self, spec: Spec, task_id: str) -> None:
        result = await self._submit(spec)
        self.counts["replays"] += 1
        if not result.replayed or result.created or result.task.id != task_id:
            self.problems.append(f"replay of key {spec.key} answered {result.task.id} "
                                 f"(created={result.created}), not {task_id}")  # fmt: skip

    async def _reuse_key(self, spec: Spec) -> None:
        changed = replace(spec, params={**spec.params, "prompt": spec.params["prompt"] + " again"})
        try:
            result = await self._submit(changed)
        except IdempotencyKeyReused:
            self.counts["key_reuse_refused"] += 1
            return
        self.problems.append(f"key {spec.key} reused with another body made {result.task.id}")

    async def _duplicate(self, spec: Spec) -> None:
        """An identical request: the live or successful twin answers; else a new task."""
        result = await self._submit(spec)
        twins = self._twins.get((spec.tenant, spec.params["prompt"]), set())
        if result.created:
            self._record_created(spec, result)
            for twin_id in sorted(twins - {result.task.id}):
                twin = await self.app.get(twin_id)
                if twin.status in ACTIVE or twin.status is Status.SUCCESS:
                    self.problems.append(f"duplicate made {result.task.id} beside "
                                         f"{twin.status} twin {twin_id}")  # fmt: skip
        elif result.deduplicated and result.task.id in twins:
            self.counts["dedup_hits"] += 1
        else:
            self.problems.append(f"duplicate answered {result.task.id}, not one of {twins}")

    # cancelling

    async def _cancel(self, task_id: str) -> None:
        try:
            task = await self.app.cancel(task_id, tenant=None)
        except AlreadyFinal:
            self.counts["cancel_missed"] += 1
            return
        running = task.status is not Status.CANCELLED
        self.counts["cancelled_running" if running else "cancelled_pending"] += 1

    async def cancel_running(self) -> None:
        """Cancel each ``cancel_running`` task once a worker is GENERATING it."""
        while not self._stopping:
            for task_id in sorted(self._to_cancel):
                task = await self.app.get(task_id)
                if task.status is Status.GENERATING:
                    self._to_cancel.discard(task_id)
                    await self._cancel(task_id)
                elif task.final:
                    self._to_cancel.discard(task_id)
                    self.counts["cancel_missed"] += 1
            await asyncio.sleep(POLL_S)
