"""/docs and /redoc load nothing from another host: their scripts and styles are served by
kiln under /docs/assets (the browser test renders them with every other host blocked)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
from api_support import ApiUnderTest

from kiln import errors, webhooks
from kiln.api import errors as api_errors
from kiln.api import server_limits  # noqa: F401  (its RequestTimeout is an error class)
from kiln.states import TRANSITIONS, Event

ASSET = re.compile(r"""(?:src|href)=["']?([^"' >]+)""")


@pytest.mark.parametrize(
    ("page", "assets"),
    [
        ("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"}),
        ("/redoc", {"redoc.standalone.js", "favicon.png"}),
    ],
)
async def test_a_docs_page_loads_only_kilns_own_assets(
    keyed_api: ApiUnderTest, page: str, assets: set[str]
) -> None:
    # When a docs page is asked for, without a key (it needs none)
    response = await keyed_api.client.get(page, headers={"Authorization": ""})
    # Then it is HTML whose scripts and styles are all under /docs/assets
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    linked = ASSET.findall(response.text)
    assert {url.rsplit("/", 1)[-1] for url in linked} == assets
    assert all(url.startswith("/docs/assets/") for url in linked), linked
    assert "http://" not in response.text and "https://" not in response.text
    assert "/openapi.json" in response.text
    # And its policy lets the browser load from kiln alone
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "img-src 'self' data:" in policy
    # And each asset is served, without a key
    for url in linked:
        asset = await keyed_api.client.get(url, headers={"Authorization": ""})
        assert asset.status_code == 200, url
        assert len(asset.content) > 1000


async def test_the_docs_pages_are_not_in_the_openapi_document(keyed_api: ApiUnderTest) -> None:
    paths = (await keyed_api.client.get("/openapi.json")).json()["paths"]
    assert not [path for path in paths if path.startswith(("/docs", "/redoc"))]


# The contract's lists in the docs ----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _block(path: Path, begin: str, end: str) -> str:
    text = path.read_text()
    assert begin in text and end in text, f"{path.name} has no {begin} block"
    return text.split(begin, 1)[1].split(end, 1)[0]


def _first_cells(block: str) -> list[list[str]]:
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def _gen_docs() -> Any:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_webhook_docs_list_every_event_of_the_state_table() -> None:
    page = ROOT / "docs" / "webhooks.md"
    block = _block(page, "<!-- webhook-events:begin -->", "<!-- webhook-events:end -->")
    listed = [cells[0].strip("`") for cells in _first_cells(block)]
    # Every event of the table, once, in the table's order: what a webhook may ask for
    assert listed == [str(rule.event) for rule in TRANSITIONS]
    assert set(listed) == {str(event) for event in Event} == webhooks.EVENT_NAMES
    # And the block is what `make docs` writes from the table
    assert page.read_text().count(_gen_docs().webhook_events_block()) == 1


def _error_classes() -> set[type[errors.KilnError]]:
    found: set[type[errors.KilnError]] = set()
    todo: list[type[errors.KilnError]] = [errors.KilnError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_the_error_table_lists_every_code_the_api_answers() -> None:
    page = ROOT / "docs" / "errors.md"
    rows = _first_cells(_block(page, "<!-- error-codes:start -->", "<!-- error-codes:end -->"))
    documented = {cells[0].strip("`"): int(cells[1].split()[0]) for cells in rows}
    # The table is the API's codes, each with the status it is answered with
    assert len(documented) == len(rows)
    assert documented == api_errors.HTTP_STATUS
    # And every error class's code is in the table, or named as one the API answers
    # 500 internal_error (engine outcomes, settings), a task's own, or the client's
    text = page.read_text()
    class_codes = {cls.code for cls in _error_classes()}
    assert {"request_timeout", "conflict", "store_unavailable", "storage_error"} <= class_codes
    assert [code for code in class_codes if f"`{code}`" not in text] == []


def test_the_readme_links_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    pages = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
    assert {"errors.md", "typescript.md"} <= set(pages)
    assert [page for page in pages if f"](docs/{page})" not in readme] == []
