"""Settings.from_env: how output URLs are configured (KILN_OUTPUT_URLS, KILN_PRESIGN_TTL_S)."""

from __future__ import annotations

import pytest

import kiln
from kiln.api import create_app
from kiln.config import Settings
from kiln.errors import InvalidRequest


def test_outputs_are_proxied_for_fifteen_minutes_unless_configured() -> None:
    settings = Settings.from_env({})
    assert (settings.output_urls, settings.presign_ttl_s) == ("proxy", 900.0)


def test_presigned_outputs_and_their_lifetime_are_read_from_the_environment() -> None:
    settings = Settings.from_env({"KILN_OUTPUT_URLS": "Presigned", "KILN_PRESIGN_TTL_S": "60"})
    assert (settings.output_urls, settings.presign_ttl_s) == ("presigned", 60.0)


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"KILN_OUTPUT_URLS": "redirect"}, "KILN_OUTPUT_URLS must be 'proxy' or 'presigned'"),
        ({"KILN_PRESIGN_TTL_S": "0"}, "KILN_PRESIGN_TTL_S must be positive"),
        ({"KILN_PRESIGN_TTL_S": "soon"}, "KILN_PRESIGN_TTL_S must be a number"),
        ({"KILN_PRESIGN_TTL_S": "604801"}, "at most 604800"),
    ],
)
def test_bad_output_url_settings_are_refused_with_the_variable_named(
    env: dict[str, str], complaint: str
) -> None:
    with pytest.raises(InvalidRequest, match=complaint):
        Settings.from_env(env)


def test_the_api_refuses_to_start_with_an_unknown_output_url_mode(settings: Settings) -> None:
    with pytest.raises(ValueError, match="KILN_OUTPUT_URLS must be proxy or presigned"):
        create_app(kiln.App(settings=settings.with_(output_urls="redirect")))
