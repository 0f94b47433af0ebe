"""The pieces around the backends: configuration, error classification, Retry-After,
image formats, workflow placeholders and the retry delay."""

from __future__ import annotations

import io
import json
import random
from datetime import UTC, datetime
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from backend_support import kiln_on, kiln_settings, run_task
from PIL import Image
from upstream_fakes import WORKFLOW

import kiln
from kiln import backends
from kiln.backends import as_output
from kiln.backends.comfyui import Workflow
from kiln.backends.upstream import check_response, retry_after_s, sniff
from kiln.bus import ProgressEvent
from kiln.config import Settings
from kiln.demo import GenerateParams
from kiln.errors import ConfigError, InvalidRequest, Permanent, Retryable
from kiln.paint import encode, render
from kiln.retry import RetryPolicy
from kiln.states import Status


def test_the_demo_is_the_default_backend() -> None:
    settings = Settings.from_env({})
    assert settings.backend == "demo"
    app = kiln.App(settings=settings)
    handler = backends.register(app)
    assert handler.backend.name == "demo"
    assert app.kinds["image.generate"].resources == {"gpu": 1}


def test_backend_settings_are_read_from_the_environment(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {
            "KILN_BACKEND": "OpenAI-Images",
            "KILN_OPENAI_BASE_URL": "http://10.0.0.5:8080/v1",
            "KILN_OPENAI_API_KEY": "sk-secret",
            "KILN_OPENAI_MODEL": "dall-e-3",
            "KILN_OPENAI_TIMEOUT_S": "45",
            "KILN_COMFYUI_URL": "http://gpu-1:8188",
            "KILN_COMFYUI_WORKFLOW": str(tmp_path / "w.json"),
            "KILN_COMFYUI_TIMEOUT_S": "90",
        }
    )
    assert settings.backend == "openai-images"
    assert (settings.openai_base_url, settings.openai_model) == (
        "http://10.0.0.5:8080/v1",
        "dall-e-3",
    )
    assert (settings.openai_timeout_s, settings.comfyui_timeout_s) == (45.0, 90.0)
    assert (settings.comfyui_url, settings.comfyui_workflow) == (
        "http://gpu-1:8188",
        tmp_path / "w.json",
    )
    assert settings.openai_api_key == "sk-secret"
    assert "sk-secret" not in repr(settings)


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"KILN_BACKEND": "stable-diffusion"}, "KILN_BACKEND must be one of demo, openai-images"),
        ({"KILN_BACKEND": "comfyui"}, "needs KILN_COMFYUI_WORKFLOW"),
        ({"KILN_BACKEND": "comfyui", "KILN_COMFYUI_WORKFLOW": "/nonexistent/w.json"},
         "cannot read /nonexistent/w.json"),
    ],
)  # fmt: skip
def test_a_backend_that_cannot_start_is_refused_up_front(
    env: dict[str, str], complaint: str
) -> None:
    app = kiln.App(settings=Settings.from_env(env))
    with pytest.raises(InvalidRequest, match=complaint):
        backends.register(app)
    assert "image.generate" not in app.kinds


def test_a_bad_timeout_is_refused() -> None:
    with pytest.raises(
        ConfigError, match="KILN_OPENAI_TIMEOUT_S='0': expected a number of seconds > 0"
    ):
        Settings.from_env({"KILN_OPENAI_TIMEOUT_S": "0"})


# error classification


