"""The two faces of kiln's HTTP client, side by side: :class:`Client` (sync) and
:class:`AsyncClient`. They share everything but the sending: the requests
(:mod:`kiln.client.calls`), the reading of answers and errors
(:mod:`kiln.client.responses`) and the event stream (:mod:`kiln.client.events`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import httpx

from kiln import wire
from kiln.client.calls import (
    BulkAsk,
    Call,
    batch_call,
    list_call,
    redeliver_call,
    rerun_call,
    review_call,
    schedule_create_call,
    schedule_list_call,
    schedule_path,
    submit_call,
    usage_call,
)
from kiln.client.events import Follow
from kiln.client.responses import JSON, connection_failed, error_from_response, read_bytes

DEFAULT_SERVER = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 30.0


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
