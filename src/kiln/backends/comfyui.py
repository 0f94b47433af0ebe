"""The `comfyui` backend: a ComfyUI server's prompt queue, running an API-format workflow.

The workflow (``KILN_COMFYUI_WORKFLOW``) is a graph saved with ComfyUI's "Save (API)":
``{"<node id>": {"class_type": "KSampler", "inputs": {...}}, ...}``. Its string values may
hold placeholders: ``{{prompt}}``, ``{{negative_prompt}}``, ``{{seed}}``, ``{{steps}}``,
``{{width}}``, ``{{height}}``, ``{{model}}``. A value that is only a placeholder becomes the
task's value with its type (``"seed": "{{seed}}"`` becomes ``"seed": 7``); inside longer
text it is replaced as text (``"text": "{{prompt}}, film grain"``). ``{{prompt}}`` is
required.

The checkpoint a task needs (warm-model routing) is its ``model`` param, for a workflow
whose checkpoint loader reads ``"ckpt_name": "{{model}}"`` (a task without one is refused);
else the workflow's own ``ckpt_name``, and a task may not name another. ComfyUI keeps the
checkpoint it last ran loaded, so a worker says it holds the one its last run used.

One generation, as ComfyUI's ``script_examples/websockets_api_example.py`` does it:

1. Open ``GET /ws?clientId=<id>`` (WebSocket), with a new client id per generation.
2. ``POST /prompt`` ``{"prompt": <filled workflow>, "client_id": "<id>"}`` answers
   ``{"prompt_id": "...", "number": 3, "node_errors": {}}``; an invalid workflow is 400
   ``{"error": {"type", "message", "details", "extra_info"}, "node_errors": {...}}``.
3. Text messages on the socket are ``{"type": ..., "data": {...}}``:
   ``status`` ``{"status": {"exec_info": {"queue_remaining": n}}}``;
   ``execution_start`` ``{"prompt_id"}``; ``execution_cached`` ``{"nodes": [...],
   "prompt_id"}``; ``executing`` ``{"node": "3", "prompt_id"}``; ``progress``
   ``{"value": 12, "max": 30, "prompt_id", "node"}``; ``executed`` ``{"node", "output",
   "prompt_id"}``; ``execution_error`` ``{"prompt_id", "node_id", "node_type",
   "executed", "exception_message", "exception_type", "traceback", "current_inputs",
   "current_outputs"}``; ``execution_interrupted`` ``{"prompt_id", "node_id",
   "node_type", "executed"}``. ``executing`` with ``"node": null`` and our prompt id means
   done (ComfyUI sends it after writing the history). Binary messages are previews: a
   4-byte big-endian event type (1), a 4-byte image type (1 JPEG, 2 PNG), the image.
4. ``GET /history/<prompt_id>`` answers ``{"<prompt_id>": {"prompt": [...], "outputs":
   {"<node id>": {"images": [{"filename", "subfolder", "type"}]}}, "status":
   {"status_str": "success", "completed": true, "messages": [...]}}}``.
5. ``GET /view?filename=&subfolder=&type=`` answers the image's bytes.

The first image of type ``output`` (a SaveImage node) is the task's output, else the
first image of any type. Progress: stage ``queued`` until ComfyUI starts the prompt,
``generate`` with ComfyUI's step n of m (and a preview when ComfyUI sends them), then
``download``. When a generation is abandoned (timeout, cancel, lost socket) its prompt is
deleted from ComfyUI's queue, and interrupted when it was running.

A node that fails (``execution_error``) fails the task for good (``upstream_rejected``):
ComfyUI is deterministic for the same inputs, except for running out of GPU memory,
which is retryable (``upstream_unavailable``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import io
import json
import re
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from PIL import Image

from kiln import tracing
from kiln.backends.upstream import (
    BAD_RESPONSE,
    REJECTED,
    UNAVAILABLE,
    Upstream,
    UpstreamMetrics,
    check_response,
    require_image,
)
from kiln.circuit import CircuitBreaker
from kiln.config import Settings
from kiln.demo import GenerateParams
from kiln.errors import InvalidRequest, Permanent, Retryable
from kiln.models import JSON

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

    from kiln.worker import Context

NAME = "comfyui"
PLACEHOLDER = re.compile(r"\{\{\s*(prompt|negative_prompt|seed|steps|width|height|model)\s*\}\}")
#: Cleaning up an abandoned prompt (delete from the queue, interrupt) takes at most this.
ABANDON_TIMEOUT_S = 2.0
#: Largest WebSocket message accepted (previews are small, but not tiny).
MAX_MESSAGE_BYTES = 16 * 2**20
PREVIEW_EVENT = 1
PREVIEWS_PER_RUN = 6


class Workflow:
    """An API-format ComfyUI workflow with placeholders for the task's params."""

    def __init__(self, graph: dict[str, Any], source: str = "workflow") -> None:
        if not isinstance(graph, dict) or not all(
            isinstance(node, dict) and "class_type" in node for node in graph.values()
        ):
            raise InvalidRequest(
                f"{source} is not an API-format ComfyUI workflow "
                '({"<node id>": {"class_type": ..., "inputs": {...}}}); save it with "Save (API)"'
            )
        found = PLACEHOLDER.findall(json.dumps(graph))
        if "prompt" not in found:
            raise InvalidRequest(f"{source} has no {{{{prompt}}}} placeholder")
        self.graph = graph
        #: Whether a task's ``model`` fills ``{{model}}``; else the workflow's checkpoint.
        self.takes_model = "model" in found
        self.checkpoint = next(
            (
                str(node["inputs"]["ckpt_name"])
                for node in graph.values()
                if isinstance(node.get("inputs"), dict)
                and isinstance(node["inputs"].get("ckpt_name"), str)
                and not PLACEHOLDER.search(node["inputs"]["ckpt_name"])
            ),
            None,
        )

    def model_of(self, params: JSON) -> str | None:
        """The checkpoint a task needs; InvalidRequest when its ``model`` does not fit
        the workflow (one is needed for ``{{model}}``, none may be named without it)."""
        model = params.get("model")
        if self.takes_model and model is None:
            raise InvalidRequest(
                "the ComfyUI workflow loads the checkpoint {{model}}: name it in params.model"
            )
        if not self.takes_model and model is not None:
            raise InvalidRequest(
                "the ComfyUI workflow has no {{model}} placeholder: params.model cannot be set"
            )
        return str(model) if model is not None else self.checkpoint

    @classmethod
    def load(cls, path: Path) -> Workflow:
        try:
            graph = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise InvalidRequest(f"KILN_COMFYUI_WORKFLOW: cannot read {path}: {exc}") from None
        except ValueError as exc:
            raise InvalidRequest(f"KILN_COMFYUI_WORKFLOW: {path} is not JSON: {exc}") from None
        return cls(graph, f"KILN_COMFYUI_WORKFLOW ({path})")

    def fill(self, params: GenerateParams) -> dict[str, Any]:
        """A copy of the graph with every placeholder replaced by the task's value."""
        values: dict[str, str | int] = {
            "prompt": params.prompt,
            "negative_prompt": params.negative_prompt or "",
            "seed": params.effective_seed(),
            "steps": params.steps,
            "width": params.width,
            "height": params.height,
            "model": params.model or "",
        }

        def fill(value: Any) -> Any:
            if isinstance(value, dict):
                return {key: fill(item) for key, item in value.items()}
            if isinstance(value, list):
                return [fill(item) for item in value]
            if isinstance(value, str):
                whole = PLACEHOLDER.fullmatch(value)
                if whole:
                    return values[whole[1]]
                return PLACEHOLDER.sub(lambda found: str(values[found[1]]), value)
            return value

        filled: dict[str, Any] = fill(copy.deepcopy(self.graph))
        return filled


