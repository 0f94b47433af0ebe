"""The chaos run's client side: what it submits, replays and cancels, through ``kiln.App``.

Each task gets a category, drawn from :data:`MIX`. Every submission's answer is checked
as it comes back against I5 (a new task is created, a replay returns the original, an
identical request returns its live or successful twin, a burst of identical requests
makes one task); what disagrees is kept in ``problems`` for the report.

A share of the submissions are pipelines (``pipeline`` category, docs/pipelines.md):
generate -> transform chains and fan-outs of 3 to 5 into a contact sheet, some of whose
steps fail (retryably, or for good), some cancelled while PENDING or running, some
retried once after they ended FAILED or CANCELLED. Between batches, some SUCCESS outputs
of earlier plain tasks are transformed by reference (``sha256:<hex>``, docs/uploads.md),
as the API does it: :func:`kiln.inputs.refer`, then the submission, then the release.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import kiln
from kiln import inputs, pipelines, transform
from kiln.errors import AlreadyFinal, IdempotencyKeyReused, KilnError, NotRetryable
from kiln.models import JSON, SubmitResult, Task, Timeouts
from kiln.states import ACTIVE, RUNNING, Status

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
    ("pipeline", 0.07),  # a pipeline of 2 to 6 steps (make_pipeline)
)
KEYED_SHARE = 0.12  # plain and retryable tasks sent with an Idempotency-Key
DUPLICATE_SHARE = 0.08  # plain tasks sent again later, identical
BURST = 4
BATCH = 10
POLL_S = 0.05
#: Pipelines: what is done to them once submitted, and the share retried once ended.
PIPELINE_FOLLOW = (("cancel_pending", 0.12), ("cancel_running", 0.15))
PIPELINE_RETRY_SHARE = 0.5
#: Pipelines whose generate step has the very content of an earlier plain task (content
#: dedup per step: when that task succeeded, it is the step).
REUSE_SHARE = 0.25
#: Chance, between two batches, of a transform of an earlier SUCCESS output by reference.
REF_SHARE = 0.5
#: How many of the oldest sources one look at them reads.
REF_LOOK = 4
#: How long a run that made no transform by reference waits for a source to end.
REF_WAIT_S = 30.0


@dataclass(frozen=True)
class Spec:
    category: str
    tenant: str
    params: dict[str, Any]
    max_attempts: int = 3
    timeouts: Timeouts | None = None
    key: str | None = None
    kind: str = KIND
    #: What identifies its content in the run's own books (the prompt of a plain task).
    label: str = ""
    #: A pipeline's follow-up (``cancel_pending``, ``cancel_running`` or ``""``), whether
    #: it is retried once it ended without success, and its steps that always fail.
    follow: str = ""
    retry_after: bool = False
    failing_steps: tuple[str, ...] = ()


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
    elif category == "pipeline":
        return make_pipeline(i, rng, simulate)
    params = {"prompt": f"chaos {i} {category}", "width": 64, "height": 64, "steps": steps,
              "seed": i, "simulate": simulate, "model": f"m{i % 3}"}  # fmt: skip
    keyed = category in ("plain", "retryable") and rng.random() < KEYED_SHARE
    return Spec(category, TENANTS[i % len(TENANTS)], params, max_attempts, timeouts,
                f"chaos-key-{i}" if keyed else None, label=str(params["prompt"]))  # fmt: skip


def make_pipeline(i: int, rng: random.Random, simulate: dict[str, Any]) -> Spec:
    """A chain (generate -> resize [-> thumbnail]) or a fan-out of 3 to 5 generates into a
    contact sheet. The generate step fails its first attempt (retryable) 20% of the time
    and every attempt (permanent) 10%; a chain's resize is a crop outside the picture
    (permanent, at the second step) 8% of the time."""
    fate, failing = rng.random(), []
    if fate < 0.2:
        simulate["fail_attempts"] = 1
    elif fate < 0.3:
        simulate["permanent"] = True
        failing.append("generate")
    prompt = f"chaos {i} pipeline"
    generate: dict[str, Any] = {"name": "generate", "kind": KIND,
                "params": {"prompt": prompt, "width": 64, "height": 64,
                           "steps": rng.randint(3, 8), "seed": i, "simulate": simulate,
                           "model": f"m{i % 3}"}}  # fmt: skip
    if rng.random() < 0.35:
        generate["repeat"] = rng.randint(3, 5)
        steps = [generate, {"name": "sheet", "kind": transform.SHEET,
                            "params": {"columns": 5, "tile": 32},
                            "inputs": {"images": "step:generate/*"}}]  # fmt: skip
    else:
        resize: dict[str, Any] = {"op": "resize", "width": 48, "height": 48}
        if rng.random() < 0.08:
            resize = {"op": "crop", "box": [0, 0, 500, 500]}
            failing.append("resize")
        steps = [generate, {"name": "resize", "kind": transform.KIND, "params": resize,
                            "inputs": {"image": "step:generate/image.png"}}]  # fmt: skip
        if rng.random() < 0.5:
            steps.append({"name": "thumbnail", "kind": transform.KIND,
                          "params": {"op": "thumbnail", "width": 16, "height": 16},
                          "inputs": {"image": "step:resize/image.png"}})  # fmt: skip
    params = {"steps": steps, "on_failure": rng.choice(pipelines.POLICIES)}
    roll, follow = rng.random(), ""
    for name, share in PIPELINE_FOLLOW:
        if roll < share:
            follow = name
            break
        roll -= share
    return Spec("pipeline", TENANTS[i % len(TENANTS)], params, kind=pipelines.KIND,
                label=prompt, follow=follow, retry_after=rng.random() < PIPELINE_RETRY_SHARE,
                failing_steps=tuple(failing))  # fmt: skip


class Submitter:
    def __init__(self, app: kiln.App, rng: random.Random, tasks: int, backlog: int) -> None:
        self.app = app
        self.rng = rng
        self.tasks = tasks
        self.backlog = backlog
        self.created: set[str] = set()
        self.permanent: set[str] = set()
        self.problems: list[str] = []
        #: Pipelines: every one made, (pipeline id, step name) of steps that always
        #: fail, the ones this run cancelled.
        self.pipelines: set[str] = set()
        self.permanent_steps: set[tuple[str, str]] = set()
        self.cancelled_pipelines: set[str] = set()
        #: Transforms by reference: task id -> the output record it names.
        self.by_reference: dict[str, JSON] = {}
        self.finished = False
        self.counts: Counter[str] = Counter()
        self.categories: Counter[str] = Counter()
        self._stopping = False
        self._twins: dict[tuple[str, str], set[str]] = {}
        self._keyed: list[tuple[Spec, str]] = []
        self._duplicates: list[Spec] = []
        self._to_cancel: set[str] = set()
        self._to_retry: set[str] = set()
        self._plain: dict[str, Spec] = {}  # by label: plain specs a pipeline may reuse
        self._sources: list[str] = []  # plain tasks whose output may be referred to
        # Its own dice: how many candidates it looks at depends on timing, and the task
        # mix of a seed must not.
        self._ref_rng = random.Random(rng.random())

    @property
    def settled(self) -> bool:
        """Every submission made, and no pipeline waiting to be retried once it ends."""
        return self.finished and not self._to_retry

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
            "pipelines": len(self.pipelines),
            "pipelines_cancelled_pending": self.counts["pipelines_cancelled_pending"],
            "pipelines_cancelled_running": self.counts["pipelines_cancelled_running"],
            "pipelines_retried": self.counts["pipelines_retried"],
            "pipelines_reusing": self.counts["pipelines_reusing"],
            "by_reference": self.counts["by_reference"],
        }

    # submitting

    async def submit_all(self) -> None:
        """Submit the tasks in small batches, keeping about ``backlog`` PENDING."""
        try:
            for start in range(0, self.tasks, BATCH):
                if not await self._room():
                    return
                specs = [
                    self._reusing(make_spec(i, self.rng))
                    for i in range(start, min(start + BATCH, self.tasks))
                ]
                await asyncio.gather(*(self._submit_new(spec) for spec in specs))
                await self._resubmit_some()
            await self._a_reference_at_least()
        finally:
            self.finished = True

    async def _a_reference_at_least(self) -> None:
        """A run that made no transform by reference yet (each look found its sources
        still running) waits, up to ``REF_WAIT_S``, for its oldest sources to end and
        makes one: a short or loaded run has inputs by reference to check too."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REF_WAIT_S
        while not self.counts["by_reference"] and self._sources and not self._stopping:
            await self._by_reference()
            if self.counts["by_reference"] or loop.time() > deadline:
                return
            await asyncio.sleep(POLL_S)

    async def _room(self) -> bool:
        while not self._stopping:
            counts = (await self.app.engine.store.stats(tenant=None, ghost_after_s=60)).counts
            if counts.get(str(Status.PENDING), 0) < self.backlog:
                return True
            await asyncio.sleep(POLL_S)
        return False

    async def _submit(self, spec: Spec) -> SubmitResult:
        self.counts["submissions"] += 1
        return await self.app.submit(
            spec.kind, spec.params, tenant=spec.tenant, idempotency_key=spec.key,
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
            self.problems.append(f"new content ({spec.label}) answered with "
                                 f"existing task {first.task.id}")  # fmt: skip
            return
        await self._follow_up(spec, first.task.id)

    def _reusing(self, spec: Spec) -> Spec:
        """A share of the pipelines get, as their generate step's params, those of an
        earlier plain task of their tenant (made in an earlier batch, so the choice is
        the seed's), each task once (two pipelines could be identical otherwise); that
        task is then sent again no more (its content may be the step's by then, which a
        duplicate would rightly be answered with)."""
        if spec.category != "pipeline":
            return spec
        roll, pick = self.rng.random(), self.rng.random()
        earlier = sorted(s.label for s in self._plain.values() if s.tenant == spec.tenant)
        if roll >= REUSE_SHARE or not earlier:
            return spec
        plain = self._plain.pop(earlier[int(pick * len(earlier))])  # once: no twin pipelines
        self._duplicates = [d for d in self._duplicates if d is not plain]
        steps = [{**spec.params["steps"][0], "params": plain.params}, *spec.params["steps"][1:]]
        failing = tuple(name for name in spec.failing_steps if name != "generate")
        self.counts["pipelines_reusing"] += 1
        return replace(spec, params={**spec.params, "steps": steps}, failing_steps=failing)

    def _record_created(self, spec: Spec, result: SubmitResult) -> None:
        task = result.task
        self.created.add(task.id)
        self._twins.setdefault((spec.tenant, spec.label), set()).add(task.id)
        if spec.category == "permanent":
            self.permanent.add(task.id)
        if spec.category == "pipeline":
            self.pipelines.add(task.id)
            self.permanent_steps.update((task.id, name) for name in spec.failing_steps)
            if spec.failing_steps:  # a step always fails: it never succeeds, either policy
                self.permanent.add(task.id)
        elif spec.category == "plain":
            self._sources.append(task.id)
            self._plain.setdefault(spec.label, spec)

    async def _follow_up(self, spec: Spec, task_id: str) -> None:
        if spec.category == "pipeline":
            await self._follow_pipeline(spec, task_id)
            return
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
        if self._ref_rng.random() < REF_SHARE and self._sources:
            await self._by_reference()

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
        twins = self._twins.get((spec.tenant, spec.label), set())
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
        """Cancel each ``cancel_running`` task once a worker is GENERATING it (a pipeline
        once one of its steps runs); retry the pipelines chosen for it once they end."""
        while not self._stopping:
            for task_id in sorted(self._to_cancel):
                task = await self.app.get(task_id)
                if task.kind == pipelines.KIND:
                    if await self._cancel_pipeline_running(task):
                        self._to_cancel.discard(task_id)
                elif task.status is Status.GENERATING:
                    self._to_cancel.discard(task_id)
                    await self._cancel(task_id)
                elif task.final:
                    self._to_cancel.discard(task_id)
                    self.counts["cancel_missed"] += 1
            await self.retry_ended()
            await asyncio.sleep(POLL_S)

    # pipelines

    async def _follow_pipeline(self, spec: Spec, pipeline_id: str) -> None:
        if spec.retry_after:
            self._to_retry.add(pipeline_id)
        if spec.follow == "cancel_pending":
            await self._cancel_pipeline(pipeline_id, "pipelines_cancelled_pending")
        elif spec.follow == "cancel_running":
            self._to_cancel.add(pipeline_id)

    async def _cancel_pipeline(self, pipeline_id: str, counted: str) -> None:
        """Cancel a running pipeline (its waiting steps cancelled, its running ones asked
        to stop); one that ended first is counted as missed."""
        try:
            await self.app.cancel(pipeline_id, tenant=None)
        except AlreadyFinal:
            self.counts["cancel_missed"] += 1
            return
        self.cancelled_pipelines.add(pipeline_id)
        self.counts[counted] += 1

    async def _cancel_pipeline_running(self, pipeline: Task) -> bool:
        """Cancel it once one of its steps runs; whether it is done with (cancelled or
        ended first)."""
        if pipeline.final:
            self.counts["cancel_missed"] += 1
            return True
        steps = await self.app.pipeline_steps(pipeline)
        if not any(step.status in RUNNING for step in steps.values()):
            return False
        await self._cancel_pipeline(pipeline.id, "pipelines_cancelled_running")
        return True

    async def retry_ended(self) -> None:
        """Retry once each pipeline chosen for it that ended FAILED or CANCELLED (a SUCCESS
        is left alone): it runs again what did not succeed."""
        for pipeline_id in sorted(self._to_retry):
            pipeline = await self.app.get(pipeline_id)
            if not pipeline.final or pipeline_id in self._to_cancel:
                continue
            if pipeline.status is Status.SUCCESS:
                self._to_retry.discard(pipeline_id)
                continue
            try:
                await self.app.retry(pipeline_id, tenant=None)
            except NotRetryable as exc:
                self.problems.append(f"retry of {pipeline.status} pipeline {pipeline_id}: {exc}")
            else:
                self.cancelled_pipelines.discard(pipeline_id)  # that cancel is over
                self.counts["pipelines_retried"] += 1
            # Only now: until then the run must not end (the pipeline looks final).
            self._to_retry.discard(pipeline_id)

    # inputs by reference

    async def _by_reference(self) -> None:
        """Transform, by reference, the output of an earlier plain task that succeeded
        (one look at the oldest few candidates, the likeliest to have ended, whatever the
        backlog; a source is used once)."""
        for task_id in self._sources[:REF_LOOK]:
            task = await self.app.get(task_id)
            if not task.final:
                continue
            self._sources.remove(task_id)
            if task.status is Status.SUCCESS:
                await self._submit_reference(task)
                return

    async def _submit_reference(self, source: Task) -> None:
        output = (source.result or {})["outputs"][0]
        params = self._ref_rng.choice(({"op": "thumbnail", "width": 24, "height": 24},
                                  {"op": "resize", "width": 40, "height": 40},
                                  {"op": "convert", "format": "webp"}))  # fmt: skip
        refs = {transform.INPUT: inputs.referenced(f"sha256:{output['sha256']}")}
        store, storage = self.app.engine.store, self.app.storage
        try:
            records, held = await inputs.refer(
                store, storage, source.tenant, refs,
                max_pixels=self.app.settings.max_image_pixels,
            )  # fmt: skip
        except KilnError as exc:
            self.problems.append(f"the output of SUCCESS task {source.id} was refused "
                                 f"as a reference: {exc}")  # fmt: skip
            return
        try:
            self.counts["submissions"] += 1
            result = await self.app.submit(
                transform.KIND, params, tenant=source.tenant, inputs=records
            )
        except BaseException:
            await inputs.release(store, storage, held, drop=True)
            raise
        await inputs.release(store, storage, held)
        self.counts["by_reference"] += 1
        self.categories["by_reference"] += 1
        if result.created:
            self.created.add(result.task.id)
            self.by_reference[result.task.id] = output
        else:
            self.problems.append(f"a transform of {source.id}'s output by reference answered "
                                 f"existing task {result.task.id}")  # fmt: skip
