"""The `comfy.workflow` kind: a whole ComfyUI API-format workflow run on one ComfyUI
instance (``KILN_COMFYUI_URL``), its saved images stored as the task's outputs.

A worker started with ``kiln worker --kinds comfy.workflow`` drives one instance, one
job at a time (the kind takes one ``gpu`` slot; ``--gpus`` says how many jobs the
instance may hold at once). Many workers serve many instances; the queue, retries,
leases and warm routing are kiln's (docs/comfy.md, "Workers and ComfyUI instances").

One job, as ComfyUI's own ``websockets_api_example.py`` runs a prompt:

1. Each input the params name in ``assets`` (a string standing in a node input for an
   uploaded file) is read from kiln's storage, sent to ``POST /upload/image`` (type
   ``input``, overwrite) under a name made of its sha256, and the string is replaced by
   the name ComfyUI gives it (``subfolder/name`` when it answers a subfolder).
2. ``GET /ws?clientId=<new id>`` is opened, then ``POST /prompt`` ``{"prompt",
   "client_id", "extra_data"}``.
3. The socket's messages: ``executing`` sets the stage ``node:<node id>:<class type>``,
   ``progress`` reports step ``value`` of ``max`` in that stage, binary previews become
   the progress previews, ``execution_error`` and ``execution_interrupted`` end it, and
   ``executing`` with ``node: null`` means done.
4. ``GET /history/<prompt id>``: every image of type ``output`` (SaveImage nodes) is read
   with ``GET /view`` and becomes the output ``<node id>-<file name>``.

Errors: an instance that cannot be reached or a socket that drops is retryable
(``comfyui_unavailable``: the job runs again, on another instance while this one's
breaker is open), and so is a prompt that is neither in ``/history`` nor in ``/queue``
(``comfyui_prompt_lost``: its queue was cleared); a node's ``execution_error`` is permanent
(``node_execution_error``, with the node in the error's details), except out of GPU
memory (``comfyui_out_of_memory``, retryable); a prompt ComfyUI refuses (400) is
permanent (``invalid_prompt``, ComfyUI's ``error`` and ``node_errors`` in the details).
When a job ends otherwise (cancelled, timed out after ``KILN_COMFYUI_TIMEOUT_S``, its
lease lost, its worker stopping) its prompt is deleted from the queue and, when it runs,
interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mimetypes
import re
import time
import uuid
from dataclasses import dataclass, field
from socket import gethostname
from typing import TYPE_CHECKING, Any

import httpx

from kiln import inputs, tracing
from kiln.backends.comfy_workflow_params import KIND, ComfyWorkflowParams, models_of
from kiln.backends.comfyui import _preview_image, _thumbnail
from kiln.circuit import CircuitBreaker
from kiln.errors import Permanent, Retryable
from kiln.kinds import ANY_INPUTS, Registry
from kiln.models import JSON, Output

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

    from kiln.worker import Context

__all__ = ["KIND", "ComfyWorkflow", "ComfyWorkflowParams", "model_of", "register"]

UNAVAILABLE = "comfyui_unavailable"
OUT_OF_MEMORY = "comfyui_out_of_memory"
TIMED_OUT = "comfyui_timeout"
INTERRUPTED = "comfyui_interrupted"
PROMPT_LOST = "comfyui_prompt_lost"
NODE_FAILED = "node_execution_error"
INVALID_PROMPT = "invalid_prompt"
#: Inputs that name the model a graph runs on, before the others (LoRAs, VAEs, ...).
MAIN_MODEL_INPUTS = ("ckpt_name", "unet_name")
#: Cleaning up an abandoned prompt (delete from the queue, interrupt) takes at most this.
ABANDON_TIMEOUT_S = 2.0
#: While the socket is quiet, the prompt is looked for in the queue and history this often.
CHECK_EVERY_S = 2.0
#: One HTTP call (upload, queue, history, view) may take this long.
CALL_TIMEOUT_S = 30.0
MAX_MESSAGE_BYTES = 16 * 2**20
#: Previews shown per job, at most one every PREVIEW_EVERY_S.
PREVIEWS_PER_RUN = 20
PREVIEW_EVERY_S = 0.5
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def model_of(params: JSON) -> str | None:
    """The model a job needs (warm routing, the GPU ledger): the first checkpoint or UNet
    its graph loads (node order), else the first model file of any kind it names."""
    workflow = params.get("workflow")
    nodes = workflow.values() if isinstance(workflow, dict) else []
    for node in nodes:
        found = node.get("inputs") if isinstance(node, dict) else None
        for name in MAIN_MODEL_INPUTS:
            value = found.get(name) if isinstance(found, dict) else None
            if isinstance(value, str) and value:
                return value
    return models_of(params)


@dataclass
class _Run:
    """Where one job stands on its instance."""

    client_id: str
    graph: dict[str, Any]
    prompt_id: str | None = None
    executing: bool = False
    finished: bool = False
    node: str | None = None
    previews: int = 0
    preview: bytes | None = None
    shown_at: float = 0.0
    cached: list[str] = field(default_factory=list)

    def stage(self) -> str:
        node = self.node or ""
        class_type = self.graph.get(node, {}).get("class_type", "") if node else ""
        return f"node:{node}:{class_type}"


class ComfyWorkflow:
    """The `comfy.workflow` handler on one ComfyUI instance."""

    def __init__(self, app: Registry, *, url: str, timeout_s: float, open_s: float = 30.0) -> None:
        self.app = app
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        #: The instance's circuit breaker, shared through the store with the workers of
        #: the same instance only: it opens when the instance is gone, so this worker
        #: claims no job while it is, and another instance's worker takes the retries.
        self.backend = _Instance(instance_name(self.url))
        self.breaker = CircuitBreaker(
            failure_threshold=1, window=1, min_calls=1, cooldown_s=open_s, clock=time.time
        )
        self.metrics = _Fed({self.backend.name: self.breaker})
        #: The checkpoint the instance last loaded for this worker (ComfyUI keeps it).
        self.last_model: str | None = None

    def model_of(self, params: JSON) -> str | None:
        return model_of(params)

    def loaded_models(self) -> list[str]:
        return [] if self.last_model is None else [self.last_model]

    def socket_url(self, client_id: str) -> str:
        base = httpx.URL(self.url)
        scheme = "wss" if base.scheme == "https" else "ws"
        path = base.path.rstrip("/") + "/ws"
        return str(base.copy_with(scheme=scheme, path=path, params={"clientId": client_id}))

    async def __call__(self, ctx: Context, params: ComfyWorkflowParams) -> list[Output]:
        run = _Run(client_id=uuid.uuid4().hex, graph=params.graph())
        permit = self.breaker.admit()
        gone: bool | None = None  # whether the instance is gone; None: no verdict
        try:
            outputs = await self._guarded(ctx, params, run)
            gone = False
            return outputs
        except Permanent:
            gone = False
            raise
        except Retryable as exc:
            gone = exc.code == UNAVAILABLE or None
            raise
        finally:
            if permit is not None:
                if gone is None:
                    self.breaker.release(permit)
                else:
                    self.breaker.record(permit, ok=not gone)

    async def _guarded(self, ctx: Context, params: ComfyWorkflowParams, run: _Run) -> list[Output]:
        from websockets.exceptions import WebSocketException

        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._run(ctx, params, run)
        except TimeoutError:
            message = f"the ComfyUI workflow ran past KILN_COMFYUI_TIMEOUT_S={self.timeout_s:g}"
            raise Retryable(message, code=TIMED_OUT) from None
        except (httpx.TransportError, OSError, WebSocketException) as exc:
            message = f"ComfyUI at {self.url} is unavailable: {exc!r}"[:500]
            raise Retryable(message, code=UNAVAILABLE) from exc

    async def _run(self, ctx: Context, params: ComfyWorkflowParams, run: _Run) -> list[Output]:
        from websockets.asyncio.client import connect

        timeout = httpx.Timeout(CALL_TIMEOUT_S)
        async with httpx.AsyncClient(timeout=timeout, headers=tracing.outgoing_headers()) as http:
            try:
                await self._upload_assets(http, ctx, params, run.graph)
                async with connect(
                    self.socket_url(run.client_id),
                    max_size=MAX_MESSAGE_BYTES,
                    additional_headers=tracing.outgoing_headers(),
                ) as socket:
                    run.prompt_id = await self._queue(http, run, params.extra_data)
                    await ctx.progress(None, None, stage="queued")
                    await self._follow(socket, http, ctx, run)
                self.last_model = model_of({"workflow": run.graph})
                await ctx.progress(None, None, stage="download")
                return await self._outputs(http, run.prompt_id)
            finally:
                if run.prompt_id is not None and not run.finished:
                    await self._abandon(http, run)

    async def _upload_assets(
        self, http: httpx.AsyncClient, ctx: Context, params: ComfyWorkflowParams, graph: JSON
    ) -> None:
        """Send each asset the graph uses to the instance; put its name in the graph."""
        names: dict[str, str] = {}
        for node in graph.values():
            values = node.get("inputs") or {}
            for key, value in values.items():
                if not isinstance(value, str) or value not in params.assets:
                    continue
                if value not in names:
                    item = inputs.named(ctx.task.inputs, params.assets[value])
                    names[value] = await self._upload(http, item)
                values[key] = names[value]

    async def _upload(self, http: httpx.AsyncClient, item: JSON) -> str:
        data = await inputs.load(self.app.storage, item)
        kind = str(item.get("content_type") or "application/octet-stream")
        suffix = mimetypes.guess_extension(kind) or ""
        name = f"kiln-{item['sha256']}{suffix}"  # by content: the same bytes, the same file
        response = await http.post(
            f"{self.url}/upload/image",
            files={"image": (name, data, kind)},
            data={"type": "input", "overwrite": "true"},
        )
        answer = _answer(response, "upload/image")
        if not isinstance(answer, dict) or not answer.get("name"):
            raise Retryable(f"ComfyUI answered the upload with {answer!r}", code=UNAVAILABLE)
        subfolder = str(answer.get("subfolder") or "")
        return f"{subfolder}/{answer['name']}" if subfolder else str(answer["name"])

    async def _queue(self, http: httpx.AsyncClient, run: _Run, extra: JSON) -> str:
        # The prompt's id is ours, sent with it (ComfyUI takes a ``prompt_id``): a job
        # stopped while ComfyUI answers still knows which prompt to take back.
        run.prompt_id = str(uuid.uuid4())
        body = {"prompt": run.graph, "client_id": run.client_id, "extra_data": extra}
        body["prompt_id"] = run.prompt_id
        response = await http.post(f"{self.url}/prompt", json=body)
        if response.status_code == 400:
            raise _refused(response)
        answer = _answer(response, "prompt")
        if not isinstance(answer, dict) or not answer.get("prompt_id"):
            raise Retryable(f"ComfyUI queued without a prompt_id: {answer!r}", code=UNAVAILABLE)
        return str(answer["prompt_id"])

    async def _follow(
        self, socket: ClientConnection, http: httpx.AsyncClient, ctx: Context, run: _Run
    ) -> None:
        """Read the socket until the prompt ends, reporting its progress; while it is
        quiet, make sure the instance still has the prompt."""
        while True:
            try:  # not asyncio.wait_for: on 3.11 it may swallow a cancel (the job's stop)
                async with asyncio.timeout(CHECK_EVERY_S):
                    message = await socket.recv()
            except TimeoutError:
                if await self._finished_unseen(http, run):
                    return
                continue
            except Exception as exc:  # the socket closed: did the prompt end meanwhile?
                if await self._finished_unseen(http, run):
                    return
                raise Retryable(
                    f"ComfyUI at {self.url} closed the progress socket: {exc!r}", code=UNAVAILABLE
                ) from exc
            if isinstance(message, bytes):
                run.preview = _preview_image(message) or run.preview
            elif await self._event(ctx, run, message):
                return

    async def _event(self, ctx: Context, run: _Run, message: str) -> bool:
        """Act on one text message; True once the prompt ended well."""
        try:
            event = json.loads(message)
            kind, data = str(event["type"]), event.get("data") or {}
        except (ValueError, KeyError, TypeError):
            return False  # not one of ComfyUI's messages
        if not isinstance(data, dict) or data.get("prompt_id") != run.prompt_id:
            return False  # another prompt's news, or the queue's status
        if kind == "executing":
            if data.get("node") is None:
                run.finished = True
                return True
            run.executing, run.node = True, str(data["node"])
            await ctx.progress(None, None, stage=run.stage())
        elif kind == "execution_cached":
            run.cached = [str(node) for node in data.get("nodes") or []]
        elif kind == "progress":
            await self._progress(ctx, run, data)
        elif kind in ("execution_error", "execution_interrupted"):
            run.finished = True
            raise _execution_failed(kind, data)
        return False

    async def _progress(self, ctx: Context, run: _Run, data: JSON) -> None:
        try:
            step, total = int(data["value"]), int(data["max"])
        except (KeyError, TypeError, ValueError):
            return
        if data.get("node") is not None:
            run.node = str(data["node"])
        shown = None
        now = time.monotonic()
        due = now - run.shown_at >= PREVIEW_EVERY_S or step >= total
        if run.preview is not None and run.previews < PREVIEWS_PER_RUN and due:
            shown = await asyncio.to_thread(_thumbnail, run.preview)
            run.preview, run.shown_at = None, now
            run.previews += 1
        await ctx.progress(step, total, stage=run.stage(), preview=shown)

    async def _finished_unseen(self, http: httpx.AsyncClient, run: _Run) -> bool:
        """True when the prompt ended well without our hearing it; Retryable when the
        instance no longer has it (restarted, its queue lost), or it failed."""
        history = await self._history(http, str(run.prompt_id))
        if history is not None:
            run.finished = True
            status = history.get("status") or {}
            if status.get("status_str", "success") == "success":
                return True
            for kind, data in reversed(status.get("messages") or []):
                if kind in ("execution_error", "execution_interrupted"):
                    raise _execution_failed(kind, data)
            raise Retryable(f"ComfyUI ended prompt {run.prompt_id} with {status}", code=UNAVAILABLE)
        queue = _answer(await http.get(f"{self.url}/queue"), "queue")
        rows = [*queue.get("queue_running", []), *queue.get("queue_pending", [])]
        if any(isinstance(row, list) and len(row) > 1 and row[1] == run.prompt_id for row in rows):
            return False
        run.finished = True  # nothing left there to clean up
        raise Retryable(
            f"ComfyUI at {self.url} has prompt {run.prompt_id} neither queued nor in its "
            "history (was its queue cleared?)",
            code=PROMPT_LOST,
        )

    async def _history(self, http: httpx.AsyncClient, prompt_id: str) -> JSON | None:
        answer = _answer(await http.get(f"{self.url}/history/{prompt_id}"), "history")
        found = answer.get(prompt_id) if isinstance(answer, dict) else None
        return found if isinstance(found, dict) else None

    async def _outputs(self, http: httpx.AsyncClient, prompt_id: str) -> list[Output]:
        """Every saved image (type ``output``) of the prompt, read from the instance."""
        history = await self._history(http, prompt_id)
        if history is None:
            raise Retryable(f"ComfyUI has no history of prompt {prompt_id}", code=UNAVAILABLE)
        outputs: list[Output] = []
        for node_id, shown in (history.get("outputs") or {}).items():
            for image in (shown or {}).get("images") or []:
                if not isinstance(image, dict) or image.get("type") != "output":
                    continue
                where = {k: str(image.get(k) or "") for k in ("filename", "subfolder", "type")}
                data = _answer(await http.get(f"{self.url}/view", params=where), "view", raw=True)
                kind = mimetypes.guess_type(where["filename"])[0] or "application/octet-stream"
                name = f"{_UNSAFE.sub('_', str(node_id))}-{_UNSAFE.sub('_', where['filename'])}"
                outputs.append(Output(name, data, kind))
        return outputs

    async def _abandon(self, http: httpx.AsyncClient, run: _Run) -> None:
        """Best effort: take the prompt off the instance's queue, and stop it if it runs
        (seen running on the socket, or started before its first message reached us)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(ABANDON_TIMEOUT_S):
                await http.post(f"{self.url}/queue", json={"delete": [run.prompt_id]})
                if run.executing or await self._running_now(http, run):
                    # recent ComfyUI stops only this prompt; older ones, the current one
                    await http.post(f"{self.url}/interrupt", json={"prompt_id": run.prompt_id})

    async def _running_now(self, http: httpx.AsyncClient, run: _Run) -> bool:
        """Whether the instance runs the prompt now (``GET /queue``'s ``queue_running``
        rows are ``[number, prompt_id, ...]``)."""
        answer = (await http.get(f"{self.url}/queue")).json()
        rows = answer.get("queue_running") or [] if isinstance(answer, dict) else []
        return any(isinstance(r, list) and len(r) > 1 and r[1] == run.prompt_id for r in rows)


