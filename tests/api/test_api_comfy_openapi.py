"""``GET /api/v2/openapi.json`` describes the v2 routes kiln serves: exactly those routes,
shapes that agree with the official client's generated models (``comfy_low.models``, made
from Comfy's own v2 spec), and real answers of a running server that validate against it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from api_support import ApiUnderTest, wait_until
from comfy_low.models import _generated as client_models
from comfy_support import comfy_server, graph, png
from fastapi.routing import APIRoute
from jsonschema import Draft202012Validator
from tests.services.comfyui_standin import Process

from kiln.config import Settings

pytestmark = pytest.mark.timeout(120)

#: Components named as the client's models, which must agree with them.
SHARED = (
    "Asset",
    "Job",
    "Output",
    "Progress",
    "JobError",
    "JobUrls",
    "Error",
    "ErrorEnvelope",
    "JobWorkflowResponse",
)


@pytest.fixture
async def served(settings: Settings) -> AsyncIterator[tuple[str, ApiUnderTest]]:
    """The server with no worker: jobs stay queued."""
    async with comfy_server(settings) as found:
        yield found


@pytest.fixture
def comfyui_url(tmp_path: Path) -> Iterator[str]:
    """A stand-in ComfyUI process: its URL."""
    comfyui = Process(tmp_path / "comfyui", "--step-s", "0.02", "--load-s", "0")
    try:
        yield comfyui.url
    finally:
        comfyui.stop()


@pytest.fixture
async def working(settings: Settings, comfyui_url: str) -> AsyncIterator[tuple[str, ApiUnderTest]]:
    """The server with a worker whose jobs run on the stand-in ComfyUI."""
    async with comfy_server(settings, comfyui=comfyui_url) as found:
        yield found


async def document(client: httpx.AsyncClient) -> dict[str, Any]:
    answer = await client.get("/api/v2/openapi.json", headers={"Authorization": ""})
    assert answer.status_code == 200  # no key needed
    found: dict[str, Any] = answer.json()
    return found


def api_routes(routes: list[Any]) -> Iterator[APIRoute]:
    """Every route of an application, those of the routers it includes too."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif hasattr(route, "original_router"):  # an included router
            yield from api_routes(route.original_router.routes)


def validate(doc: dict[str, Any], name: str, instance: Any) -> None:
    """``instance`` against the document's component ``name``."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    Draft202012Validator(schema).validate(instance)


async def test_the_document_lists_exactly_the_v2_routes_kiln_serves(
    served: tuple[str, ApiUnderTest],
) -> None:
    # Given the routes the application serves under /api/v2
    _, api = served
    served_routes = {
        (route.path, method.lower())
        for route in api_routes(api.http.routes)
        if route.path.startswith("/api/v2/")
        for method in route.methods
    }
    # When the document is read
    doc = await document(api.client)
    listed = {(path, method) for path, item in doc["paths"].items() for method in item}
    # Then it lists those, and only those
    assert listed == served_routes
    # And it is OpenAPI a tool loads: every operation, every schema valid JSON Schema
    operations = list(schemathesis.openapi.from_dict(doc).get_all_operations())
    assert len(operations) == len(served_routes)
    for schema in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)


async def test_the_shapes_agree_with_the_clients_generated_models(
    served: tuple[str, ApiUnderTest],
) -> None:
    doc = await document(served[1].client)
    schemas = doc["components"]["schemas"]
    for name in SHARED:
        # Given the client's model of the same name
        theirs = getattr(client_models, name).model_json_schema()
        ours = schemas[name]
        # Then kiln requires every field the client requires (a valid answer has them)
        assert set(theirs.get("required", [])) <= set(ours["required"]), name
        # And it knows every field the client reads
        assert set(theirs["properties"]) <= set(ours["properties"]), name
    # And the statuses are the contract's, the output types some of its
    statuses = {s.value for s in client_models.JobStatus}
    assert set(schemas["JobStatus"]["enum"]) == statuses
    output_types = {t.value for t in client_models.OutputType}
    assert set(schemas["Output"]["properties"]["type"]["enum"]) <= output_types


async def test_real_answers_validate_against_the_document(
    working: tuple[str, ApiUnderTest],
) -> None:
    # Given a document, an uploaded asset and a job that succeeded
    _, api = working
    client = api.client
    doc = await document(client)
    files = {"file": ("photo.png", png((1, 2, 3)), "image/png")}
    uploaded = await client.post("/api/v2/assets", files=files, data={"file_path": "photo.png"})
    validate(doc, "Asset", uploaded.json())
    answer = await client.post("/api/v2/jobs", json={"workflow": graph(21)})
    validate(doc, "Job", answer.json())
    job_id = answer.json()["id"]

    async def succeeded() -> bool:
        return (await client.get(f"/api/v2/jobs/{job_id}")).json()["status"] == "succeeded"

    await wait_until(succeeded, 30)
    # Then each answer is what the document says
    job = (await client.get(f"/api/v2/jobs/{job_id}")).json()
    validate(doc, "Job", job)
    validate(doc, "JobList", (await client.get("/api/v2/jobs")).json())
    validate(doc, "Asset", (await client.get(f"/api/v2/assets/{job['outputs'][0]['id']}")).json())
    workflow = (await client.get(f"/api/v2/jobs/{job_id}/workflow")).json()
    validate(doc, "JobWorkflowResponse", workflow)
    validate(doc, "Health", (await client.get("/api/v2/health")).json())
    validate(doc, "ErrorEnvelope", (await client.get("/api/v2/jobs/tsk_nope")).json())
