"""HTTP clients for kiln's API: :class:`Client` (sync) and :class:`AsyncClient`.

Both faces share everything but the sending: :class:`Call` describes a request and how its
answer is read, :func:`error_from_response` turns an error envelope into the matching
:class:`~kiln.errors.KilnError`, and :class:`SSEDecoder` with :class:`Follow` parse and
resume a task's event stream.

>>> with kiln.Client("http://127.0.0.1:8000", api_key="...") as client:
...     task = client.submit(params={"prompt": "a red fox"})
...     done = client.wait(task["id"])
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from kiln import errors, wire
from kiln.errors import KilnError

JSON = dict[str, Any]

DEFAULT_SERVER = "http://127.0.0.1:8000"
#: An input named by its content: ``sha256:<64 hex>`` (docs/uploads.md, "Inputs by
#: reference").
REFERENCE_PREFIX = "sha256:"
DEFAULT_TIMEOUT_S = 30.0
#: A silent event stream is dropped and resumed after this long (servers ping more often).
STREAM_READ_S = 60.0
#: With a deadline, the sync client re-checks it at least this often on a silent stream.
DEADLINE_TICK_S = 2.0
#: Consecutive failed reconnections of an event stream before giving up.
STREAM_RETRIES = 10


class ConnectionFailed(KilnError):
    """The server could not be reached, or the connection broke and could not be resumed."""

    code = "connection_failed"


def _error_classes() -> dict[str, type[KilnError]]:
    found: dict[str, type[KilnError]] = {}
    for value in vars(errors).values():
        if isinstance(value, type) and issubclass(value, KilnError) and value is not KilnError:
            found.setdefault(value.code, value)
    return found


#: API error code → the error class the client raises for it.
ERROR_CLASSES: Mapping[str, type[KilnError]] = _error_classes()

#: Used when a response carries no recognisable error envelope.
STATUS_CLASSES: Mapping[int, type[KilnError]] = {
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    413: errors.PayloadTooLarge,
    415: errors.UnsupportedMediaType,
    422: errors.InvalidRequest,
    429: errors.RateLimited,
}


# responses and errors


def _envelope(response: httpx.Response) -> tuple[str | None, str, list[Any]]:
    try:
        body = response.json()
    except (ValueError, UnicodeDecodeError):
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        details = error.get("details")
        return (
            str(error.get("code") or "") or None,
            str(error.get("message") or response.reason_phrase),
            details if isinstance(details, list) else [],
        )
    text = response.text.strip()[:200] if response.content else ""
    return None, text or f"HTTP {response.status_code} {response.reason_phrase}".strip(), []


def _retry_after_s(response: httpx.Response) -> float:
    try:
        return max(float(response.headers.get("Retry-After", "1")), 0.0)
    except ValueError:
        return 1.0


def error_from_response(response: httpx.Response) -> KilnError:
    """The KilnError subclass an error response's ``error.code`` names, with ``status_code``."""
    code, message, details = _envelope(response)
    cls = ERROR_CLASSES.get(code or "") or STATUS_CLASSES.get(response.status_code, KilnError)
    exc: KilnError
    if cls is errors.RateLimited:
        exc = errors.RateLimited(message, retry_after_s=_retry_after_s(response))
        exc.details = details
    else:
        exc = cls(message, details=details)
    if code and code != cls.code:
        exc.code = code  # a code this client does not know keeps its name
    exc.status_code = response.status_code  # type: ignore[attr-defined]
    return exc


def connection_failed(server: str, exc: httpx.TransportError) -> ConnectionFailed:
    reason = str(exc) or type(exc).__name__
    if "Connection refused" in reason or "Errno 111" in reason:
        reason = "connection refused"
    return ConnectionFailed(f"cannot reach {server}: {reason}")


def read_json(response: httpx.Response) -> Any:
    if response.is_error:
        raise error_from_response(response)
    return response.json()


def read_bytes(response: httpx.Response) -> bytes:
    if response.is_error:
        raise error_from_response(response)
    return response.content


def read_submitted(response: httpx.Response) -> JSON:
    """The task, plus whether this request created it, replayed a key or hit a duplicate."""
    task: JSON = read_json(response)
    task["created"] = response.status_code == 201
    task["replayed"] = response.headers.get(wire.REPLAYED_HEADER, "").lower() == "true"
    task["deduplicated"] = bool(task.get("deduplicated", False))
    return task


