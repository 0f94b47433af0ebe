"""`kiln webhooks` and `kiln redeliver`, and the client's `webhooks` / `redeliver`, against a
real `kiln serve` process that delivers to a real receiver on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner, Result

import kiln
from integration.webhook_receiver import Receiver, receiving
from kiln import errors
from kiln.cli import cli

from .conftest import Processes, Server, wait_until

ALICE_KEY = "key-alice-0123456789"
ADMIN_KEY = "key-admin-0123456789"

runner = CliRunner()


@pytest.fixture(scope="module")
def hook_server(module_processes: Processes) -> Server:
    """`kiln serve` with keys, receivers on 127.0.0.1 allowed and fast webhook retries."""
    return module_processes.serve(
        module_processes.root / "data", "--workers", "1",
        KILN_API_KEYS=f"alice:{ALICE_KEY}", KILN_ADMIN_KEY=ADMIN_KEY,
        KILN_WEBHOOK_ALLOW_PRIVATE="1", KILN_WEBHOOK_SECRET="s3cret",
        KILN_WEBHOOK_RETRY_BASE_S="0.05", KILN_WEBHOOK_RETRY_MAX_S="0.1",
    )  # fmt: skip


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as found:
        yield found


def kiln_cli(server: Server, key: str, *args: str) -> Result:
    return runner.invoke(cli, [*args, "--server", server.url, "--api-key", key])


def delivered_task(server: Server, receiver: Receiver) -> str:
    """Alice's task whose final event reached the receiver."""
    params = {"prompt": f"a fox {uuid.uuid4().hex[:8]}", "width": 64, "height": 64,
              "steps": 2, "simulate": {"step_ms": 0}}  # fmt: skip
    with kiln.Client(server.url, api_key=ALICE_KEY) as client:
        task = client.submit(params=params, webhook_url=receiver.url)
        client.wait(task["id"], timeout_s=30)

        def settled() -> bool:
            items = client.webhooks(task["id"])["items"]
            return bool(items) and items[0]["status"] == "delivered"

        wait_until(settled, 30, "the delivery")
    return str(task["id"])


def test_kiln_webhooks_lists_a_tasks_deliveries(hook_server: Server, receiver: Receiver) -> None:
    task_id = delivered_task(hook_server, receiver)
    # When alice lists them, as a table and as JSON
    table = kiln_cli(hook_server, ALICE_KEY, "webhooks", task_id)
    as_json = kiln_cli(hook_server, ALICE_KEY, "webhooks", task_id, "--json")
    # Then the table shows the delivery's id, event, status and attempts
    assert table.exit_code == 0, table.output
    header, row = table.stdout.splitlines()
    assert header.split() == ["ID", "EVENT", "STATUS", "TRIES", "NEXT", "LAST", "ANSWER"]
    assert row.split() == [f"{task_id}:5", "uploaded", "delivered", "1", "-", "200"]
    assert max(len(line) for line in table.stdout.splitlines()) <= 80
    # And the JSON is the API's answer
    assert as_json.exit_code == 0, as_json.output
    [item] = json.loads(as_json.stdout)["items"]
    assert (item["id"], item["status"], item["last_response_status"]) == (
        f"{task_id}:5", "delivered", 200,
    )  # fmt: skip
    assert receiver.received[0].headers["webhook-id"] == item["id"]


def test_kiln_redeliver_is_for_the_admin_and_sends_the_same_id_again(
    hook_server: Server, receiver: Receiver
) -> None:
    task_id = delivered_task(hook_server, receiver)
    delivery_id = f"{task_id}:5"
    # When alice tries: refused as a usage/authentication error (exit 2), nothing sent
    refused = kiln_cli(hook_server, ALICE_KEY, "redeliver", task_id, delivery_id)
    assert refused.exit_code == 2 and "forbidden" in refused.stderr
    # And an unknown delivery is a refusal of the server (exit 1)
    unknown = kiln_cli(hook_server, ADMIN_KEY, "redeliver", task_id, f"{task_id}:99")
    assert unknown.exit_code == 1 and "not_found" in unknown.stderr
    assert len(receiver.received) == 1
    # When the admin redelivers
    done = kiln_cli(hook_server, ADMIN_KEY, "redeliver", task_id, delivery_id)
    # Then it says so, and the receiver gets the same webhook-id and body again
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == f"{delivery_id} pending (attempts so far: 1)"
    wait_until(lambda: len(receiver.received) == 2, 30, "the redelivery")
    first, again = receiver.received
    assert again.headers["webhook-id"] == first.headers["webhook-id"] == delivery_id
    assert again.body == first.body


def test_the_clients_list_and_redeliver(hook_server: Server, receiver: Receiver) -> None:
    task_id = delivered_task(hook_server, receiver)
    delivery_id = f"{task_id}:5"
    with kiln.Client(hook_server.url, api_key=ALICE_KEY) as alice:
        with pytest.raises(errors.Forbidden):
            alice.redeliver(task_id, delivery_id)
        with pytest.raises(errors.NotFound):
            alice.webhooks("tsk_00000000000000000000000000")

    async def as_admin() -> tuple[dict[str, object], dict[str, object]]:
        async with kiln.AsyncClient(hook_server.url, api_key=ADMIN_KEY) as admin:
            listed = await admin.webhooks(task_id)
            again = await admin.redeliver(task_id, delivery_id)
            return listed, again

    listed, again = asyncio.run(as_admin())
    assert [i["id"] for i in listed["items"]] == [delivery_id]  # type: ignore[index, union-attr]
    assert (again["id"], again["status"]) == (delivery_id, "pending")
    wait_until(lambda: len(receiver.received) == 2, 30, "the redelivery")
