"""A stand-in ComfyUI server: ComfyUI's HTTP and WebSocket API (``server.py``,
``execution.py``, ``main.py``'s prompt worker) over a small set of real nodes that paint
real pictures (:mod:`tests.services.comfyui_nodes`), for tests that drive a ComfyUI
instance without a GPU.

Run it as its own process::

    python -m tests.services.comfyui_standin --port 0 --root DIR [--step-s 0.05]
        [--load-s 0.5] [--checkpoints a.safetensors,b.safetensors] [--faults JSON]

It prints ``comfyui stand-in listening on http://127.0.0.1:<port>`` once it serves.
``DIR`` holds ``input/``, ``output/`` and ``temp/`` as ComfyUI's folders do.

Routes as ComfyUI's: ``POST /prompt`` (validated; 400 with ``error`` and
``node_errors``), ``GET /prompt``, ``GET /queue``, ``POST /queue`` (``delete``,
``clear``), ``POST /interrupt``, ``GET|POST /history``, ``GET /history/{id}``,
``GET /view``, ``POST /upload/image``, ``GET /object_info``, ``GET /system_stats`` and
``/ws?clientId=`` with ComfyUI's messages, in its order: ``execution_start``,
``execution_cached``, then per node ``executing``, ``progress`` (KSampler steps, each
after a binary preview: 4-byte big-endian event type 1, image type 1 JPEG, the bytes) and
``executed`` for output nodes, then ``execution_success`` (or ``execution_error``,
``execution_interrupted``), and ``executing`` with ``node: null`` after the history is
written; ``status`` to everyone when the queue changes.

What ComfyUI does not have, for tests: ``GET /standin/log`` (the interrupts and queue
deletions it was sent, the prompts it ran, the checkpoint loaded and how often one was
loaded) and ``POST /standin/faults`` (replaces the faults): ``{"raise": {"class_type",
"exception_type", "exception_message", "times"?}}`` makes that node raise (a
``torch.OutOfMemoryError`` type is an OOM as ComfyUI reports it), ``{"exit_at_step": n}``
ends the process (exit status 3) at step n of a KSampler, ``{"prompt_answer_s": s}``
answers ``POST /prompt`` s seconds after queueing the prompt (a busy server's answer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import socket
import struct
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from tests.services import comfyui_nodes as nodes

DEFAULT_CHECKPOINTS = ["v1-5-pruned-emaonly.safetensors", "sd_xl_base_1.0.safetensors"]
DEFAULT_LORAS = ["detail.safetensors", "style.safetensors"]
PREVIEW_IMAGE = 1
JPEG = 1
#: How long a started process may take to print its address.
READY_TIMEOUT_S = 30.0


class Interrupted(Exception):
    """``comfy.model_management.InterruptProcessingException``."""


class NodeFailed(Exception):
    def __init__(self, exception_type: str, message: str) -> None:
        super().__init__(message)
        self.exception_type = exception_type


@dataclass
class Item:
    number: int
    prompt_id: str
    prompt: dict[str, Any]
    extra_data: dict[str, Any]
    outputs: list[str]

    def row(self) -> list[Any]:
        return [self.number, self.prompt_id, self.prompt, self.extra_data, self.outputs]


@dataclass
class StandIn:
    root: Path
    step_s: float = 0.05
    load_s: float = 0.5
    checkpoints: list[str] = field(default_factory=lambda: list(DEFAULT_CHECKPOINTS))
    loras: list[str] = field(default_factory=lambda: list(DEFAULT_LORAS))
    faults: dict[str, Any] = field(default_factory=dict)
    pending: list[Item] = field(default_factory=list)
    running: Item | None = None
    history: dict[str, dict[str, Any]] = field(default_factory=dict)
    sockets: dict[str, WebSocket] = field(default_factory=dict)
    log: dict[str, Any] = field(
        default_factory=lambda: {
            "interrupts": [],
            "deleted": [],
            "prompts": [],
            "loads": 0,
            "loaded": None,
        }
    )
    number: int = 0
    interrupt: bool = False
    cache: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        for folder in ("input", "output", "temp"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        self.choices = nodes.Choices(self.checkpoints, self.loras, self.root / "input")

    # messages ---------------------------------------------------------------------------

    async def send(self, kind: str, data: dict[str, Any], sid: str | None) -> None:
        """To the prompt's client (``sid``), or to every socket (``None``)."""
        targets = list(self.sockets.values()) if sid is None else [self.sockets.get(sid)]
        for ws in targets:
            if ws is not None:
                with contextlib.suppress(Exception):
                    await ws.send_text(json.dumps({"type": kind, "data": data}))

    async def send_preview(self, image: Image.Image, sid: str | None) -> None:
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="JPEG", quality=60)
        ws = self.sockets.get(sid or "")
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.send_bytes(struct.pack(">II", PREVIEW_IMAGE, JPEG) + buffer.getvalue())

    def queue_status(self) -> dict[str, Any]:
        remaining = len(self.pending) + (self.running is not None)
        return {"status": {"exec_info": {"queue_remaining": remaining}}}

    async def status_changed(self) -> None:
        await self.send("status", self.queue_status(), None)

    # the prompt worker ------------------------------------------------------------------

    async def work(self) -> None:
        while True:
            while not self.pending:
                self.wake.clear()
                await self.wake.wait()
            self.running = self.pending.pop(0)
            self.interrupt = False
            item = self.running
            sid = item.extra_data.get("client_id")
            messages: list[list[Any]] = []
            outputs: dict[str, Any] = {}
            ok = await Execution(self, item, sid, messages, outputs).run()
            self.history[item.prompt_id] = {
                "prompt": item.row(),
                "outputs": outputs,
                "status": {
                    "status_str": "success" if ok else "error",
                    "completed": ok,
                    "messages": messages,
                },
                "meta": {
                    n: {"node_id": n, "display_node": n, "parent_node": None, "real_node_id": n}
                    for n in outputs
                },
            }
            self.log["prompts"].append(item.prompt_id)
            self.running = None
            await self.send("executing", {"node": None, "prompt_id": item.prompt_id}, sid)
            await self.status_changed()


