"""GET /metrics: the store's numbers for the whole deployment, plus this process's."""

from __future__ import annotations

from collections import Counter
from typing import Any

from api_support import ApiUnderTest, image_body, running_api, wait_until
from prometheus_client.parser import text_string_to_metric_families

from kiln.config import Settings
from kiln.counters import PREEMPTIONS
from kiln.states import Status

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(api: ApiUnderTest, key: str | None = None) -> Samples:
    """The samples of ``/metrics``: without a key (the client's own is not sent), or with
    ``key`` as a Bearer token."""
    return parse(await scrape_text(api, key))


async def scrape_text(api: ApiUnderTest, key: str | None = None) -> str:
    response = await api.client.get("/metrics", headers={"Authorization": bearer_value(key)})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def bearer_value(key: str | None) -> str:
    return f"Bearer {key}" if key else ""


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def labelled(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(dict(labels)[k] for k in keys): value
        for (sample, labels), value in samples.items()
        if sample == name
    }


async def _run(api: ApiUnderTest, prompt: str, **simulate: Any) -> str:
    body = image_body(prompt)
    body["params"]["simulate"] = {"step_ms": 0, **simulate}
    response = await api.submit(body)
    task_id: str = response.json()["id"]
    await api.kiln.wait(task_id, timeout_s=30)
    return task_id


async def test_metrics_match_the_store_after_a_scripted_run(working_api: ApiUnderTest) -> None:
    await _run(working_api, "first success")
    await scrape(working_api)
    await _run(working_api, "second success")
    await _run(working_api, "permanent failure", permanent=True, fail_code="boom")
    await _run(working_api, "fails once", fail_attempts=1)
    await working_api.submit(image_body("first success"))
    keyed = {"Idempotency-Key": "k1"}
    for _ in range(3):
        keyed_id = (await working_api.submit(image_body("keyed"), headers=keyed)).json()["id"]
    await working_api.kiln.wait(keyed_id, timeout_s=30)

    samples = await scrape(working_api)

    store = working_api.kiln.engine.store
    stats = await store.stats(tenant=None, ghost_after_s=60)
    counters = await store.counters()
    tasks = labelled(samples, "kiln_tasks", "status")
    assert tasks == {(str(s),): float(stats.counts[str(s)]) for s in Status}
    assert tasks[("SUCCESS",)] == 4 and tasks[("FAILED",)] == 1
    transitions = labelled(samples, "kiln_transitions_total", "from", "to")
    assert transitions == {
        tuple(labels.split(">")): float(n)
        for (name, labels), n in counters.items()
        if name == "transitions"
    }
    assert transitions[("UPLOADING", "SUCCESS")] == 4
    assert transitions[("FAILED", "RETRYING")] == 1
    failures = labelled(samples, "kiln_failures_total", "code")
    assert failures == {("boom",): 1.0, ("simulated_failure",): 1.0}
    dedup = labelled(samples, "kiln_dedup_hits_total", "type")
    assert dedup == {("content",): 1.0, ("idempotency",): 2.0}
    assert samples[("kiln_ghost_tasks", ())] == 0
    assert samples[("kiln_stale_writes_total", ())] == counters.get(("stale_writes", ""), 0)
    assert samples[("kiln_recovered_total", ())] == 0
    renewals = counters.get(("lease_renewals", ""), 0)
    assert samples[("kiln_lease_renewals_total", ())] == renewals
    assert labelled(samples, "kiln_illegal_transitions_total", "from", "to") == {}

    events = await store.events(limit=10_000)
    dwell = Counter(str(e.from_status) for e in events if e.dwell_s is not None)
    state_counts = labelled(samples, "kiln_state_seconds_count", "status")
    assert state_counts == {(status,): float(n) for status, n in dwell.items()}
    buckets = labelled(samples, "kiln_state_seconds_bucket", "status", "le")
    assert buckets[("GENERATING", "+Inf")] == dwell["GENERATING"]

    requests = labelled(samples, "kiln_api_requests_total", "method", "route", "status")
    assert requests[("POST", "/v1/tasks", "201")] == 5
    assert requests[("GET", "/metrics", "200")] == 1


async def test_metrics_need_no_key_and_count_open_streams(keyed_api: ApiUnderTest) -> None:
    keyed_api.client.headers.pop("Authorization")

    samples = await scrape(keyed_api)

    assert samples[("kiln_api_streams_open", (("transport", "sse"),))] == 0
    assert ("kiln_tasks", (("status", "PENDING"),)) in samples


async def test_the_loops_of_kiln_serve_report_on_the_api_metrics(settings: Settings) -> None:
    # Given an API process running a worker and a supervisor in process
    async with running_api(settings, workers=2, supervisor=True) as api:
        # When a task has run and the supervisor has swept as leader
        await _run(api, "a quarry")

        async def leading() -> bool:
            return (await scrape(api)).get(("kiln_supervisor_leading", ())) == 1.0

        await wait_until(leading)
        samples = await scrape(api)
    # Then /metrics carries the loops' own readings beside the store's
    assert samples[("kiln_supervisor_sweeps_total", ())] >= 1
    assert ("kiln_supervisor_last_sweep_seconds", ()) in samples
    assert samples[("kiln_worker_concurrency", ())] == 2.0
    assert samples[("kiln_worker_attempts_completed_total", ())] == 1.0
    assert samples[("kiln_tasks", (("status", "SUCCESS"),))] == 1.0


async def test_preemptions_are_counted_per_pool(keyed_api: ApiUnderTest) -> None:
    # Given two requests to yield in one pool, counted by the store as the supervisor does
    for _ in range(2):
        await keyed_api.kiln.engine.store.bump(PREEMPTIONS, "gpu-a100")
    keyed_api.client.headers.pop("Authorization")

    samples = await scrape(keyed_api)

    assert labelled(samples, "kiln_preemptions_total", "pool") == {("gpu-a100",): 2}
