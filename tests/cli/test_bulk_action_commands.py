"""`kiln retry|cancel` by filter and the clients' retry_many/cancel_many, against a real
`kiln serve` (its workers run the tasks)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from typer.testing import CliRunner, Result

import kiln
from kiln.cli import cli
from kiln.client import Client

from .conftest import Server

runner = CliRunner()


def kiln_cli(server: Server, *args: str) -> Result:
    return runner.invoke(cli, [*args, "--server", server.url])


def failing(code: str, n: int) -> dict[str, Any]:
    """image.generate params whose every attempt fails with ``code`` (one attempt)."""
    return {"prompt": f"a failing fox {code} {n}", "steps": 1, "width": 64, "height": 64,
            "simulate": {"step_ms": 0, "permanent": True, "fail_code": code}}  # fmt: skip


def failed_tasks(server: Server, code: str, n: int) -> list[str]:
    with Client(server.url) as client:
        ids = [
            client.submit("image.generate", failing(code, i), max_attempts=1)["id"]
            for i in range(n)
        ]
        for task_id in ids:
            assert client.wait(task_id, timeout_s=30)["status"] == "FAILED"
    return ids


def test_retry_by_code_prints_each_page_and_the_totals(server: Server) -> None:
    # Given three tasks failed with a code no other test uses
    code = f"upstream_{uuid.uuid4().hex[:8]}"
    ids = failed_tasks(server, code, 3)
    by_code = ["retry", "--status", "FAILED", "--code", code, "--since", "1h"]
    # When a dry run counts them
    dry = kiln_cli(server, *by_code, "--dry-run")
    # Then it prints the count and changes nothing
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.strip() == "dry run: retry would act on 3 tasks"
    with Client(server.url) as client:
        assert all(client.get(i)["status"] == "FAILED" for i in ids)
    # When they are retried two a page
    done = kiln_cli(server, *by_code, "--limit", "2")
    # Then a line per page, then the totals
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines() == [
        "page 1: matched 2, retried 2, skipped 0",
        "page 2: matched 1, retried 1, skipped 0",
        "total: matched 3, retried 3, skipped 0",
    ]
    with Client(server.url) as client:
        for task_id in ids:
            task = client.wait(task_id, timeout_s=30)
            assert task["attempt"] == 2 and task["max_attempts"] == 2


def test_bad_filters_print_the_code_message_and_details(server: Server) -> None:
    refused = kiln_cli(server, "retry", "--status", "PENDING", "--code", "x")
    assert refused.exit_code == 2
    assert refused.stderr.startswith("kiln: invalid_request: ")
    assert "filter.status" in refused.stderr
    both = kiln_cli(server, "cancel", "tsk_01m8thpx95xqtw8rjn4g7jzyrc", "--kind", "image.generate")
    assert both.exit_code == 2 and "not both" in both.stderr
    neither = kiln_cli(server, "cancel")
    assert neither.exit_code == 2 and "--all" in neither.stderr
    late = kiln_cli(server, "cancel", "--kind", "image.generate", "--since", "last tuesday")
    assert late.exit_code == 2 and "created_after" in late.stderr


async def test_the_async_client_cancels_many_page_by_page(server: Server) -> None:
    # Given tasks delayed for an hour (PENDING, out of the workers' reach) with a kind's tag
    tag = uuid.uuid4().hex[:8]
    async with kiln.AsyncClient(server.url) as client:
        ids = [
            (await client.submit("image.generate", {"prompt": f"a late owl {tag} {i}"},
                                 delay_s=3600, metadata={"tag": tag}))["id"]
            for i in range(3)
        ]  # fmt: skip
        stamp = (await client.get(ids[0]))["created_at"]  # milliseconds, cut
        after = datetime.fromisoformat(stamp).timestamp() - 0.01
        found = {"status": ["PENDING"], "created_after": after}
        # When cancel_many goes through them one a page
        pages = [page async for page in client.cancel_many(found, limit=1)]
        # Then every page cancelled what it selected, and all three are CANCELLED
        cancelled = [i for page in pages for i in page["task_ids"]]
        assert set(ids) <= set(cancelled)
        assert all(page["cancelled"] == page["matched"] for page in pages)
        assert pages[-1]["cursor"] is None
        for task_id in ids:
            assert (await client.get(task_id))["status"] == "CANCELLED"