class Execution:
    """One prompt run node by node, as ComfyUI's ``PromptExecutor.execute`` does."""

    def __init__(
        self,
        server: StandIn,
        item: Item,
        sid: str | None,
        messages: list[list[Any]],
        outputs: dict[str, Any],
    ) -> None:
        self.server, self.item, self.sid = server, item, sid
        self.messages, self.outputs = messages, outputs
        self.values: dict[str, tuple[Any, ...]] = {}
        self.executed: list[str] = []

    async def message(self, kind: str, data: dict[str, Any], *, keep: bool = True) -> None:
        data = {**data, "prompt_id": self.item.prompt_id}
        if keep:
            self.messages.append([kind, {**data, "timestamp": int(time.time() * 1000)}])
        await self.server.send(kind, data, self.sid)

    async def run(self) -> bool:
        prompt, server = self.item.prompt, self.server
        await self.message("execution_start", {"timestamp": int(time.time() * 1000)})
        steps = nodes.order(prompt, self.item.outputs)
        extra = {n: self._file_key(n) for n in steps if prompt[n]["class_type"] == "LoadImage"}
        sigs = {n: nodes.signature(prompt, n, extra) for n in steps}
        cached = [n for n in steps if sigs[n] in server.cache and not _is_output(prompt, n)]
        await self.message("execution_cached", {"nodes": cached})
        fresh: dict[str, tuple[Any, ...]] = {}
        for node_id in steps:
            if node_id in cached:
                self.values[node_id] = fresh[sigs[node_id]] = server.cache[sigs[node_id]]
                continue
            failed = await self._node(node_id)
            if failed:
                return False
            fresh[sigs[node_id]] = self.values[node_id]
        server.cache = fresh
        await self.message("execution_success", {})
        return True

    async def _node(self, node_id: str) -> bool:
        """Run one node; True when it failed (the error already reported)."""
        node = self.item.prompt[node_id]
        await self.message("executing", {"node": node_id, "display_node": node_id}, keep=False)
        try:
            if self.server.interrupt:
                raise Interrupted
            self._fault(node["class_type"])
            result, ui = await self._compute(node_id, node["class_type"], self._inputs(node))
        except Interrupted:
            await self.message(
                "execution_interrupted",
                {"node_id": node_id, "node_type": node["class_type"], "executed": self.executed},
            )
            return True
        except Exception as exc:  # a node's error, reported as ComfyUI reports it
            kind = exc.exception_type if isinstance(exc, NodeFailed) else type(exc).__name__
            await self.message(
                "execution_error",
                {
                    "node_id": node_id,
                    "node_type": node["class_type"],
                    "executed": self.executed,
                    "exception_message": str(exc),
                    "exception_type": kind,
                    "traceback": traceback.format_exception(exc),
                    "current_inputs": {},
                    "current_outputs": {},
                },
            )
            return True
        self.values[node_id] = result
        self.executed.append(node_id)
        if ui is not None:
            self.outputs[node_id] = ui
            await self.message(
                "executed", {"node": node_id, "display_node": node_id, "output": ui}, keep=False
            )
        return False

    def _file_key(self, node_id: str) -> str:
        path = self.server.root / "input" / str(self.item.prompt[node_id]["inputs"]["image"])
        return f"{path.stat().st_mtime_ns}:{path.stat().st_size}" if path.is_file() else ""

    def _fault(self, class_type: str) -> None:
        fault = self.server.faults.get("raise")
        if not fault or fault.get("class_type") != class_type:
            return
        times = fault.get("times")
        if times is not None:
            if times <= 0:
                return
            fault["times"] = times - 1
        raise NodeFailed(
            fault.get("exception_type", "RuntimeError"),
            fault.get("exception_message", "the node failed"),
        )

    def _inputs(self, node: dict[str, Any]) -> dict[str, Any]:
        values = {}
        for key, value in (node.get("inputs") or {}).items():
            if isinstance(value, list) and len(value) == 2:
                values[key] = self.values[str(value[0])][int(value[1])]
            else:
                values[key] = value
        return values

    async def _compute(
        self, node_id: str, class_type: str, i: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        server = self.server
        if class_type == "CheckpointLoaderSimple":
            if server.log["loaded"] != i["ckpt_name"]:
                await asyncio.sleep(server.load_s)
                server.log["loaded"] = i["ckpt_name"]
                server.log["loads"] += 1
            model = {"ckpt": i["ckpt_name"], "loras": []}
            return (model, dict(model), {"ckpt": i["ckpt_name"]}), None
        if class_type == "LoraLoader":
            lora = [i["lora_name"], i["strength_model"]]
            return (
                {**i["model"], "loras": [*i["model"]["loras"], lora]},
                {**i["clip"], "loras": [*i["clip"]["loras"], lora]},
            ), None
        if class_type == "CLIPTextEncode":
            return ({"text": i["text"], "clip": i["clip"]},), None
        if class_type == "EmptyLatentImage":
            return (
                {"width": i["width"], "height": i["height"], "batch_size": i["batch_size"]},
            ), None
        if class_type == "KSampler":
            return (await self._sample(node_id, i),), None
        if class_type == "VAEDecode":
            return (list(i["samples"]["images"]),), None
        if class_type == "ImageScale":
            return (
                nodes.scale(i["image"], i["upscale_method"], i["width"], i["height"], i["crop"]),
            ), None
        if class_type == "LoadImage":
            with Image.open(server.root / "input" / i["image"]) as image:
                picture = image.convert("RGB")
            return ([picture], Image.new("L", picture.size, 0)), None
        return (), self._save(class_type, i)

    async def _sample(self, node_id: str, i: dict[str, Any]) -> dict[str, Any]:
        latent, steps = i["latent_image"], int(i["steps"])
        keys = [
            nodes.sample_key(i["model"], i["positive"], int(i["seed"]), n)
            for n in range(latent["batch_size"])
        ]
        finals = [nodes.picture(latent["width"], latent["height"], key) for key in keys]
        exit_at = self.server.faults.get("exit_at_step")
        for step in range(1, steps + 1):
            await asyncio.sleep(self.server.step_s)
            if self.server.interrupt:
                raise Interrupted
            if exit_at is not None and step >= exit_at:
                os._exit(3)  # the process dies mid-run, as a crashed ComfyUI does
            await self.server.send_preview(nodes.noisy(finals[0], step, steps, keys[0]), self.sid)
            await self.message(
                "progress", {"value": step, "max": steps, "node": node_id}, keep=False
            )
        return {**latent, "images": finals}

    def _save(self, class_type: str, i: dict[str, Any]) -> dict[str, Any]:
        """SaveImage into ``output/`` (``<prefix>_<counter>_.png``), PreviewImage into
        ``temp/``; the ``images`` of the node's UI output."""
        saved = class_type == "SaveImage"
        folder = "output" if saved else "temp"
        prefix = (
            str(i.get("filename_prefix") or "ComfyUI")
            if saved
            else f"ComfyUI_temp_{uuid.uuid4().hex[:5]}"
        )
        subfolder, _, base = prefix.rpartition("/")
        where = self.server.root / folder / subfolder
        where.mkdir(parents=True, exist_ok=True)
        counter = 1 + sum(1 for p in where.glob(f"{base}_*_.png"))
        images = []
        for image in i["images"]:
            name = f"{base}_{counter:05}_.png"
            image.save(where / name, format="PNG")
            images.append({"filename": name, "subfolder": subfolder, "type": folder})
            counter += 1
        return {"images": images}


def _is_output(prompt: dict[str, Any], node_id: str) -> bool:
    return nodes.NODES[prompt[node_id]["class_type"]][2]


# routes ---------------------------------------------------------------------------------


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status)


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return {}


