"""GET /metrics for whom: per-tenant series only for the admin key and the metrics key while
auth is on; label values tenants choose (models, failure codes, HTTP methods) bounded."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_support import (
    ADMIN_KEY,
    ALICE_KEY,
    BOB_KEY,
    ApiUnderTest,
    assert_error,
    bearer,
    image_body,
    running_api,
    wait_until,
    with_keys,
)
from test_api_metrics import labelled, parse, scrape, scrape_text
from typer.testing import CliRunner

import kiln
from kiln import backends
from kiln.api.app import create_app
from kiln.api.metrics import MAX_FAILURE_CODES, TENANT_FAMILIES
from kiln.cli import cli
from kiln.config import Settings
from kiln.counters import FAILURES
from kiln.errors import ConfigError
from kiln.model_cache import DEFAULT_MAX_MODELS
from kiln.states import Status

METRICS_KEY = "key-metrics-0123456789"
SECRET_MODEL = "alice-secret-model"
#: A family name as the exposition writes it (counters end in _total).
EXPOSED = {"kiln_gpu_seconds": "kiln_gpu_seconds_total"}


def exposed(family: str) -> str:
    return EXPOSED.get(family, family)


@contextlib.asynccontextmanager
async def loading(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """Keys for alice, bob and the admin; two in-process worker slots serving
    `image.generate` on the demo backend, which loads the model a task names (no memory
    limit, no load time); calls as alice."""
    keyed = with_keys(settings).with_(demo_model_load_s=0.0)
    async with running_api(keyed, key=ALICE_KEY, workers=2, kiln_app=backend_app(keyed)) as api:
        yield api


@pytest.fixture
async def loading_api(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    async with loading(settings) as api:
        yield api


@pytest.fixture
async def metrics_api(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """The same, with a metrics key."""
    async with loading(settings.with_(metrics_key=METRICS_KEY)) as api:
        yield api


def backend_app(settings: Settings) -> kiln.App:
    """An App whose `image.generate` runs on the backend KILN_BACKEND names (the demo)."""
    app = kiln.App(settings=settings)
    backends.register(app)
    return app


def model_body(model: str, prompt: str = "a fox") -> dict[str, Any]:
    body = image_body(prompt)
    body["params"].update(model=model, steps=1, width=64, height=64, simulate={"step_ms": 0})
    return body


async def run_all(api: ApiUnderTest, bodies: list[dict[str, Any]]) -> None:
    answer = await api.client.post("/v1/tasks/batch", json={"tasks": bodies})
    assert answer.status_code == 200, answer.text
    ids = [item["task"]["id"] for item in answer.json()["items"]]
    assert len(ids) == len(bodies)
    for task_id in ids:
        assert (await api.kiln.wait(task_id, timeout_s=60)).status is Status.SUCCESS


async def worker_models(api: ApiUnderTest) -> set[str]:
    answer = await api.client.get("/v1/workers", headers=bearer(ADMIN_KEY))
    return {model for worker in answer.json()["workers"] for model in worker["models"]}


async def declared(api: ApiUnderTest, *models: str) -> None:
    """Wait for the workers' beats to say they hold ``models`` loaded."""

    async def held() -> bool:
        return set(models) <= await worker_models(api)

    await wait_until(held, timeout_s=15)


async def test_an_anonymous_scrape_with_keys_shows_no_tenant_series_or_names(
    loading_api: ApiUnderTest,
) -> None:
    # Given alice's task on a model she named, which the worker holds loaded
    await run_all(loading_api, [model_body(SECRET_MODEL)])
    await declared(loading_api, SECRET_MODEL)
    # When someone scrapes /metrics without a key
    text = await scrape_text(loading_api)
    # Then the operational series are there
    samples = parse(text)
    assert samples[("kiln_tasks", (("status", "SUCCESS"),))] == 1
    assert labelled(samples, "kiln_workers", "kind")[("image.generate",)] == 1
    # And no per-tenant family, no tenant's name, no model she typed
    names = {name for name, _ in samples}
    assert not {n for n in names if any(n.startswith(f) for f in TENANT_FAMILIES)}, names
    assert "alice" not in text and SECRET_MODEL not in text


