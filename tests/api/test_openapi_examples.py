"""Every request example of README.md and docs/*.md is taken by the published OpenAPI
document (jsonschema) and by a real kiln app; an example marked as a refusal is refused by
both. The examples are read from the markdown (tests/doc_examples.py says how)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_support import ADMIN_KEY, ALICE_KEY, ApiUnderTest, bearer, image_body, running_api
from openapi_support import body_errors, served_kiln

from doc_examples import Example, examples, with_references
from images import png
from kiln.config import Settings
from kiln.timing import Cron

EXAMPLES = examples()
RESIZE = {"op": "resize", "width": 20, "height": 15}


@pytest.fixture
async def served(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """kiln's API with the kinds `kiln serve` registers, keys for alice and the admin."""
    keyed = settings.with_(api_keys={ALICE_KEY: "alice"}, admin_key=ADMIN_KEY)
    async with running_api(keyed, key=ALICE_KEY, kiln_app=served_kiln(keyed)) as under_test:
        yield under_test


def test_the_docs_have_the_examples_the_contract_promises() -> None:
    # The extractor finds every form: curl bodies, marked JSON blocks, client calls,
    # uploads, schedules, refusals (a marker or a curl it stops finding fails here)
    sources = {e.source for e in EXAMPLES}
    assert {
        "README.md",
        "docs/pipelines.md",
        "docs/schedules.md",
        "docs/uploads.md",
        "docs/webhooks.md",
        "docs/tracing.md",
    } <= sources
    paths = {e.path for e in EXAMPLES}
    assert {
        "/v1/tasks",
        "/v1/schedules",
        "/v1/tasks/batch",
        "/v1/tasks/retry",
        "/v1/tasks/{task_id}/rerun",
    } <= paths
    assert any(e.files for e in EXAMPLES) and any(e.refused for e in EXAMPLES)
    assert len(EXAMPLES) >= 18


async def _prepared(served: ApiUnderTest, example: Example) -> tuple[str, Any]:
    """The example's path and body, with the task and the picture it speaks of made."""
    path, body = example.path, example.body
    if "{task_id}" in path:
        made = await served.submit(image_body("a task to name"))
        path = path.replace("{task_id}", made.json()["id"])
    if "sha256:" in json.dumps(body):
        upload = await served.client.post(
            "/v1/tasks",
            files={
                "image": ("photo.png", png(), "image/png"),
                "request": (
                    None,
                    json.dumps(
                        {
                            "kind": "image.transform",
                            "params": {"op": "resize", "width": 20, "height": 15},
                        }
                    ),
                ),
            },
        )
        assert upload.status_code == 201, upload.text
        body = with_references(body, "sha256:" + upload.json()["inputs"][0]["sha256"])
    return path, body


async def _send(served: ApiUnderTest, example: Example, path: str, body: Any) -> Any:
    headers = {**example.headers, **(bearer(ADMIN_KEY) if example.admin else {})}
    if example.files:
        parts = {name: ("photo.png", png(), "image/png") for name in example.files}
        parts["request"] = (None, json.dumps(body), "application/json")
        return await served.client.request(example.method, path, files=parts, headers=headers)
    return await served.client.request(example.method, path, json=body, headers=headers)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
async def test_a_docs_example_is_taken_by_the_document_and_by_kiln(
    served: ApiUnderTest, example: Example
) -> None:
    document = (await served.client.get("/openapi.json")).json()
    path, body = await _prepared(served, example)
    # When the document checks the example's body
    errors = body_errors(
        document, example.method, example.path, body, multipart=bool(example.files)
    )
    # And kiln gets it
    response = await _send(served, example, path, body)
    if example.refused:
        # Then a refusal is refused by both, in the error envelope
        assert errors, f"{example.id}: the document takes an example of a refusal"
        assert response.status_code == 422, response.text
        assert set(response.json()) == {"error"}
    else:
        # Then both take it
        assert errors == [], f"{example.id}: {errors}"
        assert response.status_code in (200, 201), f"{example.id}: {response.text}"


# What the document takes that it used to refuse ------------------------------------------

CRONS = [
    "0 9 * * 1-5",
    "0 30 17 L * *",
    "0 0 9 * JAN-JUN MON#1",
    "*/10 * * * * *",
    "15,45 8-18/2 * JAN-JUN,SEP MON-FRI",
    "0 0 31 * *",
    "*/15 * * * *",
    "0 0 29 2 *",
]