@dataclass(frozen=True, slots=True)
class _Instance:
    """The ComfyUI instance a worker drives, as kiln's breakers name a generator."""

    name: str


@dataclass(frozen=True, slots=True)
class _Fed:
    """The breakers the handler feeds itself (``kiln.breakers.generator_of`` reads them)."""

    breakers: dict[str, CircuitBreaker]


def instance_name(url: str) -> str:
    """``comfyui@<host>:<port>``; a loopback address is this machine's, so the name holds
    the machine's name (each GPU machine may run its own ComfyUI on 127.0.0.1:8188)."""
    parsed = httpx.URL(url)
    host = parsed.host or "localhost"
    if host in ("localhost", "127.0.0.1", "::1"):
        host = gethostname()
    return f"comfyui@{host}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"


def _answer(response: httpx.Response, route: str, *, raw: bool = False) -> Any:
    """The JSON (or the bytes) of a 2xx answer; a retryable failure otherwise."""
    if not response.is_success:
        message = f"ComfyUI answered {route} with {response.status_code}: {response.text[:200]}"
        raise Retryable(message, code=UNAVAILABLE)
    if raw:
        return response.content
    try:
        return response.json()
    except ValueError as exc:
        raise Retryable(f"ComfyUI answered {route} with no JSON", code=UNAVAILABLE) from exc


