"""The requests both clients send: a :class:`Call` names the method, path, query, body
and headers of one request and the reader of its answer; the functions here build them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from kiln import wire
from kiln.client.responses import JSON, read_json, read_submitted
from kiln.client.uploads import multipart_parts


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
        parts = multipart_parts(body, files)
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
        body: JSON = {
            "filter": dict(self.filter),
            "all": self.all_tasks,
            "dry_run": self.dry_run,
            "limit": self.limit,
        }
        if cursor is not None:
            body["cursor"] = cursor
        return Call("POST", f"{wire.TASKS_PATH}/{self.action}", body=body)

    def next_of(self, page: JSON) -> BulkAsk | None:
        """The ask of the next page, or None after the last (a dry run is one page). The
        filter becomes the one the server resolved (relative times made absolute), so
        every page names the same tasks."""
        if self.dry_run or page.get("cursor") is None:
            return None
        filter_ = page.get("filter") or self.filter
        return BulkAsk(self.action, filter_, self.all_tasks, self.dry_run, self.limit)


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
