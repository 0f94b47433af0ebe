"""The Comfy API v2 tests' server: kiln with a TEST-ONLY ``comfy.workflow`` handler.

Until the ComfyUI driver is merged, the jobs these tests run are done by
:func:`register_stand_in`, a small handler registered here for ``comfy.workflow`` with
the real params model (``kiln.backends.comfy_workflow_params``): it reads each asset the
graph references from kiln's inputs, reports progress the way the driver does (stage
``node:<id>:<class>``, a JPEG preview), and stores one real PNG output named
``<node_id>-<file name>``. A ``FailNode`` fails the attempt as a ComfyUI node error does;
a ``WaitNode`` works in steps until cancelled; a ``GateNode`` waits for :func:`gate_of`
to be set (so a test can open a stream before the steps happen). No ComfyUI is involved:
the end-to-end tests with the stand-in ComfyUI live with the driver.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import weakref
from collections.abc import AsyncIterator
from typing import Any

from api_support import ALICE_KEY, ApiUnderTest, bearer, live_server, make_kiln, with_keys
from PIL import Image

import kiln
from kiln import inputs
from kiln.api import create_app
from kiln.backends.comfy_workflow_params import KIND, ComfyWorkflowParams, models_of
from kiln.config import Settings
from kiln.errors import Permanent
from kiln.kinds import ANY_INPUTS
from kiln.models import Output
from kiln.worker import Context

OUTPUT_NODE = "9"
OUTPUT_FILE = "ComfyUI_00001_.png"
STEPS = 3
_GATES: weakref.WeakKeyDictionary[kiln.App, asyncio.Event] = weakref.WeakKeyDictionary()


def gate_of(app: kiln.App) -> asyncio.Event:
    """What a ``GateNode`` of ``app``'s jobs waits for."""
    return _GATES.setdefault(app, asyncio.Event())


def png(color: tuple[int, int, int], size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg_data_url(color: tuple[int, int, int]) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buffer, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def graph(
    seed: int = 1, *, image: Any = "example.png", extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A small API-format graph: a checkpoint, a sampler, an image, a save node."""
    nodes: dict[str, Any] = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd15.safetensors"}},
        "3": {
            "class_type": "KSampler",
            "inputs": {"seed": seed, "steps": STEPS, "model": ["4", 0]},
        },
        "10": {"class_type": "LoadImage", "inputs": {"image": image}},
        OUTPUT_NODE: {"class_type": "SaveImage", "inputs": {"images": ["3", 0]}},
    }
    nodes.update(extra or {})
    return nodes


def register_stand_in(app: kiln.App) -> None:
    """TEST-ONLY: a ``comfy.workflow`` handler standing in for the ComfyUI driver."""

    @app.task(KIND, params=ComfyWorkflowParams, inputs=(ANY_INPUTS,), model=models_of)
    async def run(ctx: Context, params: ComfyWorkflowParams) -> list[Output]:
        workflow = params.graph()
        for node_id, node in workflow.items():
            if node["class_type"] == "FailNode":
                raise Permanent(
                    f"node {node_id} failed: boom",
                    code="node_execution_error",
                    details=[
                        {
                            "node_id": node_id,
                            "node_type": "FailNode",
                            "exception_type": "RuntimeError",
                            "exception_message": "boom",
                        }
                    ],
                )
            if node["class_type"] == "GateNode":
                await gate_of(app).wait()
            if node["class_type"] == "WaitNode":
                for step in range(10_000):  # the work goes on until a cancel stops it
                    await ctx.progress(step, 10_000, stage=f"node:{node_id}:WaitNode")
                    await asyncio.sleep(0.02)
        loaded = [
            await inputs.load(app.storage, inputs.named(ctx.task.inputs, name))
            for name in params.assets.values()
        ]
        for step in range(1, STEPS + 1):
            await ctx.progress(
                step, STEPS, stage="node:3:KSampler", preview=jpeg_data_url((step * 60, 0, 0))
            )
        shade = sum(len(data) for data in loaded) % 256
        return [Output(f"{OUTPUT_NODE}-{OUTPUT_FILE}", png((shade, 100, 200)), "image/png")]


@contextlib.asynccontextmanager
async def comfy_server(
    settings: Settings, *, workers: int = 1
) -> AsyncIterator[tuple[str, ApiUnderTest]]:
    """A real uvicorn server of kiln (keys for alice and bob) with the stand-in handler and
    a worker of ``workers`` slots in the process: its base URL, and an in-process client
    as alice. The worker names ``comfy.workflow``, as a ComfyUI instance's worker does
    (a worker claims that kind only when it names it)."""
    import httpx

    app = make_kiln(with_keys(settings))
    register_stand_in(app)
    http = create_app(app)
    async with (
        live_server(http) as base,
        httpx.AsyncClient(base_url=base, headers=bearer(ALICE_KEY), timeout=30) as client,
    ):
        worker = app.worker(concurrency=workers, kinds=[KIND]) if workers else None
        running = None if worker is None else asyncio.create_task(worker.run())
        try:
            yield base, ApiUnderTest(app, http, client, ALICE_KEY)
        finally:
            if worker is not None and running is not None:
                await worker.stop()
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
