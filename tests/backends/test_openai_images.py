"""The openai-images backend end to end: a kiln worker against a fake OpenAI images API."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import httpx
import pytest
from backend_support import TASK_TIMEOUT_S, kiln_on, kiln_settings, run_task
from PIL import Image
from prometheus_client import CollectorRegistry
from upstream_fakes import FakeOpenAI

import kiln
from kiln import backends
from kiln.api import create_app
from kiln.backends import UpstreamMetrics
from kiln.backends.breaker import CircuitBreaker
from kiln.backends.openai_images import OpenAIImagesBackend
from kiln.bus import ProgressEvent
from kiln.errors import Retryable
from kiln.models import StoredOutput
from kiln.states import Event, Status

PARAMS: dict[str, Any] = {"prompt": "a red fox in snow", "width": 1024, "height": 1024}
API_KEY = "sk-test-0123456789"


def openai_env(fake: FakeOpenAI, **extra: str) -> dict[str, str]:
    return {
        "KILN_BACKEND": "openai-images",
        "KILN_OPENAI_BASE_URL": f"{fake.base_url}/v1",
        "KILN_OPENAI_API_KEY": API_KEY,
        **extra,
    }


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sample(metrics: UpstreamMetrics, name: str, **labels: str) -> float | None:
    registry = CollectorRegistry()
    registry.register(metrics)
    return registry.get_sample_value(name, labels)


async def test_the_upstream_image_is_the_stored_verified_output(
    openai_fake: FakeOpenAI, tmp_path: Path
) -> None:
    # Given kiln configured with KILN_BACKEND=openai-images and a model of the dall-e kind
    settings = kiln_settings(tmp_path, openai_env(openai_fake, KILN_OPENAI_MODEL="dall-e-3"))
    async with kiln_on(settings) as (app, handler):
        # When a task runs
        task, seen = await run_task(app, PARAMS)

        # Then it succeeded with exactly the upstream's bytes, verified in storage
        assert task.status is Status.SUCCESS, task.error
        [output] = [StoredOutput.from_json(o) for o in task.result["outputs"]]
        assert (output.name, output.content_type) == ("image.png", "image/png")
        assert output.sha256 == hashlib.sha256(openai_fake.image).hexdigest()
        assert await app.storage.get(output.key) == openai_fake.image
    assert handler.backend.name == "openai-images"
    # And the request had the documented shape, with the key as a bearer token
    assert openai_fake.requests == [
        {"model": "dall-e-3", "prompt": "a red fox in snow", "n": 1, "size": "1024x1024",
         "response_format": "b64_json"}
    ]  # fmt: skip
    assert openai_fake.headers[0]["authorization"] == f"Bearer {API_KEY}"
    # And progress went through the request and download stages, without steps
    progress = [m for m in seen if isinstance(m, ProgressEvent)]
    assert [(p.stage, p.progress) for p in progress] == [("request", None), ("download", None)]


async def test_gpt_image_models_get_output_format_and_a_jpeg_is_stored_as_is(
    openai_fake: FakeOpenAI, tmp_path: Path
) -> None:
    # Given a gpt-image model, which refuses response_format, and a JPEG-painting upstream
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 30)).save(buffer, format="JPEG")
    openai_fake.image = buffer.getvalue()
    settings = kiln_settings(tmp_path, openai_env(openai_fake, KILN_OPENAI_MODEL="gpt-image-1"))
    async with kiln_on(settings) as (app, _):
        # When a task asks for a JPEG
        task, _ = await run_task(app, {**PARAMS, "format": "jpeg"})
        stored = await app.storage.get(task.result["outputs"][0]["key"])

    # Then the request asked for that format instead, and the JPEG was kept byte for byte
    assert task.status is Status.SUCCESS, task.error
    assert openai_fake.requests[0]["output_format"] == "jpeg"
    assert "response_format" not in openai_fake.requests[0]
    assert task.result["outputs"][0]["name"] == "image.jpg"
    assert stored == openai_fake.image


async def test_a_png_answer_is_converted_to_the_format_the_task_asked_for(
    openai_fake: FakeOpenAI, tmp_path: Path
) -> None:
    # Given an upstream that answers with a URL to a PNG (it ignored response_format)
    openai_fake.script = ["url"]
    settings = kiln_settings(tmp_path, openai_env(openai_fake, KILN_OPENAI_MODEL="dall-e-2"))
    async with kiln_on(settings) as (app, _):
        # When a task asks for WEBP
        task, _ = await run_task(app, {**PARAMS, "format": "webp"})
        stored = await app.storage.get(task.result["outputs"][0]["key"])

    # Then the image was fetched from the URL without the API key, and stored as WEBP
    assert task.status is Status.SUCCESS, task.error
    assert "authorization" not in openai_fake.file_headers[0]
    with Image.open(io.BytesIO(stored)) as image:
        assert (image.format, image.size) == ("WEBP", (64, 64))


async def test_rate_limit_and_server_error_are_retried_then_succeed(
    openai_fake: FakeOpenAI, tmp_path: Path
) -> None:
    # Given an upstream that answers 429 (Retry-After: 1), then 500, then the image
    openai_fake.script = ["429", "500"]
    async with kiln_on(kiln_settings(tmp_path, openai_env(openai_fake))) as (app, _):
        # When a task with three attempts runs
        task, _ = await run_task(app, PARAMS, max_attempts=3)
        events = await app.engine.store.events(task_id=task.id, after=0, limit=100)

    # Then the third attempt succeeded, after one failure of each retryable kind
    assert (task.status, task.attempt, openai_fake.calls) == (Status.SUCCESS, 3, 3)
    failures = [e for e in events if e.event is Event.FAIL]
    assert [f.error["code"] for f in failures] == ["upstream_rate_limited", "upstream_unavailable"]
    assert all(f.error["retryable"] for f in failures)
    assert "Rate limit reached" in failures[0].error["message"]
    # And the second attempt was claimed no sooner than the Retry-After asked (1 s; the
    # backoff alone is at most 0.05 s here)
    claims = [e for e in events if e.event is Event.CLAIM]
    assert claims[1].at - failures[0].at >= 1.0


async def test_a_rejected_request_fails_for_good_with_the_upstream_message(
    openai_fake: FakeOpenAI, tmp_path: Path
) -> None:
    # Given an upstream that refuses the prompt with 400 and its documented error body
    openai_fake.script = ["400"]
    async with kiln_on(kiln_settings(tmp_path, openai_env(openai_fake))) as (app, handler):
        # When a task with three attempts runs
        task, _ = await run_task(app, PARAMS, max_attempts=3)

        # Then it failed permanently on the first attempt, saying what the upstream said
        assert (task.status, task.attempt, openai_fake.calls) == (Status.FAILED, 1, 1)
        assert task.error is not None
        assert task.error["code"] == "upstream_rejected"
        assert task.error["retryable"] is False
        assert "400" in task.error["message"]
        assert "rejected as a result of our safety system" in task.error["message"]
        # And the latency histogram has the call, labelled rejected
        assert sample(handler.metrics, "kiln_upstream_request_seconds_count",
                      backend="openai-images", outcome="rejected") == 1.0  # fmt: skip


async def test_an_exhausted_quota_is_not_retried(openai_fake: FakeOpenAI, tmp_path: Path) -> None:
    openai_fake.script = ["quota"]
    async with kiln_on(kiln_settings(tmp_path, openai_env(openai_fake))) as (app, _):
        task, _ = await run_task(app, PARAMS, max_attempts=3)
    assert (task.status, task.attempt) == (Status.FAILED, 1)
    assert task.error is not None and task.error["code"] == "upstream_rejected"


async def test_a_slow_upstream_times_out_and_the_next_attempt_succeeds(
    openai_fake: FakeOpenAI, tmp_path: Path
) -> None:
    # Given an upstream whose first answer never comes, and a 0.5 s timeout
    openai_fake.script = ["hang"]
    env = openai_env(openai_fake, KILN_OPENAI_TIMEOUT_S="0.5")
    async with kiln_on(kiln_settings(tmp_path, env)) as (app, handler):
        # When a task with two attempts runs
        task, _ = await run_task(app, PARAMS, max_attempts=2)
        events = await app.engine.store.events(task_id=task.id, after=0, limit=100)

        # Then the first attempt failed as unavailable after the timeout, the second worked
        assert (task.status, task.attempt) == (Status.SUCCESS, 2)
        [failure] = [e for e in events if e.event is Event.FAIL]
        assert failure.error == {
            "code": "upstream_unavailable",
            "message": "openai-images gave no answer within 0.5 s",
            "retryable": True,
        }
        # And the histogram counted one error and one success
        for outcome in ("error", "ok"):
            assert sample(handler.metrics, "kiln_upstream_request_seconds_count",
                          backend="openai-images", outcome=outcome) == 1.0  # fmt: skip
        timed_out = sample(handler.metrics, "kiln_upstream_request_seconds_sum",
                           backend="openai-images", outcome="error")  # fmt: skip
        assert timed_out is not None and 0.5 <= timed_out < 5.0


async def test_an_answer_without_an_image_is_a_retryable_bad_response(
    openai_fake: FakeOpenAI, tmp_path: Path
) -> None:
    openai_fake.script = ["garbage"]
    async with kiln_on(kiln_settings(tmp_path, openai_env(openai_fake))) as (app, _):
        task, _ = await run_task(app, PARAMS, max_attempts=1)
    assert task.status is Status.FAILED
    assert task.error is not None
    assert (task.error["code"], task.error["retryable"]) == ("upstream_bad_response", True)


async def test_the_breaker_opens_fails_fast_probes_and_closes(
    openai_fake: FakeOpenAI, tmp_path: Path
) -> None:
    # Given a backend whose breaker opens after 2 failures in a row, for 30 s of the clock
    # kiln runs on, and a kind that fails fast while it is open
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=30.0, clock=clock)
    metrics = UpstreamMetrics()
    env = openai_env(openai_fake, KILN_BREAKER_POLICY="image.generate=fail_fast",
                     KILN_BREAKER_OPEN_S="30")  # fmt: skip
    settings = kiln_settings(tmp_path, env)
    backend = OpenAIImagesBackend.from_settings(settings, metrics, breaker=breaker)
    openai_fake.script = ["500", "500", "500"]
    app = kiln.App(settings=settings, clock=clock)
    backends.register(app, backend=backend, metrics=metrics)
    async with app:
        # When two tasks fail on a failing upstream
        for n in range(2):
            task, _ = await run_task(app, {**PARAMS, "seed": n}, max_attempts=1)
            assert task.error is not None and task.error["code"] == "upstream_unavailable"
        # Then the breaker is open: a call is refused without reaching the upstream
        assert breaker.state == "open"
        assert sample(metrics, "kiln_upstream_breaker_open", backend="openai-images") == 1.0
        with pytest.raises(Retryable, match="circuit breaker is open") as refused:
            async with backend.upstream.call(timeout_s=5.0):
                pass
        assert refused.value.retry_after_s == 30.0
        assert sample(metrics, "kiln_upstream_request_seconds_count",
                      backend="openai-images", outcome="open") == 1.0  # fmt: skip
        # And the next task fails fast, for good, without reaching it
        task, _ = await run_task(app, {**PARAMS, "seed": 2}, max_attempts=3)
        assert task.status is Status.FAILED and task.attempt == 1
        assert task.error is not None and task.error["code"] == "upstream_unavailable"
        assert task.error["retryable"] is False
        assert "circuit breaker 'openai-images' is open" in task.error["message"]
        assert openai_fake.calls == 2

        # When the cool-down has passed, one probe goes out; it fails: open again
        clock.now += 30
        task, _ = await run_task(app, {**PARAMS, "seed": 3}, max_attempts=1)
        assert (task.status, openai_fake.calls, breaker.state) == (Status.FAILED, 3, "open")

        # When the next probe succeeds, the breaker closes and calls flow again
        clock.now += 30
        for n in (4, 5):
            task, _ = await run_task(app, {**PARAMS, "seed": n}, max_attempts=1)
            assert task.status is Status.SUCCESS, task.error
        assert (openai_fake.calls, breaker.state) == (5, "closed")
        assert sample(metrics, "kiln_upstream_breaker_open", backend="openai-images") == 0.0
        # And every process sees it closed through the store
        stored = {record.name: record.state for record in await app.engine.store.limits.breakers()}
        assert stored["openai-images"] == "closed"


async def test_the_histogram_is_on_the_api_metrics_of_kiln_serve(
    openai_fake: FakeOpenAI, tmp_path: Path
) -> None:
    # Given the API with an in-process worker (kiln serve) on the openai-images backend
    app = kiln.App(settings=kiln_settings(tmp_path, openai_env(openai_fake)))
    backends.register(app)
    api = create_app(app, workers=1)
    transport = httpx.ASGITransport(app=api)
    async with (
        api.router.lifespan_context(api),
        httpx.AsyncClient(transport=transport, base_url="http://kiln.test") as client,
    ):
        # When a task runs
        submitted = await app.submit("image.generate", PARAMS)
        done = await app.wait(submitted.task.id, timeout_s=TASK_TIMEOUT_S)
        text = (await client.get("/metrics")).text

    # Then /metrics carries the upstream histogram and the breaker gauge
    assert done.status is Status.SUCCESS, done.error
    assert 'kiln_upstream_request_seconds_count{backend="openai-images",outcome="ok"} 1.0' in text
    assert 'kiln_upstream_breaker_open{backend="openai-images"} 0.0' in text
