"""The webhook rules that need no network: what a submission may ask for, which addresses
the guard refuses, which events a webhook wants, the signature and the retry schedule."""

from __future__ import annotations

import pytest

from kiln.config import Settings
from kiln.config_values import webhook_key
from kiln.errors import ConfigError, InvalidRequest
from kiln.models import TaskEvent
from kiln.states import Event, Status
from kiln.webhooks import (
    retry_delay_s,
    signature,
    signed_headers,
    standard_signature,
    verify,
    wants,
    webhook_spec,
)

REFUSED_URLS = [
    "http://127.0.0.1:8080/hook",
    "http://127.1/hook",
    "http://2130706433/hook",
    "http://0x7f000001/hook",
    "http://10.1.2.3/hook",
    "http://172.16.0.9/hook",
    "http://192.168.1.1/hook",
    "http://169.254.169.254/latest/meta-data",
    "http://100.64.0.1/hook",
    "http://0.0.0.0/hook",
    "http://224.0.0.1/hook",
    "http://240.0.0.1/hook",
    "http://[::1]:8080/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "http://[fe80::1]/hook",
    "http://[fd00::1]/hook",
    "http://localhost:8000/hook",
    "http://api.localhost/hook",
]


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_a_non_public_address_is_refused_at_submission(url: str) -> None:
    with pytest.raises(InvalidRequest, match="may not point at"):
        webhook_spec(url, None, allow_private=False)


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_allowing_private_addresses_lets_them_through(url: str) -> None:
    assert webhook_spec(url, None, allow_private=True) == {"url": url, "events": ["final"]}


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/kiln?token=abc",
        "http://93.184.216.34:8080/x",
        "https://[2606:4700::1111]/hook",
        "https://Bücher.example/hook",
    ],
)
def test_a_public_url_is_taken_as_given(url: str) -> None:
    assert webhook_spec(url, None, allow_private=False) == {"url": url, "events": ["final"]}


@pytest.mark.parametrize(
    ("url", "events", "message"),
    [
        ("ftp://hooks.example.com/x", None, "http or https"),
        ("hooks.example.com/x", None, "http or https"),
        ("http:///x", None, "http or https"),
        ("https://hooks.example.com/" + "a" * 2048, None, "longer than 2048"),
        ("http://exa mple.com/", None, "http or https"),
        ("http://[::1/", None, "not a valid URL"),
        ("https://hooks.example.com/", [], "non-empty list"),
        ("https://hooks.example.com/", ["finished"], "unknown webhook event 'finished'"),
        (None, ["final"], "needs a webhook_url"),
    ],
)
def test_a_bad_webhook_is_an_invalid_request(
    url: str | None, events: list[str] | None, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message) as raised:
        webhook_spec(url, events, allow_private=True)
    assert raised.value.details and raised.value.details[0]["loc"][0] == "body"


def test_event_names_are_kept_in_one_order_and_a_star_takes_all() -> None:
    url = "https://hooks.example.com/"
    spec = webhook_spec(url, ["uploaded", "claim", "claim", "final"], allow_private=False)
    assert spec == {"url": url, "events": ["claim", "final", "uploaded"]}
    assert webhook_spec(url, ["claim", "*"], allow_private=False) == {"url": url, "events": ["*"]}
    assert webhook_spec(None, None, allow_private=False) is None


def event(name: Event, target: Status, *, final: bool) -> TaskEvent:
    return TaskEvent(
        seq=7,
        id="tsk_1:3",
        task_id="tsk_1",
        tenant="t",
        event=name,
        from_status=Status.GENERATING,
        status=target,
        attempt=1,
        epoch=1,
        error=None,
        at=0.0,
        dwell_s=0.0,
        final=final,
    )


@pytest.mark.parametrize(
    ("events", "wanted"),
    [
        (["final"], {"uploaded-final"}),
        (["*"], {"generated", "fail-retried", "uploaded-final"}),
        (["generated", "fail"], {"generated", "fail-retried"}),
        (["claim"], set()),
    ],
)
def test_a_webhook_wants_the_events_it_names(events: list[str], wanted: set[str]) -> None:
    cases = {
        "generated": event(Event.GENERATED, Status.UPLOADING, final=False),
        "fail-retried": event(Event.FAIL, Status.FAILED, final=False),
        "uploaded-final": event(Event.UPLOADED, Status.SUCCESS, final=True),
    }
    webhook = {"url": "https://h.example/", "events": events}
    assert {name for name, e in cases.items() if wants(webhook, e)} == wanted
    assert not wants(None, cases["uploaded-final"])


