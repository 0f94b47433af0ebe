"""The API's documentation pages without a CDN: ``/docs`` (Swagger UI) and ``/redoc``
(ReDoc), their scripts and styles served by kiln under ``/docs/assets`` from the
``fastapi-offline`` package (MIT; it ships both bundles). FastAPI's own pages load them
from jsDelivr and Google Fonts, so they are blank on a machine without internet access.
Both pages carry a Content-Security-Policy that lets them load from kiln alone, so nothing
they do reaches another host (ReDoc's bundle shows Redocly's logo from cdn.redoc.ly: the
browser refuses it and ReDoc leaves the logo out). No page asks for a key: the
operations that need one say so (``Authorize``)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from starlette.requests import Request
from starlette.responses import HTMLResponse

ASSETS_PATH = "/docs/assets"
#: The package whose ``static/`` folder holds the bundles kiln serves.
ASSETS_PACKAGE = "fastapi_offline"
#: Swagger UI's settings beside FastAPI's defaults: no online validator badge (it would
#: send the document's URL to validator.swagger.io).
SWAGGER_UI_PARAMETERS = {"validatorUrl": None}

#: What the pages may load: kiln's own URLs, plus inline scripts and styles (FastAPI's
#: page starts Swagger UI inline; both bundles add styles), data: images and fonts, and
#: ReDoc's search worker (a blob:).
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
    "connect-src 'self'; frame-ancestors 'self'"
)

router = APIRouter(include_in_schema=False)


def assets_dir() -> Path:
    """The folder of ``swagger-ui-bundle.js``, ``swagger-ui.css``, ``redoc.standalone.js``
    and ``favicon.png``."""
    return Path(str(resources.files(ASSETS_PACKAGE) / "static"))


def _asset(request: Request, name: str) -> str:
    return f"{request.scope.get('root_path', '')}{ASSETS_PATH}/{name}"


def _openapi_url(request: Request) -> str:
    return f"{request.scope.get('root_path', '')}{request.app.openapi_url}"


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    page = get_swagger_ui_html(
        openapi_url=_openapi_url(request),
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=_asset(request, "swagger-ui-bundle.js"),
        swagger_css_url=_asset(request, "swagger-ui.css"),
        swagger_favicon_url=_asset(request, "favicon.png"),
        swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
    )
    return _local_only(page)


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    page = get_redoc_html(
        openapi_url=_openapi_url(request),
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=_asset(request, "redoc.standalone.js"),
        redoc_favicon_url=_asset(request, "favicon.png"),
        with_google_fonts=False,
    )
    return _local_only(page)


def _local_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    return page


def install(api: FastAPI) -> None:
    """Serve ``/docs``, ``/redoc`` and their assets on ``api`` (made with ``docs_url=None``
    and ``redoc_url=None``)."""
    api.include_router(router)
    api.mount(ASSETS_PATH, StaticFiles(directory=assets_dir()), name="docs-assets")