def _refused(response: httpx.Response) -> Permanent:
    """ComfyUI's 400 to ``POST /prompt``: the graph cannot run on it."""
    try:
        body = response.json()
    except ValueError:
        body = {}
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {"message": response.text[:500]}
    node_errors = body.get("node_errors") if isinstance(body, dict) else None
    message = f"ComfyUI refused the workflow: {error.get('message')} {error.get('details') or ''}"
    details: JSON = {"error": error, "node_errors": node_errors or {}}
    refused = _first_refused(node_errors)
    if refused is not None:  # name the node, as a node's failure does
        node_id, node_type, why = refused
        details.update(node_id=node_id, node_type=node_type)
        message = f"{message.strip()}: node {node_id} ({node_type}): {why}"
    return Permanent(message.strip()[:500], code=INVALID_PROMPT, details=[details])


def _first_refused(node_errors: Any) -> tuple[str, str, str] | None:
    """(node id, class type, what is wrong) of the first node ComfyUI refused, or None."""
    if not isinstance(node_errors, dict) or not node_errors:
        return None
    node_id, entry = next(iter(node_errors.items()))
    entry = entry if isinstance(entry, dict) else {}
    errors = entry.get("errors")
    first = errors[0] if isinstance(errors, list) and errors and isinstance(errors[0], dict) else {}
    why = ": ".join(str(first[k]) for k in ("message", "details") if first.get(k))
    return str(node_id), str(entry.get("class_type") or ""), why or "refused"