@pytest.mark.parametrize("key", [ADMIN_KEY, METRICS_KEY], ids=["admin key", "metrics key"])
async def test_the_admin_key_and_the_metrics_key_see_the_tenant_series(
    metrics_api: ApiUnderTest, key: str
) -> None:
    # Given alice's task on a model the worker holds loaded
    await run_all(metrics_api, [model_body(SECRET_MODEL)])
    await declared(metrics_api, SECRET_MODEL)
    # When the scrape sends the admin key or the metrics key
    samples = await scrape(metrics_api, key)
    # Then it sees alice's GPU-seconds on her model, and the model loaded and its load
    gpu = labelled(samples, "kiln_gpu_seconds_total", "tenant", "kind", "model", "outcome")
    assert set(gpu) == {("alice", "image.generate", SECRET_MODEL, "success")}
    loaded = labelled(samples, "kiln_worker_models_loaded", "model")
    assert loaded == {(SECRET_MODEL,): 1}
    loads = labelled(samples, "kiln_model_load_seconds_count", "model")
    assert loads == {(SECRET_MODEL,): 1}


async def test_a_wrong_key_is_401_and_a_tenant_key_gets_the_operational_series(
    keyed_api: ApiUnderTest,
) -> None:
    # Given a failure of alice's task, counted by the store
    await keyed_api.kiln.engine.store.bump(FAILURES, "alice:boom")
    # When /metrics is asked with a key that is none of the configured ones, or another scheme
    for headers in (
        {"Authorization": "Bearer not-a-key-at-all"},
        {"Authorization": "Basic YWRtaW46YWRtaW4="},
        {"Authorization": "Bearer "},
    ):
        answer = await keyed_api.client.get("/metrics", headers=headers)
        # Then it is 401 in the envelope, and shows nothing
        assert_error(answer, 401, "unauthorized")
        assert answer.headers["www-authenticate"] == "Bearer"
    # And bob's key (a client sends its key everywhere) gets what a scrape without one gets
    bobs = parse(await scrape_text(keyed_api, BOB_KEY))
    assert ("kiln_failures_total", (("code", "boom"),)) in bobs
    assert not {name for name, _ in bobs if name.startswith(tuple(TENANT_FAMILIES))}


async def test_the_metrics_key_opens_metrics_alone(metrics_api: ApiUnderTest) -> None:
    assert_error(await metrics_api.client.get("/v1/tasks", headers=bearer(METRICS_KEY)),
                 401, "unauthorized")  # fmt: skip
    assert (await metrics_api.client.get("/metrics", headers=bearer(METRICS_KEY))).is_success


async def test_without_keys_a_scrape_shows_everything(api: ApiUnderTest) -> None:
    # When a scrape without a key reads /metrics of a server with no keys at all
    text = await scrape_text(api)
    # Then it gets the tenant families too (nothing is guarded when auth is off; a server
    # with no in-process worker has no model loads)
    types = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert {exposed(f) for f in TENANT_FAMILIES} - {"kiln_model_load_seconds"} <= types


async def test_a_hundred_model_names_add_a_bounded_number_of_series(
    loading_api: ApiUnderTest,
) -> None:
    # Given 100 tasks of alice, each naming a model of its own, run on a worker with no
    # memory limit
    models = [f"m-{n:03d}" for n in range(100)]
    await run_all(loading_api, [model_body(model, f"fox {model}") for model in models])
    await declared(loading_api, models[-1])  # the last one loaded is held: a beat said so
    # When the admin scrapes
    samples = await scrape(loading_api, ADMIN_KEY)
    # Then the worker holds a bounded number of them (KILN_MAX_LOADED_MODELS)
    limit = DEFAULT_MAX_MODELS  # KILN_MAX_LOADED_MODELS unset
    held = await worker_models(loading_api)
    assert 1 <= len(held) <= limit
    # And the GPU-seconds name only those by model; the other 90-odd count as `other`
    gpu = labelled(samples, "kiln_gpu_seconds_total", "tenant", "kind", "model", "outcome")
    assert {model for _, _, model, _ in gpu} == held | {"other"}
    assert len(gpu) <= limit + 1
    assert sum(gpu.values()) > 0
    # And so do the model series of the worker and its loads
    assert set(labelled(samples, "kiln_worker_models_loaded", "model")) == {(m,) for m in held}
    loads = labelled(samples, "kiln_model_load_seconds_count", "model")
    assert set(loads) <= {(m,) for m in held} | {("other",)} and sum(loads.values()) == 100