class Api:
    """ComfyUI's routes over one :class:`StandIn`."""

    def __init__(self, server: StandIn) -> None:
        self.server = server

    async def post_prompt(self, request: Request) -> Response:
        body = await _body(request)
        if not isinstance(body, dict) or "prompt" not in body:
            return _json(
                {
                    "error": {
                        "type": "no_prompt",
                        "message": "No prompt provided",
                        "details": "No prompt provided",
                        "extra_info": {},
                    },
                    "node_errors": {},
                },
                400,
            )
        error, node_errors, outputs = nodes.validate(body["prompt"], self.server.choices)
        if error is not None:
            return _json({"error": error, "node_errors": node_errors}, 400)
        extra = dict(body.get("extra_data") or {})
        if "client_id" in body:
            extra["client_id"] = body["client_id"]
        prompt_id = str(body.get("prompt_id") or uuid.uuid4())
        self.server.number += 1
        item = Item(self.server.number, prompt_id, body["prompt"], extra, outputs)
        self.server.pending.append(item)
        self.server.wake.set()
        await self.server.status_changed()
        await asyncio.sleep(float(self.server.faults.get("prompt_answer_s", 0)))
        return _json({"prompt_id": prompt_id, "number": item.number, "node_errors": {}})

    async def get_prompt(self, request: Request) -> Response:
        return _json({"exec_info": self.server.queue_status()["status"]["exec_info"]})

    async def get_queue(self, request: Request) -> Response:
        running = [] if self.server.running is None else [self.server.running.row()]
        return _json(
            {
                "queue_running": running,
                "queue_pending": [item.row() for item in self.server.pending],
            }
        )

    async def post_queue(self, request: Request) -> Response:
        body = await _body(request)
        if body.get("clear"):
            self.server.pending.clear()
        for prompt_id in body.get("delete") or []:
            self.server.log["deleted"].append(prompt_id)
            self.server.pending[:] = [i for i in self.server.pending if i.prompt_id != prompt_id]
        await self.server.status_changed()
        return Response(status_code=200)

    async def interrupt(self, request: Request) -> Response:
        body = await _body(request)
        wanted = body.get("prompt_id") if isinstance(body, dict) else None
        running = self.server.running
        self.server.log["interrupts"].append(
            {"prompt_id": wanted, "running": running and running.prompt_id}
        )
        if running is not None and wanted in (None, running.prompt_id):
            self.server.interrupt = True
        return Response(status_code=200)

    async def get_history(self, request: Request) -> Response:
        prompt_id = request.path_params.get("prompt_id")
        if prompt_id is not None:
            found = self.server.history.get(prompt_id)
            return _json({} if found is None else {prompt_id: found})
        limit = request.query_params.get("max_items")
        items = list(self.server.history.items())
        return _json(dict(items[-int(limit) :] if limit else items))

    async def post_history(self, request: Request) -> Response:
        body = await _body(request)
        if body.get("clear"):
            self.server.history.clear()
        for prompt_id in body.get("delete") or []:
            self.server.history.pop(prompt_id, None)
        return Response(status_code=200)

    async def view(self, request: Request) -> Response:
        query = request.query_params
        folder = query.get("type", "output")
        if folder not in ("output", "input", "temp") or "filename" not in query:
            return Response(status_code=400)
        base = (self.server.root / folder).resolve()
        path = (base / query.get("subfolder", "") / query["filename"]).resolve()
        if not path.is_relative_to(base) or not path.is_file():
            return Response(status_code=404)
        kind = "image/png" if path.suffix == ".png" else "application/octet-stream"
        return Response(path.read_bytes(), media_type=kind)

    async def upload_image(self, request: Request) -> Response:
        form = await request.form()
        image = form.get("image")
        if image is None or isinstance(image, str) or not image.filename:
            return Response(status_code=400)
        folder = str(form.get("type") or "input")
        subfolder = str(form.get("subfolder") or "")
        overwrite = str(form.get("overwrite") or "").lower() in ("true", "1")
        base = (self.server.root / folder).resolve()
        where = (base / subfolder).resolve()
        if folder not in ("input", "temp", "output") or not where.is_relative_to(base):
            return Response(status_code=400)
        where.mkdir(parents=True, exist_ok=True)
        name = Path(image.filename).name
        stem, suffix = os.path.splitext(name)
        n = 1
        while (where / name).exists() and not overwrite:
            name = f"{stem} ({n}){suffix}"
            n += 1
        (where / name).write_bytes(await image.read())
        return _json({"name": name, "subfolder": subfolder, "type": folder})

    async def get_object_info(self, request: Request) -> Response:
        info = nodes.object_info(self.server.choices)
        name = request.path_params.get("node_class")
        return _json(info if name is None else {name: info[name]} if name in info else {})

    async def system_stats(self, request: Request) -> Response:
        return _json(
            {
                "system": {
                    "os": os.name,
                    "ram_total": 0,
                    "ram_free": 0,
                    "comfyui_version": "0.3.stand-in",
                    "python_version": sys.version,
                    "pytorch_version": "none",
                    "embedded_python": False,
                    "argv": sys.argv,
                },
                "devices": [
                    {
                        "name": "cpu",
                        "type": "cpu",
                        "index": None,
                        "vram_total": 0,
                        "vram_free": 0,
                        "torch_vram_total": 0,
                        "torch_vram_free": 0,
                    }
                ],
            }
        )

    async def standin_log(self, request: Request) -> Response:
        return _json(self.server.log)

    async def standin_faults(self, request: Request) -> Response:
        self.server.faults = dict(await _body(request))
        return _json(self.server.faults)

    async def ws(self, websocket: WebSocket) -> None:
        sid = websocket.query_params.get("clientId") or uuid.uuid4().hex
        await websocket.accept()
        self.server.sockets[sid] = websocket
        try:
            await websocket.send_text(
                json.dumps({"type": "status", "data": {**self.server.queue_status(), "sid": sid}})
            )
            while True:
                await websocket.receive_text()
        except WebSocketDisconnect:
            pass
        finally:
            if self.server.sockets.get(sid) is websocket:
                del self.server.sockets[sid]

    def routes(self) -> list[Route | WebSocketRoute]:
        return [
            Route("/prompt", self.post_prompt, methods=["POST"]),
            Route("/prompt", self.get_prompt, methods=["GET"]),
            Route("/queue", self.get_queue, methods=["GET"]),
            Route("/queue", self.post_queue, methods=["POST"]),
            Route("/interrupt", self.interrupt, methods=["POST"]),
            Route("/history", self.get_history, methods=["GET"]),
            Route("/history", self.post_history, methods=["POST"]),
            Route("/history/{prompt_id}", self.get_history, methods=["GET"]),
            Route("/view", self.view, methods=["GET"]),
            Route("/upload/image", self.upload_image, methods=["POST"]),
            Route("/object_info", self.get_object_info, methods=["GET"]),
            Route("/object_info/{node_class}", self.get_object_info, methods=["GET"]),
            Route("/system_stats", self.system_stats, methods=["GET"]),
            Route("/standin/log", self.standin_log, methods=["GET"]),
            Route("/standin/faults", self.standin_faults, methods=["POST"]),
            WebSocketRoute("/ws", self.ws),
        ]