def _execution_failed(kind: str, data: JSON) -> Retryable | Permanent:
    node = f"node {data.get('node_id')} ({data.get('node_type')})"
    if kind == "execution_interrupted":
        return Retryable(f"ComfyUI interrupted the prompt at {node}", code=INTERRUPTED)
    exception_type = str(data.get("exception_type") or "")
    message = f"ComfyUI: {node} failed: {exception_type}: {data.get('exception_message')}"
    if "OutOfMemory" in exception_type:
        return Retryable(message[:500], code=OUT_OF_MEMORY)
    keys = ("node_id", "node_type", "exception_type", "exception_message")
    details = [{key: data.get(key) for key in keys}]
    return Permanent(message[:500], code=NODE_FAILED, details=details)


def register(app: Registry, *, url: str | None = None) -> ComfyWorkflow:
    """Register `comfy.workflow` on ``app``, driving the ComfyUI at ``url`` (else
    KILN_COMFYUI_URL). Nothing is reached until a job runs."""
    settings = app.settings
    handler = ComfyWorkflow(
        app,
        url=url or settings.comfyui_url,
        timeout_s=settings.comfyui_timeout_s,
        open_s=settings.breaker_open_s,
    )
    app.task(
        KIND,
        params=ComfyWorkflowParams,
        resources={"gpu": 1},
        model=handler.model_of,
        inputs=(ANY_INPUTS,),
    )(handler)
    return handler