async def test_a_configured_model_keeps_its_own_series_when_no_worker_holds_it(
    settings: Settings,
) -> None:
    # Given a server listing `m-kept` in KILN_METRICS_MODELS, whose worker holds one model
    configured = settings.with_(metrics_models=("m-kept",), max_loaded_models=1)
    async with loading(configured) as api:
        # When tasks on m-kept, then m-gone, then m-last run (the last one stays loaded)
        for model in ("m-kept", "m-gone", "m-last"):
            await run_all(api, [model_body(model)])
        await declared(api, "m-last")
        samples = await scrape(api, ADMIN_KEY)
    # Then m-kept keeps its name, m-last is loaded, and m-gone counts as `other`
    gpu = labelled(samples, "kiln_gpu_seconds_total", "model")
    assert set(gpu) == {("m-kept",), ("m-last",), ("other",)}


async def test_failure_codes_past_the_most_frequent_are_other(api: ApiUnderTest) -> None:
    # Given failures under more codes than /metrics names (as a handler, or the demo's
    # simulate.fail_code, may say any), the first code the most frequent
    store = api.kiln.engine.store
    for _ in range(3):
        await store.bump(FAILURES, "default:code-most")
    for n in range(MAX_FAILURE_CODES + 9):
        await store.bump(FAILURES, f"default:code-{n:03d}")
    # When /metrics is scraped
    failures = labelled(await scrape(api), "kiln_failures_total", "code")
    # Then it names the most frequent codes, and sums the other ten as `other`
    assert len(failures) == MAX_FAILURE_CODES + 1
    assert failures[("code-most",)] == 3 and failures[("other",)] == 10
    assert sum(failures.values()) == 3 + MAX_FAILURE_CODES + 9


async def test_an_unknown_http_method_is_counted_as_other(api: ApiUnderTest) -> None:
    # Given requests with methods a client made up
    for method in ("BREW", "WHEN"):
        answer = await api.client.request(method, "/v1/tasks")
        assert answer.status_code == 405
    # When /metrics is scraped
    requests = labelled(await scrape(api), "kiln_api_requests_total", "method", "route", "status")
    # Then they are one series, `other`, not one per method
    methods = {method for method, _, _ in requests}
    assert "other" in methods and not {"BREW", "WHEN"} & methods


# the metrics key as a setting


def test_the_metrics_key_is_a_secret_kiln_settings_never_prints() -> None:
    result = CliRunner().invoke(cli, ["settings"], env={"KILN_METRICS_KEY": "m3trics-secret"})
    assert result.exit_code == 0
    assert "KILN_METRICS_KEY" in result.stdout and "m3trics-secret" not in result.stdout
    settings = Settings.from_env({"KILN_METRICS_KEY": "m3trics-secret"})
    assert settings.metrics_key == "m3trics-secret" and "m3trics-secret" not in repr(settings)
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({"KILN_METRICS_KEY": "two words"})
    assert refused.value.message.startswith("KILN_METRICS_KEY=(hidden): expected a key")


@pytest.mark.parametrize("same_as", ["admin", "tenant"])
def test_the_metrics_key_must_differ_from_the_other_keys(settings: Settings, same_as: str) -> None:
    key = ADMIN_KEY if same_as == "admin" else ALICE_KEY
    with pytest.raises(ValueError, match="KILN_METRICS_KEY must differ"):
        create_app(kiln.App(settings=with_keys(settings).with_(metrics_key=key)))
