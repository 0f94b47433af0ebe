"""Who is calling: API keys to tenants, the admin key, and the no-auth single tenant.

Keys are compared in constant time against every configured key, whichever matches, so
the time an answer takes says nothing about the keys. Keys and access tokens are never
logged.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Query
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.base import SecurityBase
from starlette.requests import HTTPConnection, Request

from kiln.api.state import api_state
from kiln.app import DEFAULT_TENANT
from kiln.config import OUTPUT_URL_MODES, RESERVED_TENANTS, Settings
from kiln.config_values import key_refusal
from kiln.errors import Forbidden, Unauthorized

ADMIN_TENANT = "admin"

bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer <key>`")


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: the tenant its tasks belong to, and what it may see and do."""

    tenant: str
    admin: bool = False
    may_review: bool = False

    @property
    def scope(self) -> str | None:
        """The tenant whose tasks this caller sees; None for every tenant (the admin)."""
        return None if self.admin else self.tenant


def check_settings(settings: Settings) -> None:
    """Refuse a configuration the server must not start with."""
    reserved = RESERVED_TENANTS.intersection(settings.api_keys.values())
    if reserved:
        raise ValueError(f"KILN_API_KEYS may not use the reserved tenant {sorted(reserved)[0]!r}")
    if settings.admin_key is not None and settings.admin_key in settings.api_keys:
        raise ValueError("KILN_ADMIN_KEY must differ from every key in KILN_API_KEYS")
    if settings.admin_key is not None and key_refusal(settings.admin_key) is not None:
        raise ValueError(f"KILN_ADMIN_KEY is not usable: {key_refusal(settings.admin_key)}")
    metrics_key = settings.metrics_key
    if metrics_key is not None and (
        metrics_key in settings.api_keys or metrics_key == settings.admin_key
    ):
        raise ValueError("KILN_METRICS_KEY must differ from the admin key and every API key")
    if metrics_key is not None and key_refusal(metrics_key) is not None:
        raise ValueError(f"KILN_METRICS_KEY is not usable: {key_refusal(metrics_key)}")
    if any(key_refusal(key) is not None for key in settings.api_keys):
        raise ValueError("KILN_API_KEYS holds a key that is blank or holds spaces")
    if settings.output_urls not in OUTPUT_URL_MODES:
        modes = " or ".join(OUTPUT_URL_MODES)
        raise ValueError(f"KILN_OUTPUT_URLS must be {modes}, not {settings.output_urls!r}")


def authenticate(settings: Settings, key: str | None) -> Principal:
    """The principal a presented key stands for; Unauthorized when it stands for none."""
    if not settings.auth_enabled:
        return Principal(DEFAULT_TENANT, admin=False, may_review=True)
    if not key or not key.strip():  # a blank token never matches, whatever is configured
        raise Unauthorized("an API key is required: send Authorization: Bearer <key>")
    presented = key.encode()
    tenant: str | None = None
    admin = False
    for candidate, owner in settings.api_keys.items():
        if hmac.compare_digest(presented, candidate.encode()):
            tenant = owner
    if settings.admin_key is not None and hmac.compare_digest(
        presented, settings.admin_key.encode()
    ):
        tenant, admin = ADMIN_TENANT, True
    if tenant is None:
        raise Unauthorized("the API key is not valid")
    return Principal(tenant, admin=admin, may_review=admin)


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value, if it has one."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def _settings(connection: HTTPConnection) -> Settings:
    return api_state(connection).settings


class BearerPrincipal(SecurityBase):
    """The caller of a ``/v1`` request (Authorization header), as a dependency that is
    itself the ``HTTPBearer`` security scheme of the OpenAPI document: FastAPI solves one
    dependency per request for it, not a principal over a scheme (two)."""

    def __init__(self, scheme: HTTPBearer) -> None:
        self.scheme = scheme
        self.model = scheme.model
        self.scheme_name = scheme.scheme_name

    async def __call__(self, request: Request) -> Principal:
        credentials = await self.scheme(request)
        key = credentials.credentials if credentials is not None else None
        return authenticate(_settings(request), key)


require_principal = BearerPrincipal(bearer)


async def require_stream_principal(
    connection: HTTPConnection,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    access_token: Annotated[
        str | None,
        Query(
            description="The API key, for clients that cannot set headers (EventSource)",
            max_length=1024,
        ),
    ] = None,
) -> Principal:
    """The caller of a stream: the Authorization header, or ``?access_token=``."""
    key = credentials.credentials if credentials is not None else access_token
    return authenticate(_settings(connection), key)


def require_reviewer(principal: Principal) -> None:
    if not principal.may_review:
        raise Forbidden("only the admin key may review tasks")
