"""The stand-in ComfyUI (tests/services/comfyui_standin.py) as its own process, spoken to
as ComfyUI is: a graph runs with ComfyUI's messages in ComfyUI's order, its history and
its pictures are served, uploads land in the input folder, an interrupt stops a prompt,
and a graph it cannot run is refused with ComfyUI's 400."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from tests.services.comfyui_nodes import txt2img
from tests.services.comfyui_standin import Process
from websockets.asyncio.client import ClientConnection, connect

pytestmark = pytest.mark.slow


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Process]:
    process = Process(tmp_path / "comfy", "--step-s", "0.02", "--load-s", "0.05")
    yield process
    process.stop()


@pytest.fixture
async def http(standin: Process) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=standin.url, timeout=10) as client:
        yield client


def socket_url(standin: Process, client_id: str) -> str:
    return standin.url.replace("http://", "ws://") + f"/ws?clientId={client_id}"


async def messages_until_done(ws: ClientConnection, prompt_id: str) -> list[Any]:
    """Text messages as ``(type, data)`` and binary ones as ``("binary", bytes)`` until
    ``executing`` with ``node: null`` for the prompt."""
    seen: list[Any] = []
    async with asyncio.timeout(20):
        async for message in ws:
            if isinstance(message, bytes):
                seen.append(("binary", message))
                continue
            event = json.loads(message)
            seen.append((event["type"], event["data"]))
            data = event["data"]
            if event["type"] == "executing" and data == {"node": None, "prompt_id": prompt_id}:
                return seen
    raise AssertionError("the socket closed before the prompt ended")


async def run(
    standin: Process, http: httpx.AsyncClient, graph: dict[str, Any]
) -> tuple[str, list[Any]]:
    async with connect(socket_url(standin, "c1")) as ws:
        answer = await http.post("/prompt", json={"prompt": graph, "client_id": "c1"})
        assert answer.status_code == 200, answer.text
        prompt_id = answer.json()["prompt_id"]
        return prompt_id, await messages_until_done(ws, prompt_id)


async def test_a_graph_runs_with_comfyuis_messages_in_order_and_its_history(
    standin: Process, http: httpx.AsyncClient
) -> None:
    # When the default text-to-image graph is queued with a client id
    prompt_id, seen = await run(standin, http, txt2img(steps=3))
    kinds = [kind for kind, _ in seen]
    # Then the socket said: status, start, cached (none), each node executing, three
    # steps each after a binary JPEG preview, the saved image, success, then done
    assert kinds[0] == "status"
    assert kinds.index("execution_start") < kinds.index("execution_cached")
    executing = [data["node"] for kind, data in seen if kind == "executing"]
    assert executing == ["4", "6", "7", "5", "3", "8", "9", None]
    progress = [(d["value"], d["max"], d["node"]) for k, d in seen if k == "progress"]
    assert progress == [(1, 3, "3"), (2, 3, "3"), (3, 3, "3")]
    previews = [data for kind, data in seen if kind == "binary"]
    assert len(previews) == 3
    assert struct.unpack(">II", previews[0][:8]) == (1, 1)
    assert Image.open(io.BytesIO(previews[0][8:])).format == "JPEG"
    executed = [data for kind, data in seen if kind == "executed"]
    assert [d["node"] for d in executed] == ["9"]
    assert kinds[-2:] == ["execution_success", "executing"]
    # And the history holds the saved image, which /view serves as the PNG on disk
    history = (await http.get(f"/history/{prompt_id}")).json()[prompt_id]
    assert history["status"]["status_str"] == "success" and history["status"]["completed"]
    image = history["outputs"]["9"]["images"][0]
    assert image == {"filename": "kiln_00001_.png", "subfolder": "", "type": "output"}
    view = await http.get("/view", params=image)
    assert view.status_code == 200
    on_disk = (standin.root / "output" / "kiln_00001_.png").read_bytes()
    assert view.content == on_disk
    assert Image.open(io.BytesIO(view.content)).size == (64, 64)
    assert prompt_id in (await http.get("/history")).json()


async def test_the_picture_is_deterministic_and_a_second_run_is_cached(
    standin: Process, http: httpx.AsyncClient
) -> None:
    first, _ = await run(standin, http, txt2img(seed=3, prefix="a"))
    second, seen = await run(standin, http, txt2img(seed=3, prefix="b"))
    other, _ = await run(standin, http, txt2img(seed=4, prefix="c"))
    digests = [
        hashlib.sha256((standin.root / "output" / f"{p}_00001_.png").read_bytes()).hexdigest()
        for p in "abc"
    ]
    # The same seed and prompt paint the same picture; another seed another one
    assert digests[0] == digests[1] != digests[2]
    # The second run found the unchanged nodes cached, the checkpoint loaded once
    cached = next(data["nodes"] for kind, data in seen if kind == "execution_cached")
    assert set(cached) == {"4", "5", "6", "7", "3", "8"}
    log = (await http.get("/standin/log")).json()
    assert log["loads"] == 1 and log["loaded"] == "v1-5-pruned-emaonly.safetensors"
    assert log["prompts"] == [first, second, other]


async def test_an_upload_lands_in_the_input_folder_and_load_image_reads_it(
    standin: Process, http: httpx.AsyncClient
) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buffer, format="PNG")
    files = {"image": ("red.png", buffer.getvalue(), "image/png")}
    up = await http.post("/upload/image", files=files, data={"overwrite": "true"})
    assert up.json() == {"name": "red.png", "subfolder": "", "type": "input"}
    again = await http.post("/upload/image", files=files)
    assert again.json()["name"] == "red (1).png"
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "red.png"}},
        "2": {
            "class_type": "ImageScale",
            "inputs": {
                "image": ["1", 0],
                "upscale_method": "bilinear",
                "width": 20,
                "height": 15,
                "crop": "disabled",
            },
        },
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "s/up"}},
    }
    prompt_id, _ = await run(standin, http, graph)
    image = (await http.get(f"/history/{prompt_id}")).json()[prompt_id]["outputs"]["3"]["images"][0]
    assert image == {"filename": "up_00001_.png", "subfolder": "s", "type": "output"}
    saved = Image.open(io.BytesIO((await http.get("/view", params=image)).content))
    assert saved.size == (20, 15) and saved.getpixel((5, 5)) == (200, 10, 10)


async def test_a_graph_it_cannot_run_is_refused_as_comfyui_refuses_it(
    standin: Process, http: httpx.AsyncClient
) -> None:
    unknown = txt2img()
    unknown["9"]["class_type"] = "UltraSharpUpscaler"
    answer = await http.post("/prompt", json={"prompt": unknown})
    assert answer.status_code == 400
    assert answer.json() == {
        "error": {
            "type": "invalid_prompt",
            "message": "Cannot execute because node UltraSharpUpscaler does not exist.",
            "details": "Node ID '#9'",
            "extra_info": {},
        },
        "node_errors": {},
    }
    missing = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "nowhere.png"}},
        "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    answer = await http.post("/prompt", json={"prompt": missing})
    assert answer.status_code == 400
    body = answer.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["1"]["class_type"] == "LoadImage"
    assert body["node_errors"]["1"]["dependent_outputs"] == ["2"]
    assert "Invalid image file: nowhere.png" in body["node_errors"]["1"]["errors"][0]["details"]
    bad_ckpt = txt2img("nope.safetensors")
    answer = await http.post("/prompt", json={"prompt": bad_ckpt})
    assert answer.json()["node_errors"]["4"]["errors"][0]["type"] == "value_not_in_list"
    assert (await http.get("/queue")).json() == {"queue_running": [], "queue_pending": []}


async def test_an_interrupt_stops_the_running_prompt_and_a_queued_one_can_be_deleted(
    standin: Process, http: httpx.AsyncClient
) -> None:
    async with connect(socket_url(standin, "c2")) as ws:
        body = {"prompt": txt2img(steps=500), "client_id": "c2"}
        running = (await http.post("/prompt", json=body)).json()["prompt_id"]
        queued = (await http.post("/prompt", json=body)).json()["prompt_id"]
        async with asyncio.timeout(20):  # wait for a step of the first
            async for message in ws:
                if isinstance(message, str) and json.loads(message)["type"] == "progress":
                    break
        queue = (await http.get("/queue")).json()
        assert [row[1] for row in queue["queue_running"]] == [running]
        assert [row[1] for row in queue["queue_pending"]] == [queued]
        await http.post("/queue", json={"delete": [queued]})
        await http.post("/interrupt", json={"prompt_id": running})
        seen = await messages_until_done(ws, running)
    interrupted = [data for kind, data in seen if kind == "execution_interrupted"]
    assert interrupted and interrupted[0]["node_id"] == "3"
    assert interrupted[0]["node_type"] == "KSampler"
    history = (await http.get(f"/history/{running}")).json()[running]
    assert history["status"]["status_str"] == "error" and not history["status"]["completed"]
    assert (await http.get(f"/history/{queued}")).json() == {}
    assert (await http.get("/queue")).json() == {"queue_running": [], "queue_pending": []}
    log = (await http.get("/standin/log")).json()
    assert log["deleted"] == [queued]
    assert log["interrupts"] == [{"prompt_id": running, "running": running}]


async def test_faults_a_node_error_an_oom_and_a_death_mid_run(
    standin: Process, http: httpx.AsyncClient
) -> None:
    fault = {
        "class_type": "KSampler",
        "exception_type": "torch.OutOfMemoryError",
        "exception_message": "CUDA out of memory. Tried to allocate 2.00 GiB",
        "times": 1,
    }
    await http.post("/standin/faults", json={"raise": fault})
    prompt_id, seen = await run(standin, http, txt2img())
    errors = [data for kind, data in seen if kind == "execution_error"]
    assert errors[0]["node_id"] == "3" and errors[0]["node_type"] == "KSampler"
    assert errors[0]["exception_type"] == "torch.OutOfMemoryError"
    assert "CUDA out of memory" in errors[0]["exception_message"]
    history = (await http.get(f"/history/{prompt_id}")).json()[prompt_id]
    assert history["status"]["messages"][-1][0] == "execution_error"
    _, again = await run(standin, http, txt2img())  # the fault was for one run
    assert "execution_success" in [kind for kind, _ in again]
    await http.post("/standin/faults", json={"exit_at_step": 2})
    await http.post("/prompt", json={"prompt": txt2img(seed=99)})
    for _ in range(200):
        if not standin.alive():
            break
        await asyncio.sleep(0.05)
    assert standin.proc.poll() == 3


async def test_object_info_and_system_stats_answer_as_comfyui(
    standin: Process, http: httpx.AsyncClient
) -> None:
    info = (await http.get("/object_info")).json()
    assert info["KSampler"]["input"]["required"]["sampler_name"][0][0] == "euler"
    assert info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0] == [
        "v1-5-pruned-emaonly.safetensors",
        "sd_xl_base_1.0.safetensors",
    ]
    assert info["SaveImage"]["output_node"] is True
    assert list((await http.get("/object_info/VAEDecode")).json()) == ["VAEDecode"]
    stats = (await http.get("/system_stats")).json()
    assert stats["devices"][0]["type"] == "cpu" and "comfyui_version" in stats["system"]
    assert (await http.get("/prompt")).json() == {"exec_info": {"queue_remaining": 0}}