@dataclass
class _Run:
    """Where one generation stands, for the clean-up of an abandoned prompt."""

    client_id: str
    prompt_id: str | None = None
    executing: bool = False
    finished: bool = False
    previews: int = 0
    preview: bytes | None = None


class ComfyUIBackend:
    name = NAME
    #: One ComfyUI server runs one prompt at a time: a worker's `gpu` slots stand for it.
    resources: Mapping[str, int] = {"gpu": 1}

    def __init__(
        self, *, url: str, workflow: Workflow, timeout_s: float, upstream: Upstream
    ) -> None:
        self.url = url.rstrip("/")
        self.workflow = workflow
        self.timeout_s = timeout_s
        self.upstream = upstream
        #: The checkpoint this worker's last generation ran (ComfyUI keeps it loaded).
        self.last_model: str | None = None

    def model_of(self, params: JSON) -> str | None:
        return self.workflow.model_of(params)

    def loaded_models(self) -> list[str]:
        return [] if self.last_model is None else [self.last_model]

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        metrics: UpstreamMetrics,
        *,
        breaker: CircuitBreaker | None = None,
    ) -> ComfyUIBackend:
        if settings.comfyui_workflow is None:
            raise InvalidRequest(
                "KILN_BACKEND=comfyui needs KILN_COMFYUI_WORKFLOW: the path of an API-format "
                "workflow with a {{prompt}} placeholder"
            )
        try:
            from websockets.exceptions import WebSocketException
        except ImportError:  # an optional dependency of this backend only
            raise InvalidRequest(
                "KILN_BACKEND=comfyui needs the websockets package (pip install websockets)"
            ) from None

        upstream = Upstream(NAME, metrics, breaker, transport_errors=(WebSocketException,))
        return cls(
            url=settings.comfyui_url,
            workflow=Workflow.load(settings.comfyui_workflow),
            timeout_s=settings.comfyui_timeout_s,
            upstream=upstream,
        )

    def socket_url(self, client_id: str) -> str:
        base = httpx.URL(self.url)
        scheme = "wss" if base.scheme == "https" else "ws"
        path = base.path.rstrip("/") + "/ws"
        return str(base.copy_with(scheme=scheme, path=path, params={"clientId": client_id}))

    async def generate(self, ctx: Context, params: GenerateParams) -> bytes:
        from websockets.asyncio.client import connect

        graph = self.workflow.fill(params)
        run = _Run(client_id=uuid.uuid4().hex)
        async with self.upstream.call(timeout_s=self.timeout_s) as http:
            try:
                url = self.socket_url(run.client_id)
                traced = tracing.outgoing_headers()  # the attempt's trace context, if any
                async with connect(
                    url, max_size=MAX_MESSAGE_BYTES, additional_headers=traced
                ) as socket:
                    run.prompt_id = await self._queue(http, graph, run.client_id)
                    await ctx.progress(None, None, stage="queued")
                    await self._follow(socket, ctx, run)
                self.last_model = self.workflow.model_of(params.model_dump(exclude_none=True))
                await ctx.progress(None, None, stage="download")
                return await self._download(http, run.prompt_id)
            finally:
                if run.prompt_id is not None and not run.finished:
                    await self._abandon(http, run)

    async def _queue(self, http: httpx.AsyncClient, graph: dict[str, Any], client_id: str) -> str:
        response = await http.post(
            f"{self.url}/prompt", json={"prompt": graph, "client_id": client_id}
        )
        check_response(NAME, response)
        try:
            prompt_id = response.json()["prompt_id"]
        except (ValueError, KeyError, TypeError) as exc:
            message = f"{NAME} queued without a prompt_id: {exc!r}"
            raise Retryable(message, code=BAD_RESPONSE) from exc
        return str(prompt_id)

    async def _follow(self, socket: ClientConnection, ctx: Context, run: _Run) -> None:
        """Read the socket until our prompt is done, reporting its progress."""
        async for message in socket:
            if isinstance(message, bytes):
                run.preview = _preview_image(message) or run.preview
                continue
            try:
                event = json.loads(message)
                kind, data = event["type"], event.get("data") or {}
            except (ValueError, KeyError, TypeError):
                continue  # not one of ComfyUI's messages: nothing to act on
            if data.get("prompt_id") not in (None, run.prompt_id):
                continue  # another prompt's news
            if kind == "executing" and data.get("prompt_id") == run.prompt_id:
                if data.get("node") is None:
                    run.finished = True
                    return
                run.executing = True
            elif kind == "progress":
                await self._progress(ctx, run, data)
            elif kind in ("execution_error", "execution_interrupted"):
                run.finished = True
                raise _execution_failed(kind, data)
        message = f"{NAME} closed the progress socket before the prompt ended"
        raise Retryable(message, code=UNAVAILABLE)

    async def _progress(self, ctx: Context, run: _Run, data: dict[str, Any]) -> None:
        try:
            step, total = int(data["value"]), int(data["max"])
        except (KeyError, TypeError, ValueError):
            return
        shown = None
        if run.preview is not None and run.previews < PREVIEWS_PER_RUN and step < total:
            shown = await asyncio.to_thread(_thumbnail, run.preview)
            run.preview = None
            run.previews += 1
        await ctx.progress(step, total, stage="generate", preview=shown)

    async def _download(self, http: httpx.AsyncClient, prompt_id: str) -> bytes:
        response = await http.get(f"{self.url}/history/{prompt_id}")
        check_response(NAME, response)
        try:
            outputs = response.json()[prompt_id]["outputs"]
        except (ValueError, KeyError, TypeError) as exc:
            raise Retryable(f"{NAME} has no history of {prompt_id}", code=BAD_RESPONSE) from exc
        image = _first_image(outputs)
        if image is None:
            raise Permanent(
                f"the {NAME} workflow produced no image (does it end in a SaveImage node?)",
                code=REJECTED,
            )
        view = await http.get(f"{self.url}/view", params=image)
        check_response(NAME, view)
        return require_image(NAME, view.content)

    async def _abandon(self, http: httpx.AsyncClient, run: _Run) -> None:
        """Best effort: take the prompt off ComfyUI's queue, or stop it when it runs."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(ABANDON_TIMEOUT_S):
                await http.post(f"{self.url}/queue", json={"delete": [run.prompt_id]})
                if run.executing:  # recent ComfyUI stops only this prompt; older, the current
                    await http.post(f"{self.url}/interrupt", json={"prompt_id": run.prompt_id})


def _execution_failed(kind: str, data: dict[str, Any]) -> Retryable | Permanent:
    node = f"node {data.get('node_id')} ({data.get('node_type')})"
    if kind == "execution_interrupted":
        return Retryable(f"{NAME}: the prompt was interrupted at {node}", code=UNAVAILABLE)
    error = f"{data.get('exception_type')}: {data.get('exception_message')}".strip()
    message = f"{NAME}: {node} failed: {error}"[:500]
    if "OutOfMemory" in str(data.get("exception_type")):
        return Retryable(message, code=UNAVAILABLE)
    return Permanent(message, code=REJECTED)


def _first_image(outputs: Any) -> dict[str, str] | None:
    """``filename``, ``subfolder`` and ``type`` of the first saved image, else of any."""
    images = [
        image
        for node in (outputs.values() if isinstance(outputs, dict) else [])
        if isinstance(node, dict)
        for image in node.get("images") or []
        if isinstance(image, dict) and image.get("filename")
    ]
    images.sort(key=lambda image: image.get("type") != "output")  # stable: saved ones first
    if not images:
        return None
    first = images[0]
    return {key: str(first.get(key) or "") for key in ("filename", "subfolder", "type")}


def _preview_image(message: bytes) -> bytes | None:
    """The image of a binary preview message, or None for another binary event."""
    if len(message) < 8 or struct.unpack(">I", message[:4])[0] != PREVIEW_EVENT:
        return None
    return message[8:]


def _thumbnail(data: bytes, max_side: int = 96) -> str | None:
    """A preview image as a small JPEG ``data:`` URL, like the demo's previews."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.thumbnail((max_side, max_side), Image.Resampling.BILINEAR)
            buffer = io.BytesIO()
            image.convert("RGB").save(buffer, format="JPEG", quality=70)
    except (OSError, ValueError):
        return None
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