def answer(status: int, body: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
    content = json.dumps(body).encode() if body is not None else b"upstream says no"
    return httpx.Response(status, content=content, headers=headers)


@pytest.mark.parametrize(
    ("status", "body", "error", "code"),
    [
        (429, {"error": {"message": "slow down", "code": "rate_limit_exceeded"}}, Retryable,
         "upstream_rate_limited"),
        (429, {"error": {"message": "quota", "code": "insufficient_quota"}}, Permanent,
         "upstream_rejected"),
        (500, None, Retryable, "upstream_unavailable"),
        (502, None, Retryable, "upstream_unavailable"),
        (503, None, Retryable, "upstream_unavailable"),
        (408, None, Retryable, "upstream_unavailable"),
        (400, {"error": {"message": "Invalid size"}}, Permanent, "upstream_rejected"),
        (401, {"error": {"message": "Incorrect API key"}}, Permanent, "upstream_rejected"),
        (404, None, Permanent, "upstream_rejected"),
    ],
)  # fmt: skip
def test_answers_are_classified(status: int, body: Any, error: type[Exception], code: str) -> None:
    with pytest.raises(error) as raised:
        check_response("openai-images", answer(status, body))
    assert raised.value.code == code  # type: ignore[attr-defined]
    assert f"openai-images answered {status}" in str(raised.value)


def test_success_passes_and_the_upstream_message_is_kept() -> None:
    check_response("x", answer(200, {"data": []}))
    with pytest.raises(Permanent, match="answered 400 Bad Request: Invalid size '100x100'"):
        check_response("x", answer(400, {"error": {"message": "Invalid size '100x100'"}}))
    with pytest.raises(Retryable, match="upstream says no"):
        check_response("x", answer(503))


def test_retry_after_becomes_the_errors_least_wait() -> None:
    with pytest.raises(Retryable) as raised:
        check_response("x", answer(429, {"error": {}}, {"Retry-After": "7"}))
    assert raised.value.retry_after_s == 7.0


@pytest.mark.parametrize(
    ("headers", "wait_s"),
    [
        ({}, None),
        ({"retry-after": "20"}, 20.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after-ms": "250", "retry-after": "20"}, 0.25),
        ({"retry-after": "-3"}, 0.0),
        ({"retry-after": "86400"}, 3600.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after": format_datetime(datetime(2026, 1, 1, 0, 1, 30, tzinfo=UTC), usegmt=True)},
         90.0),
    ],
)  # fmt: skip
def test_retry_after_headers_are_read(headers: dict[str, str], wait_s: float | None) -> None:
    now = datetime(2026, 1, 1, 0, 0, 0, tzinfo=UTC).timestamp()
    assert retry_after_s(httpx.Headers(headers), now=now) == wait_s


def test_the_retry_delay_is_at_least_the_minimum() -> None:
    task = type("T", (), {"attempt": 1, "max_attempts": 3, "deadline_at": 10_000.0})()
    policy = RetryPolicy(base_s=1.0, max_s=60.0)
    assert policy.next_retry_at(task, 100.0, random.Random(1)) < 101.0  # type: ignore[arg-type]
    assert policy.next_retry_at(task, 100.0, random.Random(1), min_delay_s=20) == 120.0  # type: ignore[arg-type]
    # ... unless that is past the deadline: then no retry
    assert policy.next_retry_at(task, 100.0, random.Random(1), min_delay_s=10_000) is None  # type: ignore[arg-type]


# image formats


def encoded(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_formats_are_recognised_from_their_bytes(fmt: str) -> None:
    assert sniff(encoded(fmt.upper())) == fmt
    assert sniff(b"GIF89a...") is None


@pytest.mark.parametrize(
    ("fmt", "name"), [("png", "image.png"), ("jpeg", "image.jpg"), ("webp", "image.webp")]
)
def test_outputs_are_encoded_in_the_format_asked(fmt: str, name: str) -> None:
    output = as_output(encoded("PNG"), fmt)
    assert output.name == name
    assert sniff(output.data) == fmt
    with Image.open(io.BytesIO(output.data)) as image:
        assert image.size == (40, 30)


def test_an_undecodable_image_is_a_bad_response() -> None:
    with pytest.raises(Retryable) as raised:
        as_output(b"\x89PNG\r\n\x1a\n broken", "jpeg")
    assert raised.value.code == "upstream_bad_response"


# ComfyUI workflows


def test_placeholders_are_filled_with_typed_values() -> None:
    params = GenerateParams(prompt='a "quoted" fox', negative_prompt="blur", width=768,
                            height=512, steps=20, seed=99)  # fmt: skip
    graph = Workflow(WORKFLOW).fill(params)
    assert graph["3"]["inputs"]["seed"] == 99
    assert graph["3"]["inputs"]["steps"] == 20
    assert graph["5"]["inputs"] == {"batch_size": 1, "height": 512, "width": 768}
    assert graph["6"]["inputs"]["text"] == 'a "quoted" fox, highly detailed'
    assert graph["7"]["inputs"]["text"] == "blur"
    assert WORKFLOW["3"]["inputs"]["seed"] == "{{seed}}"  # the template is left as it was


def test_an_absent_seed_is_the_derived_one() -> None:
    params = GenerateParams(prompt="a fox")
    assert Workflow(WORKFLOW).fill(params)["3"]["inputs"]["seed"] == params.effective_seed()


@pytest.mark.parametrize(
    ("graph", "complaint"),
    [
        ({"3": {"inputs": {}}}, "not an API-format ComfyUI workflow"),
        ({"last_node_id": 9, "nodes": []}, "not an API-format ComfyUI workflow"),
        ({"6": {"class_type": "CLIPTextEncode", "inputs": {"text": "fixed"}}}, "no {{prompt}}"),
    ],
)
def test_unusable_workflows_are_refused(graph: dict[str, Any], complaint: str) -> None:
    with pytest.raises(InvalidRequest, match=complaint):
        Workflow(graph)


async def test_the_demo_backend_paints_what_the_demo_always_painted(tmp_path: Path) -> None:
    # Given kiln with no KILN_BACKEND set
    params = {"prompt": "a red fox in snow", "width": 64, "height": 64, "steps": 4, "seed": 7,
              "simulate": {"step_ms": 0}}  # fmt: skip
    async with kiln_on(kiln_settings(tmp_path, {})) as (app, handler):
        # When a task runs
        task, seen = await run_task(app, params)
        stored = await app.storage.get(task.result["outputs"][0]["key"])

    # Then the demo painted it, step by step, with the bytes its renderer gives
    assert handler.backend.name == "demo"
    assert task.status is Status.SUCCESS, task.error
    assert stored == encode(render("a red fox in snow", 7, 64, 64, 4, 4), "png")
    steps = [m.progress["step"] for m in seen if isinstance(m, ProgressEvent) and m.progress]
    assert steps[-1] == 4