async def serve(server: StandIn, host: str, port: int) -> None:
    """Serve until cancelled; prints the address once it accepts connections."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    app = Starlette(routes=Api(server).routes())
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    web = uvicorn.Server(config)
    worker = asyncio.create_task(server.work())
    serving = asyncio.create_task(web.serve(sockets=[sock]))
    while not web.started and not serving.done():
        await asyncio.sleep(0.01)
    print(f"comfyui stand-in listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    try:
        await serving
    finally:
        worker.cancel()


class Process:
    """A stand-in running as its own process (``python -m``), for tests: started on a
    free port under ``root``, stopped with SIGTERM or killed with SIGKILL."""

    def __init__(self, root: Path, *args: str) -> None:
        import subprocess

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.out = (root / "standin.log").open("w+b")
        command = [
            sys.executable,
            "-m",
            "tests.services.comfyui_standin",
            "--port",
            "0",
            "--root",
            str(root),
            *args,
        ]
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(command, stdout=self.out, stderr=subprocess.STDOUT, cwd=repo)
        self.url = self._address()

    def _address(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in (self.root / "standin.log").read_text(errors="replace").splitlines():
                if line.startswith("comfyui stand-in listening on "):
                    return line.rsplit(" ", 1)[1]
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("the ComfyUI stand-in did not start:\n" + self.output())

    def output(self) -> str:
        return (self.root / "standin.log").read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.out.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8188)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--load-s", type=float, default=0.5)
    parser.add_argument("--checkpoints", default=",".join(DEFAULT_CHECKPOINTS))
    parser.add_argument("--faults", type=json.loads, default={})
    args = parser.parse_args(argv)
    server = StandIn(
        args.root,
        step_s=args.step_s,
        load_s=args.load_s,
        checkpoints=args.checkpoints.split(","),
        faults=args.faults,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(server, args.host, args.port))


if __name__ == "__main__":
    main()