# requests


@dataclass(frozen=True, slots=True)
class Call:
    """One API request and the function that reads its answer."""

    method: str
    path: str
    read: Callable[[httpx.Response], Any] = read_json
    params: dict[str, Any] | None = None
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    files: dict[str, Any] | None = None


def input_reference(source: bytes | str | os.PathLike[str]) -> str:
    """The reference that names these bytes (or the file at this path) as an input of a
    submission, ``sha256:<hex>``, so that content the tenant already uploaded, or a task
    of its made, is not sent again: ``client.submit(kind, params, inputs={"image": ref})``.
    A reference the server does not know for the tenant is 422: upload the file then."""
    digest = hashlib.sha256()
    if isinstance(source, bytes):
        digest.update(source)
    else:
        with open(source, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
    return REFERENCE_PREFIX + digest.hexdigest()


def submit_call(
    kind: str,
    params: Mapping[str, Any] | None,
    idempotency_key: str | None,
    fields: Mapping[str, Any],
    files: Mapping[str, Any] | None = None,
) -> Call:
    body = {"kind": kind, "params": dict(params or {}), **fields}
    headers = {wire.IDEMPOTENCY_HEADER: idempotency_key} if idempotency_key is not None else {}
    if files:
        parts: dict[str, Any] = {"request": (None, json.dumps(body), "application/json")}
        parts.update(files)
        return Call("POST", wire.TASKS_PATH, read_submitted, headers=headers, files=parts)
    return Call("POST", wire.TASKS_PATH, read_submitted, body=body, headers=headers)


def batch_call(items: Sequence[Mapping[str, Any]]) -> Call:
    def read(response: httpx.Response) -> list[JSON]:
        answers: list[JSON] = read_json(response)["items"]
        return answers

    return Call("POST", wire.TASKS_PATH + "/batch", read, body={"tasks": [dict(i) for i in items]})


def rerun_call(
    task_id: str, params: Mapping[str, Any] | None, priority: int | None, dedup: bool
) -> Call:
    body: JSON = {"params": dict(params or {}), "dedup": dedup}
    if priority is not None:
        body["priority"] = priority
    return Call("POST", wire.task_path(task_id, "rerun"), read_submitted, body=body)


@dataclass(frozen=True, slots=True)
class BulkAsk:
    """One bulk action (``POST /v1/tasks/cancel`` or ``/retry``) as its pages ask it."""

    action: str
    filter: Mapping[str, Any]
    all_tasks: bool
    dry_run: bool
    limit: int

    def call(self, cursor: str | None) -> Call:
        body: JSON = {"filter": dict(self.filter), "all": self.all_tasks,
                      "dry_run": self.dry_run, "limit": self.limit}  # fmt: skip
        if cursor is not None:
            body["cursor"] = cursor
        return Call("POST", f"{wire.TASKS_PATH}/{self.action}", body=body)

    def next_of(self, page: JSON) -> BulkAsk | None:
        """The ask of the next page, or None after the last (a dry run is one page). The
        filter becomes the one the server resolved (relative times made absolute), so
        every page names the same tasks."""
        if self.dry_run or page.get("cursor") is None:
            return None
        return BulkAsk(self.action, page.get("filter") or self.filter, self.all_tasks,
                       self.dry_run, self.limit)  # fmt: skip


def list_call(status: str | None, kind: str | None, limit: int, cursor: str | None) -> Call:
    query = {"status": status, "kind": kind, "limit": limit, "cursor": cursor}
    return Call("GET", wire.TASKS_PATH, params={k: v for k, v in query.items() if v is not None})


#: Where schedules live in the HTTP API.
SCHEDULES_PATH = "/v1/schedules"


def schedule_path(schedule_id: str, *rest: str) -> str:
    return "/".join([SCHEDULES_PATH, quote(schedule_id, safe=""), *rest])


def schedule_create_call(cron: str, task: Mapping[str, Any], fields: Mapping[str, Any]) -> Call:
    return Call("POST", SCHEDULES_PATH, body={"cron": cron, "task": dict(task), **fields})


def schedule_list_call(limit: int, cursor: str | None) -> Call:
    query = {"limit": limit} | ({"cursor": cursor} if cursor is not None else {})
    return Call("GET", SCHEDULES_PATH, params=query)


def usage_call(
    since: str | None, until: str | None, group_by: Sequence[str], tenant: str | None
) -> Call:
    query = {"from": since, "to": until, "group_by": ",".join(group_by) or None, "tenant": tenant}
    return Call("GET", "/v1/usage", params={k: v for k, v in query.items() if v is not None})


def review_call(task_id: str, decision: str, reason: str | None) -> Call:
    body = {"decision": decision} | ({"reason": reason} if reason is not None else {})
    return Call("POST", wire.task_path(task_id, "review"), body=body)


def redeliver_call(task_id: str, delivery_id: str) -> Call:
    return Call("POST", wire.task_path(task_id, "webhooks", delivery_id, "redeliver"))


# event streams


class SSEDecoder:
    """Server-sent event lines in, parsed messages out (dicts with a ``type``).

    ``last_id`` is the stream's last event id, the value to resume from.
    """

    def __init__(self) -> None:
        self.last_id: str | None = None
        self._event: str | None = None
        self._data: list[str] = []

    def feed(self, line: str) -> JSON | None:
        """Take one line (without its end of line); a message when a blank line ends one."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        return None

    def _dispatch(self) -> JSON | None:
        event, data = self._event, self._data
        self._event, self._data = None, []
        if not data:
            return None
        text = "\n".join(data)
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        message: JSON = parsed if isinstance(parsed, dict) else {"data": parsed}
        message.setdefault("type", event or "message")
        return message


class Follow:
    """The state of one task's event stream across reconnections."""

    def __init__(self, task_id: str, after: int | None, deadline: float | None = None) -> None:
        self.task_id = task_id
        self.last_id = None if after is None else str(after)
        self.deadline = deadline
        self.ended = False
        self.opened = False
        self.failures = 0
        self.decoder = SSEDecoder()

    def call(self) -> Call:
        headers = {"Accept": "text/event-stream"}
        if self.last_id is not None:
            headers["Last-Event-ID"] = self.last_id
        return Call("GET", wire.task_path(self.task_id, "events"), headers=headers)

    def read_timeout_s(self) -> float:
        if self.deadline is None:
            return STREAM_READ_S
        return max(min(self.remaining_s(), DEADLINE_TICK_S), 0.001)

    def remaining_s(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def check_deadline(self) -> None:
        if self.remaining_s() <= 0:
            raise TimeoutError(f"task {self.task_id} did not finish in time")

    def connected(self) -> None:
        self.opened = True
        self.decoder = SSEDecoder()
        self.decoder.last_id = self.last_id

    def feed(self, line: str) -> JSON | None:
        message = self.decoder.feed(line)
        self.last_id = self.decoder.last_id
        if message is not None:
            self.failures = 0
            if message.get("type") == "status":
                self.ended = bool(message.get("final"))
        return message

    def dropped(self, server: str, exc: httpx.TransportError) -> float:
        """The pause before reconnecting; raises once reconnecting keeps failing."""
        self.check_deadline()
        if isinstance(exc, httpx.ReadTimeout) and self.deadline is not None:
            return 0.0  # a deadline tick, not a failure
        self.failures += 1
        if self.failures > STREAM_RETRIES or not self.opened:
            raise connection_failed(server, exc) from exc
        return min(0.1 * 2.0 ** (self.failures - 1), 2.0)

    def closed_early(self, server: str) -> float:
        """The server closed the stream before a final event: pause, then resume."""
        self.failures += 1
        if self.failures > STREAM_RETRIES:
            raise ConnectionFailed(f"the event stream of {self.task_id} on {server} keeps closing")
        return min(0.1 * 2.0 ** (self.failures - 1), 2.0)


# the two faces


class _Base:
    http: httpx.Client | httpx.AsyncClient

    def __init__(self, server: str, api_key: str | None, timeout_s: float) -> None:
        self.server = server.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def _options(self) -> dict[str, Any]:
        headers = {"User-Agent": "kiln-client"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return {"base_url": self.server, "headers": headers, "timeout": self.timeout_s}

    @staticmethod
    def _request_args(call: Call) -> dict[str, Any]:
        args: dict[str, Any] = {"params": call.params, "headers": call.headers}
        if call.files is not None:
            args["files"] = call.files
        elif call.body is not None:
            args["json"] = call.body
        return args

    def _stream_request(self, follow: Follow) -> httpx.Request:
        call = follow.call()
        timeout = httpx.Timeout(self.timeout_s, read=follow.read_timeout_s())
        return self.http.build_request(
            call.method, call.path, timeout=timeout, **self._request_args(call)
        )

    def output_url(self, output: Mapping[str, Any]) -> str:
        """The full URL of an output of a task's ``result``."""
        return self.server + str(output["url"])


class Client(_Base):
    """A synchronous client. Use as a context manager, or call :meth:`close`."""

    http: httpx.Client

    def __init__(
        self,
        server: str = DEFAULT_SERVER,
        api_key: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(server, api_key, timeout_s)
        self.http = httpx.Client(transport=transport, **self._options())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        try:
            return self.http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise connection_failed(self.server, exc) from exc

    def call(self, call: Call) -> Any:
        request = self.http.build_request(call.method, call.path, **self._request_args(call))
        return call.read(self._send(request))

    def submit(
        self,
        kind: str = "image.generate",
        params: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        files: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> JSON:
        """Submit a task (``fields``: priority, max_attempts, deadline_s, dedup, timeouts,
        metadata, webhook_url, webhook_events, run_at or delay_s to run it later). The task
        JSON plus ``created``, ``replayed`` and ``deduplicated``.

        ``files`` uploads inputs, as ``multipart/form-data``: ``{"image": ("fox.png", data)}``
        (a name and bytes or an open binary file, as httpx takes them). ``inputs`` names
        inputs by content instead, ``{"image": input_reference(data)}``: an earlier upload
        or output of the tenant's tasks, never sent again (both may be given)."""
        result: JSON = self.call(submit_call(kind, params, idempotency_key, fields, files))
        return result

    def submit_pipeline(
        self,
        steps: Sequence[Mapping[str, Any]],
        *,
        on_failure: str = "stop",
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> JSON:
        """Submit a pipeline (docs/pipelines.md): ``steps`` in order, each ``{"name",
        "kind", "params", "inputs": {"image": "step:NAME/OUTPUT"}, "repeat"}``. The
        pipeline's task JSON, as :meth:`submit` answers; ``get`` shows its ``steps``."""
        params = {"steps": list(steps), "on_failure": on_failure}
        return self.submit("pipeline", params, idempotency_key=idempotency_key, **fields)

    def submit_many(self, items: Sequence[Mapping[str, Any]]) -> list[JSON]:
        """Submit up to 1,000 tasks in one request (``POST /v1/tasks/batch``): each item a
        submission body (``kind``, ``params``, ... and an optional ``idempotency_key``).
        One answer per item, in order: ``{"index", "status", "task", "error"}``, where
        status is created, replayed, deduplicated or refused (then ``error`` says why)."""
        answers: list[JSON] = self.call(batch_call(items))
        return answers

    def rerun(
        self,
        task_id: str,
        params: Mapping[str, Any] | None = None,
        *,
        priority: int | None = None,
        dedup: bool = True,
    ) -> JSON:
        """A new task of the same kind, ``params`` merged over the original's; its
        ``rerun_of`` is ``task_id``. ``dedup=False`` makes a new variation even when an
        identical task exists. The task JSON plus ``created`` and ``deduplicated``."""
        result: JSON = self.call(rerun_call(task_id, params, priority, dedup))
        return result

    def get(self, task_id: str) -> JSON:
        result: JSON = self.call(Call("GET", wire.task_path(task_id)))
        return result

    def cancel(self, task_id: str) -> JSON:
        result: JSON = self.call(Call("POST", wire.task_path(task_id, "cancel")))
        return result

    def retry(self, task_id: str) -> JSON:
        result: JSON = self.call(Call("POST", wire.task_path(task_id, "retry")))
        return result

    def cancel_many(
        self,
        filter: Mapping[str, Any] | None = None,
        *,
        all_tasks: bool = False,
        dry_run: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Iterator[JSON]:
        """Cancel the tasks ``filter`` names (``status``, ``kind``, ``code``: lists;
        ``tenant``; ``created_after``/``created_before``: unix seconds, RFC 3339 or ``1h``),
        page by page from ``cursor``: one answer per page (``matched``, ``cancelled``,
        ``cancel_requested``, ``skipped``, ``cursor``). An empty filter needs
        ``all_tasks=True``; ``dry_run`` answers one page with the count."""
        return self._pages(BulkAsk("cancel", filter or {}, all_tasks, dry_run, limit), cursor)

    def retry_many(
        self,
        filter: Mapping[str, Any] | None = None,
        *,
        all_tasks: bool = False,
        dry_run: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Iterator[JSON]:
        """Retry the final tasks ``filter`` names, page by page: see :meth:`cancel_many`
        (the answers count ``retried``)."""
        return self._pages(BulkAsk("retry", filter or {}, all_tasks, dry_run, limit), cursor)

    def _pages(self, ask: BulkAsk | None, cursor: str | None) -> Iterator[JSON]:
        while ask is not None:
            page: JSON = self.call(ask.call(cursor))
            yield page
            ask, cursor = ask.next_of(page), page.get("cursor")

    def review(self, task_id: str, decision: str, reason: str | None = None) -> JSON:
        result: JSON = self.call(review_call(task_id, decision, reason))
        return result

    def webhooks(self, task_id: str) -> JSON:
        """The task's webhook deliveries: ``{"task_id", "webhook", "items": [...]}``."""
        result: JSON = self.call(Call("GET", wire.task_path(task_id, "webhooks")))
        return result

    def redeliver(self, task_id: str, delivery_id: str) -> JSON:
        """Send one of the task's webhook deliveries again (admin key); the delivery."""
        result: JSON = self.call(redeliver_call(task_id, delivery_id))
        return result

    def download(self, task_id: str, name: str) -> bytes:
        result: bytes = self.call(Call("GET", wire.task_path(task_id, "outputs", name), read_bytes))
        return result

    def stats(self) -> JSON:
        result: JSON = self.call(Call("GET", "/v1/stats"))
        return result

    def workers(self) -> JSON:
        """The live worker processes (admin key): ``{"workers": [...]}``."""
        result: JSON = self.call(Call("GET", "/v1/workers"))
        return result

    def usage(
        self,
        since: str | None = None,
        until: str | None = None,
        group_by: Sequence[str] = (),
        tenant: str | None = None,
    ) -> JSON:
        """The GPU-second ledger's sums (``GET /v1/usage``): attempts that ended in
        ``[since, until)`` (RFC 3339 or dates), by the keys of ``group_by``; ``tenant``
        for the admin key only."""
        result: JSON = self.call(usage_call(since, until, group_by, tenant))
        return result

    def wait(self, task_id: str, timeout_s: float | None = None) -> JSON:
        """Follow the task's events until it is final, then return the task.

        Raises TimeoutError when ``timeout_s`` passes first.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for _ in self._follow(Follow(task_id, None, deadline)):
            pass
        return self.get(task_id)

    def stream(self, task_id: str, after: int | None = None) -> Iterator[JSON]:
        """The task's events (status and progress), resumed with Last-Event-ID after a drop;
        ends once the task is final."""
        return self._follow(Follow(task_id, after))

    def _follow(self, follow: Follow) -> Iterator[JSON]:
        while True:
            try:
                yield from self._stream_once(follow)
            except httpx.TransportError as exc:
                time.sleep(follow.dropped(self.server, exc))
                continue
            if follow.ended or self.get(follow.task_id)["final"]:
                return
            time.sleep(follow.closed_early(self.server))

    def _stream_once(self, follow: Follow) -> Iterator[JSON]:
        follow.check_deadline()
        response = self.http.send(self._stream_request(follow), stream=True)
        with contextlib.closing(response):
            if response.is_error:
                response.read()
                raise error_from_response(response)
            follow.connected()
            for line in response.iter_lines():
                message = follow.feed(line)
                if message is not None:
                    yield message
                follow.check_deadline()

    def list(
        self,
        status: str | None = None,
        kind: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> JSON:
        """One page, newest first: ``{"items": [...], "next_cursor": ...}``."""
        result: JSON = self.call(list_call(status, kind, limit, cursor))
        return result

    def create_schedule(self, cron: str, task: Mapping[str, Any], **fields: Any) -> JSON:
        """Create a schedule: ``cron`` (five fields, or six with seconds first), ``task`` (a
        submission body: kind, params, priority, ...), ``fields``: timezone, overlap
        (skip, queue), missed (fire_once, skip), paused."""
        result: JSON = self.call(schedule_create_call(cron, task, fields))
        return result

    def schedules(self, limit: int = 50, cursor: str | None = None) -> JSON:
        """One page of schedules, oldest first: ``{"items": [...], "next_cursor": ...}``."""
        result: JSON = self.call(schedule_list_call(limit, cursor))
        return result

    def schedule(self, schedule_id: str) -> JSON:
        result: JSON = self.call(Call("GET", schedule_path(schedule_id)))
        return result

    def pause_schedule(self, schedule_id: str) -> JSON:
        result: JSON = self.call(Call("POST", schedule_path(schedule_id, "pause")))
        return result

    def resume_schedule(self, schedule_id: str) -> JSON:
        result: JSON = self.call(Call("POST", schedule_path(schedule_id, "resume")))
        return result

    def delete_schedule(self, schedule_id: str) -> JSON:
        result: JSON = self.call(Call("DELETE", schedule_path(schedule_id)))
        return result


class AsyncClient(_Base):
    """The asynchronous face of :class:`Client`: the same methods, awaited."""

    http: httpx.AsyncClient

    def __init__(
        self,
        server: str = DEFAULT_SERVER,
        api_key: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(server, api_key, timeout_s)
        self.http = httpx.AsyncClient(transport=transport, **self._options())

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        try:
            return await self.http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise connection_failed(self.server, exc) from exc

    async def call(self, call: Call) -> Any:
        request = self.http.build_request(call.method, call.path, **self._request_args(call))
        return call.read(await self._send(request))

    async def submit(
        self,
        kind: str = "image.generate",
        params: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        files: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> JSON:
        """See :meth:`Client.submit`."""
        result: JSON = await self.call(submit_call(kind, params, idempotency_key, fields, files))
        return result

    async def submit_pipeline(
        self,
        steps: Sequence[Mapping[str, Any]],
        *,
        on_failure: str = "stop",
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> JSON:
        """See :meth:`Client.submit_pipeline`."""
        params = {"steps": list(steps), "on_failure": on_failure}
        return await self.submit("pipeline", params, idempotency_key=idempotency_key, **fields)

    async def submit_many(self, items: Sequence[Mapping[str, Any]]) -> list[JSON]:
        """See :meth:`Client.submit_many`."""
        answers: list[JSON] = await self.call(batch_call(items))
        return answers

    async def rerun(
        self,
        task_id: str,
        params: Mapping[str, Any] | None = None,
        *,
        priority: int | None = None,
        dedup: bool = True,
    ) -> JSON:
        """See :meth:`Client.rerun`."""
        result: JSON = await self.call(rerun_call(task_id, params, priority, dedup))
        return result

    async def get(self, task_id: str) -> JSON:
        result: JSON = await self.call(Call("GET", wire.task_path(task_id)))
        return result

    async def cancel(self, task_id: str) -> JSON:
        result: JSON = await self.call(Call("POST", wire.task_path(task_id, "cancel")))
        return result

    async def retry(self, task_id: str) -> JSON:
        result: JSON = await self.call(Call("POST", wire.task_path(task_id, "retry")))
        return result

    async def cancel_many(
        self,
        filter: Mapping[str, Any] | None = None,
        *,
        all_tasks: bool = False,
        dry_run: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> AsyncIterator[JSON]:
        """See :meth:`Client.cancel_many`."""
        ask = BulkAsk("cancel", filter or {}, all_tasks, dry_run, limit)
        async for page in self._pages(ask, cursor):
            yield page

    async def retry_many(
        self,
        filter: Mapping[str, Any] | None = None,
        *,
        all_tasks: bool = False,
        dry_run: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> AsyncIterator[JSON]:
        """See :meth:`Client.retry_many`."""
        ask = BulkAsk("retry", filter or {}, all_tasks, dry_run, limit)
        async for page in self._pages(ask, cursor):
            yield page

    async def _pages(self, ask: BulkAsk | None, cursor: str | None) -> AsyncIterator[JSON]:
        while ask is not None:
            page: JSON = await self.call(ask.call(cursor))
            yield page
            ask, cursor = ask.next_of(page), page.get("cursor")

    async def review(self, task_id: str, decision: str, reason: str | None = None) -> JSON:
        result: JSON = await self.call(review_call(task_id, decision, reason))
        return result

    async def webhooks(self, task_id: str) -> JSON:
        """See :meth:`Client.webhooks`."""
        result: JSON = await self.call(Call("GET", wire.task_path(task_id, "webhooks")))
        return result

    async def redeliver(self, task_id: str, delivery_id: str) -> JSON:
        """See :meth:`Client.redeliver`."""
        result: JSON = await self.call(redeliver_call(task_id, delivery_id))
        return result

    async def download(self, task_id: str, name: str) -> bytes:
        call = Call("GET", wire.task_path(task_id, "outputs", name), read_bytes)
        result: bytes = await self.call(call)
        return result

    async def stats(self) -> JSON:
        result: JSON = await self.call(Call("GET", "/v1/stats"))
        return result

    async def workers(self) -> JSON:
        """See :meth:`Client.workers`."""
        result: JSON = await self.call(Call("GET", "/v1/workers"))
        return result

    async def usage(
        self,
        since: str | None = None,
        until: str | None = None,
        group_by: Sequence[str] = (),
        tenant: str | None = None,
    ) -> JSON:
        """See :meth:`Client.usage`."""
        result: JSON = await self.call(usage_call(since, until, group_by, tenant))
        return result

    async def wait(self, task_id: str, timeout_s: float | None = None) -> JSON:
        """See :meth:`Client.wait`."""
        async with asyncio.timeout(timeout_s):
            async for _ in self.stream(task_id):
                pass
            return await self.get(task_id)

    async def stream(self, task_id: str, after: int | None = None) -> AsyncIterator[JSON]:
        """See :meth:`Client.stream`."""
        follow = Follow(task_id, after)
        while True:
            try:
                async with contextlib.aclosing(self._stream_once(follow)) as messages:
                    async for message in messages:
                        yield message
            except httpx.TransportError as exc:
                await asyncio.sleep(follow.dropped(self.server, exc))
                continue
            if follow.ended or (await self.get(task_id))["final"]:
                return
            await asyncio.sleep(follow.closed_early(self.server))

    async def _stream_once(self, follow: Follow) -> AsyncGenerator[JSON, None]:
        response = await self.http.send(self._stream_request(follow), stream=True)
        try:
            if response.is_error:
                await response.aread()
                raise error_from_response(response)
            follow.connected()
            async for line in response.aiter_lines():
                message = follow.feed(line)
                if message is not None:
                    yield message
        finally:
            await response.aclose()

    async def list(
        self,
        status: str | None = None,
        kind: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> JSON:
        """See :meth:`Client.list`."""
        result: JSON = await self.call(list_call(status, kind, limit, cursor))
        return result

    async def create_schedule(self, cron: str, task: Mapping[str, Any], **fields: Any) -> JSON:
        """Create a schedule: ``cron`` (five fields, or six with seconds first), ``task`` (a
        submission body: kind, params, priority, ...), ``fields``: timezone, overlap
        (skip, queue), missed (fire_once, skip), paused."""
        result: JSON = await self.call(schedule_create_call(cron, task, fields))
        return result

    async def schedules(self, limit: int = 50, cursor: str | None = None) -> JSON:
        """One page of schedules, oldest first: ``{"items": [...], "next_cursor": ...}``."""
        result: JSON = await self.call(schedule_list_call(limit, cursor))
        return result

    async def schedule(self, schedule_id: str) -> JSON:
        result: JSON = await self.call(Call("GET", schedule_path(schedule_id)))
        return result

    async def pause_schedule(self, schedule_id: str) -> JSON:
        result: JSON = await self.call(Call("POST", schedule_path(schedule_id, "pause")))
        return result

    async def resume_schedule(self, schedule_id: str) -> JSON:
        result: JSON = await self.call(Call("POST", schedule_path(schedule_id, "resume")))
        return result

    async def delete_schedule(self, schedule_id: str) -> JSON:
        result: JSON = await self.call(Call("DELETE", schedule_path(schedule_id)))
        return result