def test_the_signature_covers_the_timestamp_and_the_exact_body() -> None:
    body = b'{"seq":1}'
    signed = signature("s3cret", 1_800_000_000, body)
    assert signed.startswith("v1=") and len(signed) == 3 + 64
    assert verify("s3cret", body, "1800000000", signed, now=1_800_000_100)
    assert not verify("s3cret", b'{"seq":2}', "1800000000", signed, now=1_800_000_100)
    assert not verify("s3cret", body, "1800000001", signed, now=1_800_000_100)
    assert not verify("s3cret", body, "not-a-number", signed, now=1_800_000_100)
    assert not verify("s3cret", body, "1800000000", signed, now=1_800_000_301)


#: The example of the Standard Webhooks reference libraries (their tests check it too).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_the_standard_signature_matches_the_specs_example() -> None:
    key = webhook_key(SPEC_SECRET)
    assert standard_signature(key, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE


def test_a_whsec_secret_is_a_base64_key_and_any_other_secret_its_own_bytes() -> None:
    assert webhook_key("whsec_c2VjcmV0") == b"secret"
    assert webhook_key("whsec_c2VjcmV0LQ") == b"secret-"  # padding is optional
    assert webhook_key("plain-secret") == b"plain-secret"
    assert webhook_key("whsec-not-the-prefix") == b"whsec-not-the-prefix"
    for bad in ("whsec_", "whsec_not base64!", "whsec_===="):
        with pytest.raises(ValueError, match="base64"):
            webhook_key(bad)


def test_a_bad_whsec_secret_is_refused_by_the_settings_without_showing_it() -> None:
    with pytest.raises(ConfigError, match="KILN_WEBHOOK_SECRET") as refused:
        Settings.from_env({"KILN_WEBHOOK_SECRET": "whsec_*s3cr3t-v4lue*"})
    assert "s3cr3t-v4lue" not in str(refused.value)
    assert Settings.from_env({"KILN_WEBHOOK_SECRET": SPEC_SECRET}).webhook_secret == SPEC_SECRET


def test_kilns_own_signature_is_unchanged_beside_the_standard_one() -> None:
    # Given a whsec_ secret: kiln's header keys with its text, the standard one with its key
    body = b'{"seq":1}'
    headers = signed_headers(SPEC_SECRET, "tsk_1:1", 1_800_000_000, body)
    assert headers["Kiln-Webhook-Signature"] == signature(SPEC_SECRET, 1_800_000_000, body)
    assert headers["webhook-signature"] == standard_signature(
        webhook_key(SPEC_SECRET), "tsk_1:1", 1_800_000_000, body
    )
    assert headers["Kiln-Webhook-Id"] == headers["webhook-id"] == "tsk_1:1"
    assert headers["Kiln-Webhook-Timestamp"] == headers["webhook-timestamp"] == "1800000000"
    # And without a secret nothing is signed, but the id and timestamp are still sent
    unsigned = signed_headers(None, "tsk_1:1", 1_800_000_000, body)
    assert set(unsigned) == {
        "Kiln-Webhook-Id", "Kiln-Webhook-Timestamp", "webhook-id", "webhook-timestamp",
    }  # fmt: skip


def test_the_retry_delay_doubles_up_to_its_cap() -> None:
    assert [retry_delay_s(n, 5.0, 3600.0, 1.0) for n in range(1, 8)] == [
        5,
        10,
        20,
        40,
        80,
        160,
        320,
    ]
    assert retry_delay_s(20, 5.0, 3600.0, 1.0) == 3600.0
    assert retry_delay_s(3, 5.0, 3600.0, 0.5) == 10.0


def test_the_webhook_settings_are_read_from_the_environment() -> None:
    settings = Settings.from_env(
        {
            "KILN_WEBHOOK_SECRET": "s",
            "KILN_WEBHOOK_MAX_ATTEMPTS": "4",
            "KILN_WEBHOOK_TIMEOUT_S": "2.5",
            "KILN_WEBHOOK_CONCURRENCY": "3",
            "KILN_WEBHOOK_RETRY_BASE_S": "1",
            "KILN_WEBHOOK_RETRY_MAX_S": "30",
            "KILN_WEBHOOK_ALLOW_PRIVATE": "1",
        }
    )
    assert (
        settings.webhook_secret,
        settings.webhook_max_attempts,
        settings.webhook_timeout_s,
        settings.webhook_concurrency,
        settings.webhook_retry_base_s,
        settings.webhook_retry_max_s,
        settings.webhook_allow_private,
    ) == ("s", 4, 2.5, 3, 1.0, 30.0, True)
    defaults = Settings.from_env({})
    assert (
        defaults.webhook_secret,
        defaults.webhook_max_attempts,
        defaults.webhook_allow_private,
    ) == (None, 8, False)
    assert "hidden-value" not in repr(Settings.from_env({"KILN_WEBHOOK_SECRET": "hidden-value"}))
    with pytest.raises(ConfigError, match="KILN_WEBHOOK_ALLOW_PRIVATE"):
        Settings.from_env({"KILN_WEBHOOK_ALLOW_PRIVATE": "maybe"})