@pytest.mark.parametrize("cron", CRONS)
async def test_a_cron_the_scheduler_reads_is_taken_by_the_document_and_by_kiln(
    served: ApiUnderTest, cron: str
) -> None:
    Cron.parse(cron, "UTC", now=served.kiln.engine.now())  # the scheduler's own parser
    document = (await served.client.get("/openapi.json")).json()
    body = {"cron": cron, "task": image_body("a tick")}
    assert body_errors(document, "POST", "/v1/schedules", body) == []
    response = await served.client.post("/v1/schedules", json=body)
    assert response.status_code == 201, response.text
    assert response.json()["cron"] == cron


async def test_a_cron_the_scheduler_refuses_is_refused_by_kiln_with_the_parsers_reason(
    served: ApiUnderTest,
) -> None:
    # A well-formed expression that never fires: only the parser can tell
    body = {"cron": "0 0 30 2 *", "task": image_body("never")}
    response = await served.client.post("/v1/schedules", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["details"][0]["loc"] == ["body", "cron"]
    assert (await served.client.get("/v1/schedules")).json()["items"] == []


WEBHOOK_URLS = [
    "https://example.com/hooks/kiln",
    "http://127.0.0.1:8080/hook",
    "http://localhost:9000/x",
    "https://hooks.example.com:65535/a?b=c",
    "http://receiver:10000",
    "https://[::1]:8443/",
    "http://Example.COM/Path_With-Caps",
    "https://example.com",
]


@pytest.mark.parametrize("url", WEBHOOK_URLS)
async def test_any_http_url_with_a_host_is_taken_by_the_document(
    served: ApiUnderTest, url: str
) -> None:
    document = (await served.client.get("/openapi.json")).json()
    body = image_body("a hook", webhook_url=url)
    assert body_errors(document, "POST", "/v1/tasks", body) == []


REFUSED = [
    *(
        image_body("a hook", webhook_url=url)
        for url in ("ftp://example.com/x", "https://", "http://example.com:0/", "http://a:65536/")
    ),
    {"kind": "image.transform", "params": {"op": "convert"}},  # its input, neither sent nor named
    {"kind": "image.generate", "params": {"prompt": "a fox"}, "inputs": {"image": "sha256:…"}},
    {
        "kind": "pipeline",
        "params": {
            "steps": [{"name": "a", "kind": "image.transform", "params": {"prompt": "a fox"}}]
        },
    },
    {
        "kind": "pipeline",
        "params": {
            "steps": [
                {
                    "name": "a",
                    "kind": "image.generate",
                    "params": {"prompt": "a fox"},
                    "inputs": {"image": "step:b/image.png"},
                }
            ]
        },
    },
]


@pytest.mark.parametrize("body", REFUSED)
async def test_a_body_no_server_takes_is_refused_by_the_document_and_by_kiln(
    served: ApiUnderTest, body: dict[str, Any]
) -> None:
    _, body = await _prepared(served, Example("test", 0, "POST", "/v1/tasks", body))
    document = (await served.client.get("/openapi.json")).json()
    assert body_errors(document, "POST", "/v1/tasks", body) != []
    assert (await served.submit(body)).status_code == 422


async def test_a_loopback_webhook_is_the_servers_policy_not_the_documents(
    settings: Settings,
) -> None:
    body = image_body("a local hook", webhook_url="http://127.0.0.1:18080/hook")
    for allow, status in ((False, 422), (True, 201)):
        allowed = settings.with_(webhook_allow_private=allow)
        async with running_api(allowed, kiln_app=served_kiln(allowed)) as under_test:
            document = (await under_test.client.get("/openapi.json")).json()
            assert body_errors(document, "POST", "/v1/tasks", body) == []
            answer = await under_test.submit(body)
            assert answer.status_code == status, answer.text


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/tasks", image_body("later", run_at="2026-01-01T09:00:00+01:00")),
        ("POST", "/v1/tasks/cancel", {"filter": {"created_before": "2026-12-01T00:00:00Z"}}),
        ("POST", "/v1/tasks/retry", {"filter": {"created_after": "2026-01-01T00:00:00Z"}}),
        (
            "POST",
            "/v1/tasks",
            {
                "kind": "image.contact_sheet",
                "params": {"columns": 2},
                "inputs": {"images": "sha256:…"},
            },
        ),
    ],
)
async def test_a_time_and_an_input_by_reference_are_taken_by_the_document_and_by_kiln(
    served: ApiUnderTest, method: str, path: str, body: dict[str, Any]
) -> None:
    example = Example("test", 0, method, path, body)
    path, body = await _prepared(served, example)
    document = (await served.client.get("/openapi.json")).json()
    assert body_errors(document, method, path, body) == []
    response = await served.client.request(method, path, json=body)
    assert response.status_code in (200, 201), response.text
