"""Findings of the security probe, each pinned by a test: blank keys, webhook addresses
that hide a private IPv4 address or name an impossible port, and redirects."""

from __future__ import annotations

from typing import Any

import pytest
from api_support import ADMIN_KEY, ALICE_KEY, ApiUnderTest, assert_error, image_body, make_kiln

from kiln.api import create_app
from kiln.api.auth import authenticate
from kiln.config import Settings
from kiln.errors import ConfigError, InvalidRequest, Unauthorized
from kiln.webhooks import webhook_spec

# Blank keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("blank", ["  ", "\t", " \u200b ", "\u200b", "key with space"])
def test_a_blank_or_spaced_admin_key_is_a_config_error(blank: str) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({"KILN_ADMIN_KEY": blank, "KILN_API_KEYS": "acme:k-0123456789"})
    assert refused.value.variable == "KILN_ADMIN_KEY"
    assert blank.strip() not in refused.value.message or not blank.strip()


def test_the_server_refuses_a_blank_admin_key_given_in_code(settings: Settings) -> None:
    with pytest.raises(ValueError, match="KILN_ADMIN_KEY"):
        create_app(make_kiln(settings), settings=settings.with_(admin_key="  "))


@pytest.mark.parametrize("token", ["", " ", "  ", "\t"])
def test_a_blank_token_never_authenticates(settings: Settings, token: str) -> None:
    keyed = settings.with_(api_keys={ALICE_KEY: "alice"}, admin_key=ADMIN_KEY)
    with pytest.raises(Unauthorized):
        authenticate(keyed, token)
    # Even against a (refused at startup) blank admin key
    with pytest.raises(Unauthorized):
        authenticate(settings.with_(admin_key="  "), token)


async def test_a_blank_access_token_is_401_on_streams(keyed_api: ApiUnderTest) -> None:
    response = await keyed_api.client.get(
        "/v1/events", params={"access_token": "  "}, headers={"Authorization": ""}
    )
    assert_error(response, 401, "unauthorized")


# Webhook URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://[2002:7f00:1::]/hook",  # 6to4 of 127.0.0.1
        "http://[2002:a00:1::1]/hook",  # 6to4 of 10.0.0.1
        "http://[64:ff9b::7f00:1]/hook",  # NAT64 of 127.0.0.1
        "http://[64:ff9b::a9fe:a9fe]/hook",  # NAT64 of 169.254.169.254
        "http://[64:ff9b:1::a00:1]/hook",  # local-use NAT64
        "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/hook",  # Teredo of 127.0.0.1
        "http://[::ffff:10.0.0.1]/hook",  # IPv4-mapped
        "http://[::ffff:7f00:1]/hook",  # IPv4-mapped, hex
        "http://[::127.0.0.1]/hook",  # IPv4-compatible
    ],
)
def test_ipv6_forms_of_a_private_ipv4_address_are_refused(url: str) -> None:
    with pytest.raises(InvalidRequest, match="KILN_WEBHOOK_ALLOW_PRIVATE") as refused:
        webhook_spec(url, None, allow_private=False)
    assert "may not point at" in refused.value.message
    assert webhook_spec(url, None, allow_private=True) is not None


@pytest.mark.parametrize("url", ["http://[2002:5db8:d822::1]/hook", "http://[::ffff:5db8:d822]/"])
def test_ipv6_forms_of_a_public_ipv4_address_are_taken(url: str) -> None:
    assert webhook_spec(url, None, allow_private=False) is not None


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com:99999/x",
        "https://hooks.example.com:65536/x",
        "https://hooks.example.com:0/x",
    ],
)
def test_a_webhook_port_out_of_range_is_refused(url: str) -> None:
    with pytest.raises(InvalidRequest, match="port"):
        webhook_spec(url, None, allow_private=True)


async def test_a_loopback_webhook_is_422_naming_the_setting(api: ApiUnderTest) -> None:
    body: dict[str, Any] = {**image_body(), "webhook_url": "http://127.0.0.1:9/hook"}
    error = assert_error(await api.submit(body), 422, "invalid_request")
    assert "KILN_WEBHOOK_ALLOW_PRIVATE" in error["message"]
    port = {**image_body(), "webhook_url": "https://hooks.example.com:99999/hook"}
    assert_error(await api.submit(port), 422, "invalid_request")
    assert await api.task_count() == 0


# Redirects -------------------------------------------------------------------------------


async def test_a_trailing_slash_is_not_redirected_to_a_host_the_client_named(
    api: ApiUnderTest,
) -> None:
    response = await api.client.get("/v1/tasks/", headers={"Host": "evil.example"})
    location = response.headers.get("location", "")
    assert "evil.example" not in location
    if response.status_code >= 400:
        assert_error(response, 404, "not_found")
    else:
        assert location.startswith("/")
