"""The Comfy API v2 tests' server: kiln (a real uvicorn server) whose `comfy.workflow` jobs
run through the real worker driver (``kiln.backends.comfy_workflow``) on a stand-in
ComfyUI process (``tests/services/comfyui_standin.py``, ComfyUI's documented HTTP and
WebSocket API over nodes that paint real pictures).

:func:`comfy_server` registers the driver against the stand-in's URL and runs one
in-process worker that names the kind (``App.worker(kinds=[...])``, as
``kiln worker --kinds comfy.workflow`` does); with ``gated=True`` that worker starts only
once :func:`gate_of` is set, so a test can open a job's stream before the job runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx
from api_support import ALICE_KEY, ApiUnderTest, bearer, live_server, make_kiln, with_keys
from PIL import Image
from tests.services.comfyui_nodes import txt2img
from tests.services.comfyui_standin import DEFAULT_CHECKPOINTS

import kiln
from kiln.api import create_app
from kiln.backends import comfy_workflow
from kiln.config import Settings

KIND = comfy_workflow.KIND
CKPT = DEFAULT_CHECKPOINTS[0]
#: The SaveImage node of :func:`graph`, and the LoadImage node an ``image`` goes to.
OUTPUT_NODE = "9"
IMAGE_NODE = "10"
STEPS = 3
#: Where no ComfyUI runs (a server whose jobs stay queued): nothing listens there.
NOWHERE = "http://127.0.0.1:9"
_GATES: weakref.WeakKeyDictionary[kiln.App, asyncio.Event] = weakref.WeakKeyDictionary()


def gate_of(app: kiln.App) -> asyncio.Event:
    """What the worker of a ``gated`` :func:`comfy_server` waits for before it claims."""
    return _GATES.setdefault(app, asyncio.Event())


def png(color: tuple[int, int, int], size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


def graph(
    seed: int = 1,
    *,
    image: Any = None,
    steps: int = STEPS,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """ComfyUI's text-to-image graph (checkpoint ``CKPT``, KSampler node ``3``, SaveImage
    node ``9``) the stand-in runs; with ``image``, a LoadImage node ``10`` of it too,
    shown by a PreviewImage node ``11`` (a ``temp`` image: no output)."""
    nodes = txt2img(CKPT, seed=seed, steps=steps, size=32)
    if image is not None:
        nodes[IMAGE_NODE] = {"class_type": "LoadImage", "inputs": {"image": image}}
        nodes["11"] = {"class_type": "PreviewImage", "inputs": {"images": [IMAGE_NODE, 0]}}
    nodes.update(extra or {})
    return nodes


def scaled(seed: int) -> dict[str, Any]:
    """:func:`graph` with an ImageScale node ``12`` between the decoder and the save."""
    nodes = graph(seed)
    nodes["12"] = {
        "class_type": "ImageScale",
        "inputs": {
            "image": ["8", 0],
            "upscale_method": "bilinear",
            "width": 16,
            "height": 16,
            "crop": "disabled",
        },
    }
    nodes[OUTPUT_NODE]["inputs"]["images"] = ["12", 0]
    return nodes


async def _work(app: kiln.App, gated: bool) -> None:
    worker = app.worker(kinds=[KIND], concurrency=1, idle_poll_s=(0.02, 0.1))
    if gated:
        await gate_of(app).wait()
    try:
        await worker.run()
    finally:
        await worker.stop()


@contextlib.asynccontextmanager
async def comfy_server(
    settings: Settings, *, comfyui: str | None = None, gated: bool = False
) -> AsyncIterator[tuple[str, ApiUnderTest]]:
    """A real uvicorn server of kiln (keys for alice and bob) with the `comfy.workflow`
    driver of the ComfyUI at ``comfyui`` and one worker for it (none without
    ``comfyui``: jobs stay queued): its base URL, and an in-process client as alice."""
    app = make_kiln(with_keys(settings))
    comfy_workflow.register(app, url=comfyui or NOWHERE)
    http = create_app(app)
    async with (
        live_server(http) as base,
        httpx.AsyncClient(base_url=base, headers=bearer(ALICE_KEY), timeout=30) as client,
    ):
        runner = asyncio.create_task(_work(app, gated)) if comfyui is not None else None
        try:
            yield base, ApiUnderTest(app, http, client, ALICE_KEY)
        finally:
            if runner is not None:
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner
