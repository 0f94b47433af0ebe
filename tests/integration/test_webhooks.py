"""Webhooks end to end: real workers and supervisor, a real HTTP receiver on 127.0.0.1.

A delivery is signed and verifies, a failing receiver gets it again until it answers 2xx,
a hanging receiver holds up no transition, a dispatcher that dies and is replaced
neither loses nor repeats a delivery, and the address guard refuses after resolution.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

import kiln
from kiln import demo, retention
from kiln.app import running
from kiln.config import Settings
from kiln.states import Status
from kiln.store.outbox import DELIVERED, FAILED, WebhookDelivery
from kiln.webhooks import TOLERANCE_S, Dispatcher, verify
from services.postgres import PostgresServer

from .conftest import AdvancingClock, wait_for_status, wait_until
from .webhook_receiver import receiving

SECRET = "whsec-test-0123456789"
#: A secret in the Standard Webhooks form: ``whsec_`` and a base64 key (24 random bytes).
WHSEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def fast(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "width": 64, "height": 64, "steps": 2, "simulate": {"step_ms": 0}}


@pytest.fixture
def hook_settings(settings: Settings) -> Settings:
    """Receivers run on 127.0.0.1, so private addresses are allowed here."""
    return settings.with_(
        webhook_secret=SECRET,
        webhook_allow_private=True,
        webhook_retry_base_s=0.05,
        webhook_retry_max_s=0.2,
        webhook_timeout_s=5.0,
        webhook_concurrency=4,
    )


async def open_app(settings: Settings, clock: Callable[[], float] | None = None) -> kiln.App:
    app = kiln.App(settings=settings, clock=clock)
    demo.register(app)
    return await app.open()


@pytest.fixture
async def hook_app(hook_settings: Settings) -> AsyncIterator[kiln.App]:
    app = await open_app(hook_settings)
    try:
        yield app
    finally:
        await app.close()


async def deliveries_of(app: kiln.App, task_id: str) -> list[WebhookDelivery]:
    return await app.engine.store.outbox.deliveries(task_id=task_id)


async def wait_settled(
    app: kiln.App, task_id: str, count: int = 1, timeout_s: float = 30.0
) -> None:
    """Until the task has ``count`` deliveries and none of them is pending."""

    async def settled() -> bool:
        rows = await deliveries_of(app, task_id)
        return len(rows) == count and all(r.status in (DELIVERED, FAILED) for r in rows)

    await wait_until(settled, timeout_s=timeout_s, what=f"{count} settled deliveries")


async def test_a_finished_task_is_posted_once_signed_and_the_signature_verifies(
    hook_app: kiln.App,
) -> None:
    with receiving() as receiver:
        async with running(hook_app.worker(concurrency=1).run(), hook_app.supervisor().run()):
            # Given a task submitted with a webhook (final events, the default)
            submitted = await hook_app.submit(
                "image.generate", fast("a fox"), webhook_url=receiver.url
            )
            task_id = submitted.task.id
            # When it succeeds
            await wait_for_status(hook_app.engine.store, task_id, Status.SUCCESS, timeout_s=30)
            await wait_settled(hook_app, task_id)
        [request] = receiver.received
    # Then one POST came, for the final event, with the event and the task
    final = (await hook_app.engine.store.events(task_id=task_id))[-1]
    body = request.json()
    assert request.headers["kiln-webhook-id"] == final.id
    assert request.headers["content-type"] == "application/json"
    assert (body["seq"], body["event"], body["status"], body["final"]) == (
        final.seq, "uploaded", "SUCCESS", True,
    )  # fmt: skip
    assert body["task"]["id"] == task_id and body["task"]["status"] == "SUCCESS"
    assert body["task"]["webhook"] == {"url": receiver.url, "events": ["final"]}
    assert body["task"]["result"]["outputs"][0]["name"] == "image.png"
    # And the signature verifies the way docs/webhooks.md tells a receiver to check it
    stamp, signed = (
        request.headers["kiln-webhook-timestamp"],
        request.headers["kiln-webhook-signature"],
    )
    mac = hmac.new(SECRET.encode(), stamp.encode() + b"." + request.body, hashlib.sha256)
    assert hmac.compare_digest(signed, "v1=" + mac.hexdigest())
    assert abs(time.time() - int(stamp)) < 60
    assert verify(SECRET, request.body, stamp, signed, now=time.time())
    # But not for a tampered body, another secret, or once the replay window has passed
    tampered = request.body.replace(b'"SUCCESS"', b'"FAILED"', 1)
    assert tampered != request.body
    assert not verify(SECRET, tampered, stamp, signed, now=time.time())
    assert not verify("another-secret", request.body, stamp, signed, now=time.time())
    assert not verify(SECRET, request.body, stamp, signed, now=int(stamp) + TOLERANCE_S + 1)
    # And the delivery is kept as delivered
    [row] = await deliveries_of(hook_app, task_id)
    assert (row.status, row.attempts, row.response_status) == (DELIVERED, 1, 200)


@pytest.mark.parametrize(
    ("secret", "receiver_key"),
    [(WHSEC_SECRET, WHSEC_SECRET), (SECRET, SECRET.encode())],
    ids=["whsec", "plain"],
)
async def test_the_standard_webhooks_library_verifies_a_real_delivery(
    hook_settings: Settings, secret: str, receiver_key: str | bytes
) -> None:
    # Given kiln signing with a whsec_ secret (or a plain one, whose bytes are the key)
    app = await open_app(hook_settings.with_(webhook_secret=secret))
    try:
        with receiving() as receiver:
            async with running(app.worker(concurrency=1).run(), app.supervisor().run()):
                submitted = await app.submit(
                    "image.generate", fast("a fox"), webhook_url=receiver.url,
                    webhook_events=["submit", "final"],
                )  # fmt: skip
                task_id = submitted.task.id
                await wait_for_status(app.engine.store, task_id, Status.SUCCESS, timeout_s=30)
                await wait_settled(app, task_id, count=2)
            requests = list(receiver.received)
        event_ids = {
            event.seq: event.id for event in await app.engine.store.events(task_id=task_id)
        }
    finally:
        await app.close()
    # When the receiver checks each delivery with the standardwebhooks library
    assert len(requests) == 2
    receiver_side = Webhook(receiver_key)
    for request in requests:
        body = receiver_side.verify(request.body, request.headers)
        # Then it verifies, with the event id as webhook-id, and reads the event
        assert request.headers["webhook-id"] == request.headers["kiln-webhook-id"]
        assert request.headers["webhook-id"] == event_ids[body["seq"]]
        assert request.headers["webhook-timestamp"] == request.headers["kiln-webhook-timestamp"]
        assert body["task_id"] == task_id
        # And kiln's own signature, keyed with the secret's text, is still there and verifies
        stamp = request.headers["kiln-webhook-timestamp"]
        assert verify(secret, request.body, stamp, request.headers["kiln-webhook-signature"],
                      now=time.time())  # fmt: skip
    assert [r.json()["event"] for r in requests] == ["submit", "uploaded"]
    # But a tampered body, or another key, does not verify
    final = requests[-1]
    tampered = final.body.replace(b'"SUCCESS"', b'"FAILED"', 1)
    assert tampered != final.body
    with pytest.raises(WebhookVerificationError):
        receiver_side.verify(tampered, final.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(b"another key").verify(final.body, final.headers)


async def test_a_failing_receiver_gets_the_same_delivery_again_until_it_answers_2xx(
    hook_app: kiln.App,
) -> None:
    with receiving(500, 503) as receiver:
        async with running(hook_app.worker(concurrency=1).run(), hook_app.supervisor().run()):
            # Given a receiver that answers 500, then 503, then 200
            task = (
                await hook_app.submit("image.generate", fast("a fox"), webhook_url=receiver.url)
            ).task
            # When the task succeeds
            await wait_for_status(hook_app.engine.store, task.id, Status.SUCCESS, timeout_s=30)
            await wait_settled(hook_app, task.id)
        requests = list(receiver.received)
    # Then the same delivery was sent three times and is delivered
    assert len(requests) == 3
    assert len({r.headers["kiln-webhook-id"] for r in requests}) == 1
    assert len({r.body for r in requests}) == 1
    [row] = await deliveries_of(hook_app, task.id)
    assert (row.status, row.attempts, row.response_status) == (DELIVERED, 3, 200)
    counters = await hook_app.engine.store.counters()
    assert counters[("webhook_deliveries", "retrying")] == 2
    assert counters[("webhook_deliveries", "delivered")] == 1


@pytest.mark.parametrize(
    ("answers", "attempts", "why"),
    [((410,), 1, "410 Gone"), ((500, 500, 500), 3, "gave up")],
    ids=["gone", "out-of-attempts"],
)
async def test_a_delivery_fails_for_good_on_410_or_after_its_last_attempt(
    hook_settings: Settings, answers: tuple[int, ...], attempts: int, why: str
) -> None:
    app = await open_app(hook_settings.with_(webhook_max_attempts=3))
    try:
        with receiving(*answers, default=500) as receiver:
            async with running(app.worker(concurrency=1).run(), app.supervisor().run()):
                task = (await app.submit("image.generate", fast("a fox"),
                                         webhook_url=receiver.url)).task  # fmt: skip
                await wait_for_status(app.engine.store, task.id, Status.SUCCESS, timeout_s=30)
                await wait_settled(app, task.id)
            sent = len(receiver.received)
        [row] = await deliveries_of(app, task.id)
        assert (row.status, row.attempts, sent) == (FAILED, attempts, attempts), row.last_error
        assert row.last_error is not None and why in row.last_error
        assert await app.engine.store.outbox.pending() == 0
    finally:
        await app.close()


async def test_a_hanging_receiver_holds_up_no_transition(hook_settings: Settings) -> None:
    app = await open_app(hook_settings.with_(webhook_timeout_s=60.0, webhook_concurrency=2))
    try:
        with receiving() as receiver:
            receiver.hold()
            async with running(app.worker(concurrency=2).run(), app.supervisor().run()):
                # Given a receiver that answers nothing, and tasks that want every event
                ids = [
                    (await app.submit("image.generate", fast(f"fox {i}"),
                                      webhook_url=receiver.url, webhook_events=["*"])).task.id
                    for i in range(6)
                ]  # fmt: skip
                # Then every task still runs to SUCCESS while deliveries hang
                for task_id in ids:
                    await wait_for_status(app.engine.store, task_id, Status.SUCCESS, timeout_s=30)
                hanging = await receiver.wait_for(2)
                assert len(receiver.received) == 2  # the concurrency bound
                assert len({r.headers["kiln-webhook-id"].split(":")[0] for r in hanging}) == 2
                # When the receiver answers again, everything is delivered
                receiver.release()
                for task_id in ids:
                    await wait_settled(app, task_id, count=5, timeout_s=30)
            received = list(receiver.received)
        # Then each event came once, and each task's events in seq order
        assert len(received) == 30
        assert len({r.headers["kiln-webhook-id"] for r in received}) == 30
        for task_id in ids:
            seqs = [r.json()["seq"] for r in received if r.json()["task_id"] == task_id]
            events = [e.seq for e in await app.engine.store.events(task_id=task_id)]
            assert seqs == events
        rows = [r for task_id in ids for r in await deliveries_of(app, task_id)]
        assert {r.status for r in rows} == {DELIVERED}
    finally:
        await app.close()


# A dispatcher replaced by another ------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def database_settings(request: pytest.FixtureRequest, hook_settings: Settings) -> Settings:
    if request.param == "sqlite":
        return hook_settings
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return hook_settings.with_(database_url=server.new_database())


async def cancelled_with_webhook(app: kiln.App, url: str, prompt: str) -> str:
    """A task that ended CANCELLED (a final event) and wants its final event posted."""
    task = (await app.submit("image.generate", fast(prompt), webhook_url=url)).task
    await app.cancel(task.id)
    events = await app.engine.store.events(task_id=task.id)
    assert events[-1].final
    return events[-1].id


async def drain(dispatcher: Dispatcher) -> None:
    """Rounds of the dispatcher until nothing is pending and nothing is in flight."""

    async def settled() -> bool:
        await dispatcher.step()
        await asyncio.gather(*dispatcher.inflight.values())
        return await dispatcher.engine.store.outbox.pending() == 0

    await wait_until(settled, timeout_s=30, what="an empty outbox")


async def test_a_replaced_dispatcher_neither_loses_nor_repeats_a_delivery(
    database_settings: Settings, clock: AdvancingClock
) -> None:
    app = await open_app(database_settings, clock)
    killed = Dispatcher(app, owner="killed", interval_s=0.05, leader_ttl_s=2)
    successor = Dispatcher(app, owner="successor", interval_s=0.05, leader_ttl_s=2)
    try:
        with receiving() as receiver:
            # Given a dispatcher that queued three final events and died before sending
            expected = [await cancelled_with_webhook(app, receiver.url, f"a{i}") for i in range(3)]
            assert await killed.lead()
            await killed.enqueue()
            assert await app.engine.store.outbox.pending() == 3
            # And two more tasks that ended after it died
            expected += [await cancelled_with_webhook(app, receiver.url, f"b{i}") for i in range(2)]
            # When another one steps while the dead one's lease still holds, it does nothing
            assert await successor.step() is False and successor.token is None
            # When the lease lapsed and the other one runs until the outbox is empty
            clock.advance(3)
            await drain(successor)
            # Then every final event was sent exactly once
            ids = [r.headers["kiln-webhook-id"] for r in receiver.received]
            assert sorted(ids) == sorted(expected)
            # And more rounds queue and send nothing again
            await drain(successor)
            assert len(receiver.received) == 5
        rows = await app.engine.store.outbox.deliveries()
        assert sorted(r.event_id for r in rows) == sorted(expected)
        assert {(r.status, r.attempts) for r in rows} == {(DELIVERED, 1)}
    finally:
        await successor.close()
        await killed.close()
        await app.close()


# The address guard at delivery ---------------------------------------------------------


def resolver(table: dict[str, list[str]]) -> Callable[[str, int], Any]:
    async def resolve(host: str, port: int) -> list[str]:
        return table[host]

    return resolve


async def test_a_host_that_resolves_to_a_private_address_is_refused_and_not_retried(
    settings: Settings, clock: AdvancingClock
) -> None:
    # Given names that pass the check at submission but resolve to inner addresses (one
    # of them to a public and a loopback address, as a rebinding name might)
    app = await open_app(settings.with_(webhook_secret=SECRET), clock)
    names = {
        "hooks.example.com": ["10.0.0.7"],
        "rebind.example.com": ["93.184.216.34", "127.0.0.1"],
        "meta.example.com": ["169.254.169.254"],
        "six.example.com": ["::1"],
    }
    dispatcher = Dispatcher(app, owner="d", resolve=resolver(names))
    try:
        ids = {
            name: await cancelled_with_webhook(app, f"http://{name}/hook", name) for name in names
        }
        # When the dispatcher runs until the outbox is empty
        await drain(dispatcher)
        # Then each delivery failed once, refused, with the reason
        rows = {r.event_id: r for r in await app.engine.store.outbox.deliveries()}
        reasons = {name: rows[event_id].last_error for name, event_id in ids.items()}
        assert reasons == {
            "hooks.example.com": "hooks.example.com resolves to a private address (10.0.0.7)",
            "rebind.example.com": "rebind.example.com resolves to a loopback address (127.0.0.1)",
            "meta.example.com": "meta.example.com resolves to a link-local address "
            "(169.254.169.254)",
            "six.example.com": "six.example.com resolves to a loopback address (::1)",
        }
        assert {(r.status, r.attempts) for r in rows.values()} == {(FAILED, 1)}
        assert (await app.engine.store.counters())[("webhook_deliveries", "refused")] == 4
    finally:
        await dispatcher.close()
        await app.close()


async def test_the_request_goes_to_the_address_that_was_checked(
    hook_settings: Settings, clock: AdvancingClock
) -> None:
    app = await open_app(hook_settings, clock)
    with receiving() as receiver:
        # Given a name that resolves (once, when checked) to the receiver's address
        dispatcher = Dispatcher(app, owner="d", resolve=resolver({"receiver.test": ["127.0.0.1"]}))
        try:
            url = f"http://receiver.test:{receiver.port}/hooks/kiln"
            await cancelled_with_webhook(app, url, "pinned")
            # When it is delivered
            await drain(dispatcher)
            [request] = receiver.received
        finally:
            await dispatcher.close()
            await app.close()
    # Then the connection went to that address, asking for the name
    assert request.headers["host"] == f"receiver.test:{receiver.port}"


async def test_retention_purges_a_tasks_deliveries_with_it(
    hook_settings: Settings, clock: AdvancingClock
) -> None:
    app = await open_app(hook_settings, clock)
    dispatcher = Dispatcher(app, owner="d")
    try:
        with receiving() as receiver:
            # Given a finished task whose final event was delivered, and a newer one
            old = await cancelled_with_webhook(app, receiver.url, "old")
            clock.advance(100)
            new = await cancelled_with_webhook(app, receiver.url, "new")
            await drain(dispatcher)
        assert sorted(r.event_id for r in await app.engine.store.outbox.deliveries()) == sorted(
            [old, new]
        )
        # When retention keeps 50 seconds of finished tasks
        report = await retention.purge(
            app.engine.store, app.storage, retention.RetentionPolicy(default_s=50), clock()
        )
        # Then the old task went with its delivery, and the new one kept its own
        assert report.tasks == 1
        assert [r.event_id for r in await app.engine.store.outbox.deliveries()] == [new]
    finally:
        await dispatcher.close()
        await app.close()
