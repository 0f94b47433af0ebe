"""Fake upstreams that speak the real protocols, served by uvicorn on 127.0.0.1.

Each fake answers its next call from a script of behaviours (``"ok"`` once the script is
used up), records what it was sent, and counts calls, so a test can tell that an open
circuit breaker never reached it. A behaviour that hangs waits on ``release`` (set when
the fake stops), never on a timer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect


def png(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    """A small deterministic PNG, as an upstream would paint it."""
    colour = (seed * 37 % 256, seed * 91 % 256, seed * 53 % 256)
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _wait(event: threading.Event) -> Any:
    return anyio.to_thread.run_sync(event.wait)


# OpenAI-compatible images ----------------------------------------------------------------


OPENAI_ERRORS: dict[str, tuple[int, dict[str, Any], dict[str, str]]] = {
    "429": (
        429,
        {"message": "Rate limit reached for images per minute. Please try again in 1s.",
         "type": "requests", "param": None, "code": "rate_limit_exceeded"},
        {"retry-after": "1"},
    ),
    "quota": (
        429,
        {"message": "You exceeded your current quota, please check your plan and billing "
         "details.", "type": "insufficient_quota", "param": None, "code": "insufficient_quota"},
        {},
    ),
    "500": (
        500,
        {"message": "The server had an error while processing your request. Sorry about that!",
         "type": "server_error", "param": None, "code": None},
        {},
    ),
    "400": (
        400,
        {"message": "Your request was rejected as a result of our safety system.",
         "type": "invalid_request_error", "param": None, "code": "content_policy_violation"},
        {},
    ),
}  # fmt: skip


@dataclass
class FakeOpenAI:
    """``POST /v1/images/generations`` as OpenAI documents it (b64_json or url answers)."""

    script: list[str] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    image: bytes = field(default_factory=lambda: png(64, 64, seed=7))
    release: threading.Event = field(default_factory=threading.Event)
    base_url: str = ""
    file_headers: list[dict[str, str]] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.requests)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/images/generations", self.generate, methods=["POST"]),
                Route("/files/image.png", self.file),
            ]
        )

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        behaviour = self.script.pop(0) if self.script else "ok"
        if behaviour in OPENAI_ERRORS:
            status, error, headers = OPENAI_ERRORS[behaviour]
            return JSONResponse({"error": error}, status, headers=headers)
        if str(body.get("model", "")).startswith("gpt-image") and "response_format" in body:
            error = {"message": "Unknown parameter: 'response_format'.",
                     "type": "invalid_request_error", "param": "response_format",
                     "code": "unknown_parameter"}  # fmt: skip
            return JSONResponse({"error": error}, 400)
        if behaviour == "hang":
            await _wait(self.release)
        image = self.image if behaviour != "garbage" else b"<html>not an image</html>"
        item: dict[str, Any] = {"b64_json": base64.b64encode(image).decode("ascii")}
        if behaviour == "url":
            item = {"url": f"{self.base_url}/files/image.png"}
        item["revised_prompt"] = body.get("prompt")
        return JSONResponse({"created": int(time.time()), "data": [item]})

    async def file(self, request: Request) -> Response:
        self.file_headers.append(dict(request.headers))
        return Response(self.image, media_type="image/png")


# ComfyUI -----------------------------------------------------------------------------------

#: An API-format text-to-image workflow ("Save (API)") with kiln's placeholders.
WORKFLOW: dict[str, Any] = {
    "3": {"class_type": "KSampler", "inputs": {
        "cfg": 8, "denoise": 1, "latent_image": ["5", 0], "model": ["4", 0],
        "negative": ["7", 0], "positive": ["6", 0], "sampler_name": "euler",
        "scheduler": "normal", "seed": "{{seed}}", "steps": "{{steps}}"}},
    "4": {"class_type": "CheckpointLoaderSimple",
          "inputs": {"ckpt_name": "v1-5-pruned-emaonly.safetensors"}},
    "5": {"class_type": "EmptyLatentImage",
          "inputs": {"batch_size": 1, "height": "{{height}}", "width": "{{width}}"}},
    "6": {"class_type": "CLIPTextEncode",
          "inputs": {"clip": ["4", 1], "text": "{{prompt}}, highly detailed"}},
    "7": {"class_type": "CLIPTextEncode",
          "inputs": {"clip": ["4", 1], "text": "{{negative_prompt}}"}},
    "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
    "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "kiln", "images": ["8", 0]}},
}  # fmt: skip


def _node(workflow: dict[str, Any], class_type: str) -> tuple[str, dict[str, Any]]:
    for node_id, node in workflow.items():
        if node["class_type"] == class_type:
            return node_id, node["inputs"]
    raise KeyError(class_type)


@dataclass
class FakeComfyUI:
    """ComfyUI's prompt queue: ``/ws``, ``POST /prompt``, ``/history``, ``/view``,
    ``POST /queue`` and ``POST /interrupt``, with the message shapes ComfyUI sends.

    Behaviours: ``ok``, ``preview`` (binary previews before each step), ``error`` (a node
    raises), ``oom``, ``hang`` (runs until released), ``drop`` (closes the socket),
    ``no_image``, ``500`` and ``400`` (answers to ``POST /prompt``).
    """

    script: list[str] = field(default_factory=list)
    prompts: list[dict[str, Any]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)
    images: dict[str, bytes] = field(default_factory=dict)
    history: dict[str, dict[str, Any]] = field(default_factory=dict)
    release: threading.Event = field(default_factory=threading.Event)
    sockets: dict[str, WebSocket] = field(default_factory=dict)
    clients: list[str] = field(default_factory=list)
    running: set[asyncio.Task[None]] = field(default_factory=set)
    #: The headers of each ``POST /prompt`` and of each socket's opening request.
    prompt_headers: list[dict[str, str]] = field(default_factory=list)
    socket_headers: list[dict[str, str]] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.prompts)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                WebSocketRoute("/ws", self.socket),
                Route("/prompt", self.queue_prompt, methods=["POST"]),
                Route("/history/{prompt_id}", self.prompt_history),
                Route("/view", self.view),
                Route("/queue", self.edit_queue, methods=["POST"]),
                Route("/interrupt", self.interrupt, methods=["POST"]),
            ]
        )

    async def socket(self, websocket: WebSocket) -> None:
        self.socket_headers.append(dict(websocket.headers))
        await websocket.accept()
        sid = websocket.query_params.get("clientId") or uuid.uuid4().hex
        self.sockets[sid] = websocket
        self.clients.append(sid)
        status = {"status": {"exec_info": {"queue_remaining": 0}}, "sid": sid}
        await websocket.send_json({"type": "status", "data": status})
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                await websocket.receive_text()
        self.sockets.pop(sid, None)

    async def queue_prompt(self, request: Request) -> Response:
        self.prompt_headers.append(dict(request.headers))
        body = await request.json()
        behaviour = self.script.pop(0) if self.script else "ok"
        self.prompts.append(body)
        if behaviour == "500":
            return Response("500 Internal Server Error\n\nServer got itself in trouble", 500)
        if behaviour == "400":
            error = {"type": "prompt_outputs_failed_validation",
                     "message": "Prompt outputs failed validation", "details": "",
                     "extra_info": {}}  # fmt: skip
            node_errors = {"4": {"errors": [{"type": "value_not_in_list",
                           "message": "Value not in list",
                           "details": "ckpt_name: 'v1-5-pruned-emaonly.safetensors' not in []",
                           "extra_info": {}}], "dependent_outputs": ["9"],
                           "class_type": "CheckpointLoaderSimple"}}  # fmt: skip
            return JSONResponse({"error": error, "node_errors": node_errors}, 400)
        prompt_id = str(uuid.uuid4())
        job = asyncio.create_task(self._execute(prompt_id, body, behaviour))
        self.running.add(job)
        job.add_done_callback(self.running.discard)
        return JSONResponse(
            {"prompt_id": prompt_id, "number": len(self.prompts), "node_errors": {}}
        )

    async def _execute(self, prompt_id: str, body: dict[str, Any], behaviour: str) -> None:
        workflow, sid = body["prompt"], body.get("client_id")

        async def send(kind: str, data: dict[str, Any]) -> None:
            if sid in self.sockets:
                with contextlib.suppress(Exception):
                    await self.sockets[sid].send_json({"type": kind, "data": data})

        await send("execution_start", {"prompt_id": prompt_id, "timestamp": 1})
        await send("execution_cached", {"nodes": [], "prompt_id": prompt_id, "timestamp": 1})
        if behaviour == "drop" and sid in self.sockets:
            await self.sockets[sid].close()
            return
        sampler_id, sampler = _node(workflow, "KSampler")
        await send("executing", {"node": sampler_id, "display_node": sampler_id,
                                 "prompt_id": prompt_id})  # fmt: skip
        if behaviour == "hang":
            await _wait(self.release)
            return
        for step in range(1, int(sampler["steps"]) + 1):
            if behaviour == "preview" and sid in self.sockets:
                frame = b"\x00\x00\x00\x01\x00\x00\x00\x02" + png(32, 32, seed=step)
                await self.sockets[sid].send_bytes(frame)
            await send("progress", {"value": step, "max": int(sampler["steps"]),
                                    "prompt_id": prompt_id, "node": sampler_id})  # fmt: skip
            if behaviour in ("error", "oom"):
                await send("execution_error", self._error(prompt_id, sampler_id, behaviour))
                return
        outputs = {} if behaviour == "no_image" else self._save(workflow, prompt_id)
        self.history[prompt_id] = {
            "prompt": [len(self.prompts), prompt_id, workflow, {"client_id": sid}, ["9"]],
            "outputs": outputs,
            "status": {"status_str": "success", "completed": True, "messages": []},
        }
        await send("execution_success", {"prompt_id": prompt_id, "timestamp": 2})
        await send("executing", {"node": None, "prompt_id": prompt_id})

    def _save(self, workflow: dict[str, Any], prompt_id: str) -> dict[str, Any]:
        _, latent = _node(workflow, "EmptyLatentImage")
        _, sampler = _node(workflow, "KSampler")
        save_id, _ = _node(workflow, "SaveImage")
        filename = f"kiln_{len(self.images) + 1:05d}_.png"
        self.images[filename] = png(int(latent["width"]), int(latent["height"]),
                                    seed=int(sampler["seed"]))  # fmt: skip
        preview = {"filename": "ComfyUI_temp_0001.png", "subfolder": "", "type": "temp"}
        saved = {"filename": filename, "subfolder": "", "type": "output"}
        return {"8": {"images": [preview]}, save_id: {"images": [saved]}}

    @staticmethod
    def _error(prompt_id: str, node_id: str, behaviour: str) -> dict[str, Any]:
        kind = "torch.OutOfMemoryError" if behaviour == "oom" else "RuntimeError"
        message = (
            "Allocation on device"
            if behaviour == "oom"
            else "mat1 and mat2 shapes cannot be multiplied (154x2048 and 768x320)"
        )
        return {"prompt_id": prompt_id, "node_id": node_id, "node_type": "KSampler",
                "executed": ["4", "5"], "exception_message": message, "exception_type": kind,
                "traceback": ["..."], "current_inputs": {}, "current_outputs": {}}  # fmt: skip

    async def prompt_history(self, request: Request) -> Response:
        prompt_id = request.path_params["prompt_id"]
        found = self.history.get(prompt_id)
        return JSONResponse({prompt_id: found} if found else {})

    async def view(self, request: Request) -> Response:
        query = request.query_params
        data = self.images.get(query.get("filename", ""))
        if data is None or query.get("type") != "output" or query.get("subfolder") != "":
            return Response(status_code=404)
        return Response(data, media_type="image/png")

    async def edit_queue(self, request: Request) -> Response:
        self.deleted.extend((await request.json()).get("delete", []))
        return Response(status_code=200)

    async def interrupt(self, request: Request) -> Response:
        body = json.loads(await request.body() or b"{}")
        self.interrupted.append(str(body.get("prompt_id")))
        return Response(status_code=200)


# Serving ---------------------------------------------------------------------------------


@contextlib.contextmanager
def serve(app: Starlette, release: threading.Event) -> Iterator[str]:
    """``app`` on a real uvicorn server on a free 127.0.0.1 port, in a thread of its own."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:  # the thread's loop reports when it listens
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake upstream did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
