"""A submission as one value: made once from any face's request, handed down once.

Every face that creates tasks (``POST /v1/tasks`` as JSON or multipart, a batch's items,
a rerun, the Comfy API v2's ``POST /api/v2/jobs``, the library's :meth:`kiln.App.submit`)
turns its request into a :class:`Submission` with :func:`submission_of` (through
:meth:`kiln.App.submission`): the kind's params are validated there, once, with every
other check a submission takes (the moment, the metadata, the webhook, the inputs the kind
takes, ``KILN_MAX_TASKS_PER_REQUEST``). The value then goes down unchanged: the App takes
the tenant's tokens for it (:meth:`kiln.App.admit`), finds the inputs it names by
reference and pins its uploaded files (:meth:`kiln.App.holding`), and stores it
(:meth:`kiln.App.enter` → :meth:`kiln.engine.Engine.submit` → the store), nothing
checked twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiln import canonical, inputs, limits, pipelines, timing, webhooks
from kiln.config import Settings
from kiln.errors import InvalidRequest
from kiln.kinds import TaskKind
from kiln.models import JSON, NewTask, Timeouts, TraceContext
from kiln.storage import Storage
from kiln.store import Store

DEFAULT_TENANT = "default"


class Maker(Protocol):
    """What :func:`submission_of` needs of an App: the kinds, the settings, the clock."""

    @property
    def settings(self) -> Settings: ...

    def kind(self, name: str) -> TaskKind: ...

    def now(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Submission:
    """One submission, checked: what a task (or a pipeline) is created from."""

    kind: str
    #: The kind's params, validated (canonical, defaults applied): never validated again.
    params: JSON
    tenant: str = DEFAULT_TENANT
    idempotency_key: str | None = None
    dedup: bool = True
    priority: int = 0
    max_attempts: int = 3
    deadline_s: float = 86400
    timeouts: Timeouts = field(default_factory=Timeouts)
    metadata: JSON = field(default_factory=dict)
    #: Input records (``kiln.inputs.record``): uploaded files, and once found, references.
    inputs: tuple[JSON, ...] = ()
    #: Inputs named by reference, still to be found: (name, sha256).
    references: tuple[tuple[str, str], ...] = ()
    #: The webhook the submission asked for (``kiln.webhooks.webhook_spec``), or None.
    webhook: JSON | None = None
    #: The moment as given (``run_at``, ``delay_s``) and the moment it gives (None: now).
    run_at: float | str | None = None
    delay_s: float | None = None
    due_at: float | None = None
    #: When it was made: a ``due_at`` after it delays the task.
    made_at: float = 0.0
    rerun_of: str | None = None
    #: The tasks it creates (a pipeline: itself and every copy of its steps).
    tasks: int = 1

    def body(self) -> JSON:
        """The request as the fingerprint sees it (API.md): a retry with the same
        Idempotency-Key and this body is a replay. ``delay_s`` stays as given, not the
        moment it gives."""
        body: JSON = {
            "kind": self.kind,
            "params": self.params,
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "deadline_s": self.deadline_s,
            "dedup": self.dedup,
            "timeouts": [
                self.timeouts.waiting_s,
                self.timeouts.generating_s,
                self.timeouts.uploading_s,
            ],
            "metadata": self.metadata,
            "inputs": self.contents(),
        }
        if self.webhook is not None:  # only then: a body without one keeps its old fingerprint
            body["webhook"] = self.webhook
        if self.rerun_of is not None:
            body["rerun_of"] = self.rerun_of
        given = (("run_at", self.run_at), ("delay_s", self.delay_s))
        body.update({k: v for k, v in given if v is not None})
        return body

    def contents(self) -> list[str]:
        """The inputs by what they hold, never by a file name."""
        return [f"{i['name']}:{i['sha256']}" for i in self.inputs]

    def content_key(self) -> str | None:
        """The dedup key of its content (None when it asked for no content dedup)."""
        if not self.dedup:
            return None
        contents = self.contents()
        if self.due_at is not None and self.due_at > self.made_at:
            # A delayed task shares content only with one of the same content and moment.
            contents = [*contents, f"run_at:{round(self.due_at * 1000)}"]
        return canonical.dedup_key(self.kind, self.params, contents)

    def new_task(
        self, kind: TaskKind, trace: TraceContext | None = None, content_key: str | None = None
    ) -> NewTask:
        """The task row the store inserts (or finds) for this submission; ``content_key``:
        its :meth:`content_key` when the caller made it already."""
        fingerprint, older = canonical.request_fingerprints(
            self.body(), older=bool(self.idempotency_key)
        )
        clean = self.params
        return NewTask(
            id=canonical.new_task_id(),
            tenant=self.tenant,
            kind=self.kind,
            params=clean,
            fingerprint=fingerprint,
            older_fingerprints=older,
            idempotency_key=self.idempotency_key,
            dedup_key=content_key if content_key is not None else self.content_key(),
            priority=self.priority,
            max_attempts=self.max_attempts,
            deadline_s=self.deadline_s,
            timeouts=self.timeouts,
            metadata=self.metadata,
            inputs=list(self.inputs),
            webhook=self.webhook,
            model=kind.model_of(clean),
            batch_key=kind.batch.key_of(clean) if kind.batch else None,
            run_at=self.due_at,
            rerun_of=self.rerun_of,
            trace=trace,
        )


#: ``json.dumps(value, allow_nan=False)``, its encoder made once.
_STRICT = json.JSONEncoder(allow_nan=False)


def check_metadata(metadata: JSON | None) -> None:
    """Refuse (InvalidRequest) metadata that is not plain, finite JSON: what is stored
    must always render."""
    if not metadata and (metadata is None or metadata == {}):
        return
    try:
        _STRICT.encode(metadata)
    except (TypeError, ValueError, RecursionError):
        raise InvalidRequest(
            "metadata must be plain JSON with finite numbers",
            details=[{"loc": ["metadata"], "msg": "not plain JSON", "type": "json_invalid"}],
        ) from None


def _moment(kind: str, run_at: float | str | None, delay_s: float | None, now: float) -> Any:
    when = timing.run_at_of(run_at, delay_s, now)
    if kind == pipelines.KIND and when is not None:
        field = "run_at" if run_at is not None else "delay_s"
        raise InvalidRequest(
            "a pipeline starts its first steps when it is submitted: it takes no run_at "
            "or delay_s (a recurring schedule may start one later)",
            details=[
                {"loc": ["body", field], "msg": "not taken by kind pipeline", "type": "value_error"}
            ],
        )
    return when


def _references(
    task_kind: TaskKind, references: Mapping[str, str] | None, files: Sequence[str]
) -> tuple[tuple[str, str], ...]:
    """The inputs named by reference (name → sha256), refused (InvalidRequest) for a
    name the kind does not take or that a file part also sends."""
    refs = {name: inputs.referenced(value) for name, value in (references or {}).items()}
    for name in refs:
        if name not in task_kind.inputs or name in files:
            why = "twice" if name in files else f"but {task_kind.name} does not take it"
            detail = {"loc": ["inputs", name], "msg": "unexpected input", "type": "input"}
            raise InvalidRequest(f"the input {name!r} was sent {why}", details=[detail])
    return tuple(refs.items())


def submission_of(
    maker: Maker,
    kind: str,
    params: Any,
    *,
    tenant: str = DEFAULT_TENANT,
    idempotency_key: str | None = None,
    dedup: bool = True,
    priority: int = 0,
    max_attempts: int = 3,
    deadline_s: float = 86400,
    timeouts: Timeouts | None = None,
    metadata: JSON | None = None,
    inputs: Sequence[JSON] = (),
    references: Mapping[str, str] | None = None,
    webhook_url: str | None = None,
    webhook_events: Sequence[str] | None = None,
    run_at: float | str | None = None,
    delay_s: float | None = None,
    rerun_of: str | None = None,
) -> Submission:
    """The one way a request becomes a :class:`Submission`, refused (InvalidRequest,
    UnknownKind, TooManyTasks) before anything is stored. ``inputs`` are the records of the
    files sent with it; ``references`` the inputs it names by reference (``sha256:...``),
    found later by :meth:`kiln.App.holding`, which checks the params against them all."""
    now = maker.now()
    when = _moment(kind, run_at, delay_s, now)
    task_kind = maker.kind(kind)
    clean = task_kind.validate(params)  # the one validation of the params
    tasks = limits.tasks_in(kind, params)
    limits.check_tasks_per_request(tasks, maker.settings.max_tasks_per_request)
    refs = _references(task_kind, references, [str(i["name"]) for i in inputs])
    check_metadata(metadata)
    webhook = webhooks.webhook_spec(
        webhook_url, webhook_events, allow_private=maker.settings.webhook_allow_private
    )
    if not refs:  # with references, once they are found (holding)
        task_kind.check_inputs(clean, list(inputs))
    return Submission(
        kind=kind,
        params=clean,
        tenant=tenant,
        idempotency_key=idempotency_key,
        dedup=dedup,
        priority=priority,
        max_attempts=max_attempts,
        deadline_s=deadline_s,
        timeouts=timeouts or task_kind.timeouts or Timeouts(),
        metadata=metadata or {},
        inputs=tuple(inputs),
        references=refs,
        webhook=webhook,
        run_at=run_at,
        delay_s=delay_s,
        due_at=when,
        made_at=now,
        rerun_of=rerun_of,
        tasks=tasks,
    )


@contextlib.asynccontextmanager
async def pinned(
    store: Store, storage: Storage, files: Sequence[tuple[str, bytes]], *, drop: bool = True
) -> AsyncIterator[None]:
    """Input files (sha256, bytes) kept and pinned while the block runs, so retention
    leaves them be; released after. ``drop``: when the block fails, what was written for
    it goes again (unless a task or another upload uses it)."""
    held = await inputs.hold(store, storage, files)
    try:
        yield
    except BaseException:
        await inputs.release(store, storage, held, drop=drop)
        raise
    await inputs.release(store, storage, held)


@contextlib.asynccontextmanager
async def holding(
    store: Store,
    storage: Storage,
    submission: Submission,
    kind_of: Callable[[str], TaskKind],
    files: Sequence[tuple[str, bytes]] = (),
    *,
    max_pixels: int,
    drop: bool = True,
) -> AsyncIterator[Submission]:
    """The submission with every input in it: those named by reference found among the
    tenant's uploads and outputs (an output copied into ``inputs/``), the params checked
    against them all, the files kept; all of them pinned while the block runs. When the
    block fails, what this request wrote goes again (see :func:`pinned`)."""
    refs = dict(submission.references)
    referred: list[JSON] = []
    by_ref = inputs.Held((), ())
    if refs:
        referred, by_ref = await inputs.refer(
            store, storage, submission.tenant, refs, max_pixels=max_pixels
        )
    try:
        task_kind = kind_of(submission.kind)
        order = {name: n for n, name in enumerate(task_kind.inputs)}
        # In the kind's order, however they came: an upload and a reference are alike.
        every = sorted([*submission.inputs, *referred], key=lambda i: order.get(str(i["name"]), -1))
        if refs:
            task_kind.check_inputs(submission.params, every)
        async with pinned(store, storage, files, drop=drop):
            yield dataclasses.replace(submission, inputs=tuple(every), references=())
    except BaseException:
        await inputs.release(store, storage, by_ref, drop=True)
        raise
    await inputs.release(store, storage, by_ref)
