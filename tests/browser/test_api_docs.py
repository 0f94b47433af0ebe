"""The API docs in Chromium with every host but 127.0.0.1 blocked: Swagger UI at /docs lists
the operations and ReDoc at /redoc renders, from the assets kiln serves itself."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Page, Route, expect

from .conftest import Server

pytestmark = pytest.mark.browser

LOCAL_HOSTS = {"127.0.0.1"}
#: The one outside URL ReDoc's bundle asks for (an <img> it hides when it fails).
REDOCLY_LOGO = "cdn.redoc.ly/redoc/logo-mini.svg"


@pytest.fixture
def offline(page: Page) -> list[str]:
    """Every request of the page to another host is aborted, and listed here."""
    blocked: list[str] = []

    def only_local(route: Route) -> None:
        url = route.request.url
        if urlsplit(url).hostname in LOCAL_HOSTS or url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            blocked.append(url)
            route.abort()

    page.route("**/*", only_local)
    return blocked


def test_swagger_ui_lists_the_operations_offline(
    page: Page, server: Server, offline: list[str], console_errors: list[str]
) -> None:
    # When /docs opens with no other host reachable
    page.goto(f"{server.url}/docs")
    # Then Swagger UI renders the document: the title and the operations, tasks included
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("kiln", timeout=15_000)
    operations = page.locator(".opblock")
    expect(operations.first).to_be_visible()
    assert operations.count() >= 10
    expect(
        page.locator('.opblock-summary-path[data-path="/v1/tasks/{task_id}/webhooks"]')
    ).to_be_visible()
    # And nothing was asked of another host, and nothing failed
    assert offline == []
    assert console_errors == []


def test_redoc_renders_offline(
    page: Page, server: Server, offline: list[str], console_errors: list[str]
) -> None:
    # When /redoc opens with no other host reachable
    page.goto(f"{server.url}/redoc")
    # Then ReDoc renders the document: its title and the operations in its menu
    expect(page.locator(".api-info h1")).to_contain_text("kiln", timeout=15_000)
    expect(page.get_by_role("menuitem").first).to_be_visible()
    expect(page.get_by_text("List tasks, newest first").first).to_be_attached()
    # And nothing was asked of another host: the page's policy kept ReDoc's bundle from
    # fetching Redocly's logo (the one refusal it reports), and nothing else failed
    assert offline == []
    assert [e for e in console_errors if REDOCLY_LOGO not in e] == []
