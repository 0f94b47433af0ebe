"""Circuit breakers on the API: `/v1/stats` and `/metrics` show the state shared in the
store once a kind's upstream errors trip its breaker."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from api_support import ALICE_KEY, ApiUnderTest, image_body, running_api, wait_until, with_keys
from test_api_metrics import labelled, scrape

from kiln.config import Settings
from kiln.states import Status


async def _fail_upstream(api: ApiUnderTest, prompt: str) -> str:
    body = image_body(prompt, max_attempts=1)
    body["params"]["simulate"] = {"step_ms": 0, "fail_attempts": 1,
                                  "fail_code": "upstream_unavailable"}  # fmt: skip
    response = await api.submit(body)
    assert response.status_code == 201, response.text
    task_id: str = response.json()["id"]
    return task_id


async def _stats(api: ApiUnderTest) -> dict[str, Any]:
    response = await api.client.get("/v1/stats")
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


async def test_a_tripped_breaker_shows_in_stats_and_metrics(settings: Settings) -> None:
    # Given the API with a worker, and breakers that open after two failures for a minute
    tuned = with_keys(settings).with_(breaker_min_calls=2, breaker_open_s=60.0)
    async with running_api(tuned, key=ALICE_KEY, workers=1) as api:
        before = await _stats(api)
        assert before["breakers"] == {}
        # When two tasks fail on their upstream
        for n in range(2):
            task_id = await _fail_upstream(api, f"a storm {n}")
            await wait_until(
                lambda task_id=task_id: _final(api, task_id),  # type: ignore[misc]
                timeout_s=30,
            )

        # Then /v1/stats shows the kind's breaker open until a minute from now
        async def shown() -> bool:
            return "image.generate" in (await _stats(api))["breakers"]

        await wait_until(shown, timeout_s=10)
        stats = await _stats(api)
        breaker = stats["breakers"]["image.generate"]
        assert breaker["state"] == "open"
        until = datetime.fromisoformat(breaker["until"]).timestamp()
        assert 50 < until - api.kiln.now() <= 60
        assert stats["counts"][str(Status.FAILED)] == 2  # the other keys are still there
        # And /metrics shows the state and the transition
        samples = await scrape(api)
        assert labelled(samples, "kiln_breaker_state", "breaker") == {("image.generate",): 2.0}
        transitions = labelled(samples, "kiln_breaker_transitions_total", "breaker", "to")
        assert transitions == {("image.generate", "open"): 1.0}
        # And a new task waits, PENDING
        waiting = await api.submit(image_body("after the storm"))
        assert waiting.json()["status"] == "PENDING"


async def _final(api: ApiUnderTest, task_id: str) -> bool:
    response = await api.client.get(f"/v1/tasks/{task_id}")
    return bool(response.json()["final"])
