"""/docs and /redoc load nothing from another host: their scripts and styles are served by
kiln under /docs/assets (the browser test renders them with every other host blocked)."""

from __future__ import annotations

import re

import pytest
from api_support import ApiUnderTest

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
