"""Webhooks: a task's status changes POSTed to a URL, through a durable outbox.

A submission may carry ``webhook_url`` (http or https) and ``webhook_events``: event names
of the state table, ``"final"`` (the event that ends the task in a final status: the
default) or ``"*"`` (every event). They are stored with the task (``task.webhook``).

Delivery never touches the transition path. The event log is the outbox's source: the
:class:`Dispatcher`, run by the supervisor process that holds the ``webhooks`` lease,
reads the events after its persisted cursor, turns those a task's webhook wants into
``webhook_deliveries`` rows and moves the cursor, in one transaction (one row per event
id, so a re-run adds nothing). It then POSTs the due rows, a bounded number at once and
one at a time per task, in seq order, signed with ``KILN_WEBHOOK_SECRET`` (kiln's own
``Kiln-Webhook-Signature`` and the Standard Webhooks ``webhook-signature``); a failed
attempt is retried with exponential backoff and jitter until ``KILN_WEBHOOK_MAX_ATTEMPTS``.

The SSRF guard refuses loopback, private, link-local, multicast, unspecified, reserved
and other non-public addresses: a literal one at submission, any the host resolves to at
delivery (the request then goes to the address that was checked, so a second lookup
cannot swap it), unless ``KILN_WEBHOOK_ALLOW_PRIVATE`` is set. See docs/webhooks.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import httpx

from kiln import tracing
from kiln.config_values import webhook_key
from kiln.engine import Engine, SupportsEngine, engine_of
from kiln.errors import InvalidRequest
from kiln.models import JSON, Task, TaskEvent, iso
from kiln.states import Event
from kiln.store import LeaderToken
from kiln.store.outbox import (
    DELIVERED,
    FAILED,
    PENDING,
    WebhookAttempt,
    WebhookDelivery,
)
from kiln.wire import task_json

log = logging.getLogger("kiln.webhooks")

LEADER = "webhooks"
ALL_EVENTS = "*"
FINAL_EVENTS = "final"
DEFAULT_EVENTS = (FINAL_EVENTS,)
EVENT_NAMES = frozenset(str(event) for event in Event)
SELECTORS = EVENT_NAMES | {ALL_EVENTS, FINAL_EVENTS}
MAX_URL_CHARS = 2048
#: Events read from the log per outbox transaction.
SCAN_PAGE = 500
#: How far a receiver should accept a timestamp from its own clock (docs/webhooks.md).
TOLERANCE_S = 300
ERROR_CHARS = 300
_HOSTNAME = re.compile(r"^[a-z0-9_.-]+$")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: ``resolve(host, port)``: the addresses a host name stands for.
Resolver = Callable[[str, int], Awaitable[list[str]]]


# Submission -----------------------------------------------------------------------------


def _invalid(field: str, message: str) -> InvalidRequest:
    detail = {"loc": ["body", field], "msg": message, "type": "value_error"}
    return InvalidRequest(message, details=[detail])


def webhook_spec(
    url: str | None, events: Sequence[str] | None, *, allow_private: bool
) -> JSON | None:
    """The task's ``webhook`` (``{"url", "events"}``, events canonical), or None without
    a URL; InvalidRequest for a bad URL or event name."""
    if url is None:
        if events is not None:
            raise _invalid("webhook_events", "webhook_events needs a webhook_url")
        return None
    check_url(url, allow_private=allow_private)
    return {"url": url, "events": _selectors(events)}


def _selectors(events: Sequence[str] | None) -> list[str]:
    if events is None:
        return list(DEFAULT_EVENTS)
    if isinstance(events, str) or not events:
        raise _invalid("webhook_events", "webhook_events must be a non-empty list of names")
    unknown = sorted({str(e) for e in events} - SELECTORS)
    if unknown:
        known = ", ".join(sorted(EVENT_NAMES))
        raise _invalid(
            "webhook_events",
            f"unknown webhook event {unknown[0]!r}: use {known}, 'final' or '*'",
        )
    return [ALL_EVENTS] if ALL_EVENTS in events else sorted(set(events))


def check_url(url: str, *, allow_private: bool) -> None:
    """Refuse what is wrong before any lookup: not http(s), too long, no host, a
    non-public literal address or a localhost name (unless private ones are allowed)."""
    if len(url) > MAX_URL_CHARS:
        raise _invalid("webhook_url", f"webhook_url is longer than {MAX_URL_CHARS} characters")
    try:
        parsed = httpx.URL(url)
        host = parsed.raw_host.decode("ascii")
    except (httpx.InvalidURL, UnicodeError):
        raise _invalid("webhook_url", "webhook_url is not a valid URL") from None
    if parsed.scheme not in ("http", "https") or not host or any(c.isspace() for c in url):
        raise _invalid("webhook_url", "webhook_url must be an http or https URL with a host")
    if ":" not in host and not _HOSTNAME.match(host.lower()):
        raise _invalid("webhook_url", "webhook_url has an invalid host name")
    port = _port_of(url)
    if port is not None and not 1 <= port <= 65535:
        raise _invalid("webhook_url", f"webhook_url has port {port}: a port is 1 to 65535")
    reason = host_refusal(host)
    if reason is not None and not allow_private:
        raise _invalid("webhook_url", f"webhook_url may not point at {reason}; {ALLOW_HINT}")


def _port_of(url: str) -> int | None:
    """The port a URL names, read from its text (a URL parser may refuse or wrap it)."""
    authority = url.split("://", 1)[-1].split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    host_port = authority.rsplit("@", 1)[-1]
    _, colon, port = host_port.rpartition(":")
    if not colon or "]" in port or not port.isdigit():
        return None
    return int(port)


def host_refusal(host: str) -> str | None:
    """Why a host is refused without a lookup: a localhost name, or a literal address
    (legacy IPv4 forms such as ``2130706433`` included) that is not public."""
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return "a loopback host name"
    try:
        address: IPAddress = ipaddress.ip_address(name)
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(name))
        except OSError:
            return None
    return address_refusal(address)


#: IPv6 prefixes whose last 32 bits are an IPv4 address: NAT64 (RFC 6052, RFC 8215).
NAT64_PREFIXES = (
    ipaddress.IPv6Network("64:ff9b::/96"),
    ipaddress.IPv6Network("64:ff9b:1::/48"),
)
#: What a refusal at submission adds: the setting that would allow the address.
ALLOW_HINT = "set KILN_WEBHOOK_ALLOW_PRIVATE=1 to allow it"


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries, if any: IPv4-mapped (``::ffff:a.b.c.d``),
    IPv4-compatible (``::a.b.c.d``), 6to4 (``2002::/16``), NAT64 or Teredo's client."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    last_32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if any(address in prefix for prefix in NAT64_PREFIXES):
        return last_32
    if int(address) >> 32 == 0 and int(address) > 1:  # ::a.b.c.d, deprecated
        return last_32
    return None


def address_refusal(address: IPAddress) -> str | None:
    """Why a webhook may not be sent to ``address``, or None for a public one. An IPv6
    address that carries an IPv4 address is judged by both."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        reason = None if inner is None else _own_refusal(inner)
        if reason is not None:
            return f"{reason} inside {address}"
        if inner is not None and address.ipv4_mapped is not None:
            return None  # ::ffff:a.b.c.d is that public IPv4 address
        if any(address in prefix for prefix in NAT64_PREFIXES[1:]):
            return f"a local-use NAT64 address ({address})"
    return _own_refusal(address)


def _own_refusal(address: IPAddress) -> str | None:
    checks = (
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("private", address.is_private),
        ("multicast", address.is_multicast),
        ("unspecified", address.is_unspecified),
        ("reserved", address.is_reserved),
        ("non-public", not address.is_global),
    )
    for kind, refused in checks:
        if refused:
            return f"a {kind} address ({address})"
    return None


# What is sent ---------------------------------------------------------------------------


def wants(webhook: JSON | None, event: TaskEvent) -> bool:
    """Whether a task's webhook asked for this event."""
    if not webhook:
        return False
    chosen = webhook.get("events") or DEFAULT_EVENTS
    return (
        ALL_EVENTS in chosen
        or str(event.event) in chosen
        or (FINAL_EVENTS in chosen and event.final)
    )


def payload(event: TaskEvent, task: Task) -> str:
    """The body: the event as the SSE stream sends it, plus the task as the API shows it."""
    body = {**event.to_json(), "task": task_json(task, queue_position=None)}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """``v1=<hex HMAC-SHA256 of "<timestamp>.<body>">``, keyed with the secret's UTF-8
    bytes as they are (a ``whsec_`` secret too: this header never decodes it)."""
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"v1={mac.hexdigest()}"


def standard_signature(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header of the Standard Webhooks spec:
    ``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`` (one signature: kiln signs
    with one key; a receiver reads the header as a space-separated list)."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    mac = hmac.new(key, signed, hashlib.sha256).digest()
    return f"v1,{base64.b64encode(mac).decode('ascii')}"


def signed_headers(
    secret: str | None, webhook_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """Every header that names or signs a delivery: kiln's own (``Kiln-Webhook-*``, as
    they always were) and the Standard Webhooks ones (``webhook-*``); no signature
    without a secret."""
    headers = {
        "Kiln-Webhook-Id": webhook_id,
        "Kiln-Webhook-Timestamp": str(timestamp),
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
    }
    if secret:
        headers["Kiln-Webhook-Signature"] = signature(secret, timestamp, body)
        headers["webhook-signature"] = standard_signature(
            webhook_key(secret), webhook_id, timestamp, body
        )
    return headers


def verify(
    secret: str,
    body: bytes,
    timestamp: str,
    signed: str,
    *,
    now: float,
    tolerance_s: float = TOLERANCE_S,
) -> bool:
    """What a receiver checks: the signature over these exact bytes, and a timestamp
    within ``tolerance_s`` of its clock (an old delivery replayed is refused)."""
    try:
        sent_at = int(timestamp)
    except ValueError:
        return False
    if abs(now - sent_at) > tolerance_s:
        return False
    return hmac.compare_digest(signature(secret, sent_at, body), signed.strip())


def retry_delay_s(attempts: int, base_s: float, max_s: float, jitter: float) -> float:
    """The wait after ``attempts`` failed attempts: base·2^(attempts-1), capped at
    ``max_s``, times ``jitter`` (drawn from [0.5, 1])."""
    return min(max_s, base_s * 2.0 ** min(attempts - 1, 40)) * jitter


def retry_after_s(response: httpx.Response) -> float | None:
    raw = response.headers.get("retry-after", "")
    return float(raw) if raw.strip().isdigit() else None


def delivery_json(delivery: WebhookDelivery) -> JSON:
    """A delivery as ``GET /v1/tasks/{id}/webhooks`` shows it: ``id`` (the event id: the
    ``webhook-id`` of every attempt) and how its attempts went; ``next_attempt_at`` only
    while it is pending. The body sent is not shown (it holds the task, which the caller
    can read)."""
    pending = delivery.status == PENDING
    return {
        "id": delivery.event_id,
        "event_id": delivery.event_id,
        "task_id": delivery.task_id,
        "seq": delivery.seq,
        "event": delivery.event,
        "url": delivery.url,
        "status": delivery.status,
        "attempts": delivery.attempts,
        "last_response_status": delivery.response_status,
        "last_error": delivery.last_error,
        "next_attempt_at": iso(delivery.next_attempt_at) if pending else None,
        "created_at": iso(delivery.created_at),
        "updated_at": iso(delivery.updated_at),
    }


# Where it goes --------------------------------------------------------------------------


class Refused(Exception):
    """The SSRF guard refused the webhook's address: the delivery fails for good."""


async def system_resolver(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def pinned_request(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    resolve: Resolver,
    *,
    allow_private: bool,
) -> httpx.Request:
    """The POST to ``url``, sent to an address of its host that passed the guard: the
    connection goes to that address, with the host's name in ``Host`` and TLS SNI."""
    parsed = httpx.URL(url)
    host = parsed.raw_host.decode("ascii")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        addresses = [str(ipaddress.ip_address(host))]
    except ValueError:
        addresses = await resolve(host, port)
    if not addresses:
        raise OSError(f"{host} has no address")
    for address in addresses:
        reason = address_refusal(ipaddress.ip_address(address.split("%", 1)[0]))
        if reason is not None and not allow_private:
            raise Refused(f"{host} resolves to {reason}")
    target = parsed.copy_with(host=addresses[0].split("%", 1)[0])
    sni = {"sni_hostname": host} if parsed.scheme == "https" else {}
    headers = {**headers, "Host": parsed.netloc.decode("ascii")}
    return client.build_request("POST", target, content=body, headers=headers, extensions=sni)


def _host(url: str) -> str:
    """The host of a URL, for logs (a URL may carry credentials)."""
    with contextlib.suppress(httpx.InvalidURL):
        return httpx.URL(url).host
    return "?"


# The dispatcher -------------------------------------------------------------------------


class Dispatcher:
    """Fills the outbox from the event log and delivers it (see the module docstring).

    ``run`` loops until cancelled; ``step`` is one round, for tests. Only the holder of
    the ``webhooks`` lease acts. ``resolve`` stands in for DNS in tests.
    """

    def __init__(
        self,
        engine: Engine | SupportsEngine,
        *,
        owner: str,
        interval_s: float | None = None,
        leader_ttl_s: float | None = None,
        resolve: Resolver | None = None,
    ) -> None:
        self.engine = engine = engine_of(engine)
        self.settings = engine.settings
        self.owner = owner
        self.interval_s = interval_s or engine.settings.supervisor_interval_s
        self.leader_ttl_s = leader_ttl_s or max(3 * self.interval_s, 3.0)
        self.resolve = resolve or system_resolver
        self.token: LeaderToken | None = None
        #: Deliveries being sent, by task id: at most one per task.
        self.inflight: dict[str, asyncio.Task[None]] = {}
        #: This process's attempts by outcome (the store counts every process's).
        self.outcomes: Counter[str] = Counter()
        self._client: httpx.AsyncClient | None = None
        self._woken: asyncio.Event | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self.settings.webhook_timeout_s,
                follow_redirects=False,
                trust_env=False,  # a proxy would connect to the host name, not the address
                # No connection is reused: one opened to an address for one host name (its
                # certificate checked against that name) never carries another host's request.
                limits=httpx.Limits(
                    max_connections=self.settings.webhook_concurrency, max_keepalive_connections=0
                ),
            )
        return self._client

    async def run(self) -> None:
        self._woken = asyncio.Event()
        try:
            while True:
                try:
                    more = await self.step()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("webhook_step_failed")
                    more = False
                if not more:
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a
                    # cancel that lands as the wait ends, and the loop would not stop.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.interval_s):
                            await self._woken.wait()
                self._woken.clear()
        finally:
            await self.close()

    async def close(self) -> None:
        running = list(self.inflight.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self.inflight.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def step(self) -> bool:
        """Lead, queue what the log holds, start what is due; True when more events wait."""
        for task_id, running in list(self.inflight.items()):
            if running.done():  # its outcome is recorded: the next due read sees it
                del self.inflight[task_id]
        if not await self.lead():
            return False
        more = await self.enqueue()
        await self.deliver_due()
        return more

    async def lead(self) -> bool:
        """Take or renew the ``webhooks`` lease; whether this dispatcher holds it."""
        now = self.engine.now()
        if self.token is None or now > self.token.expires_at - self.leader_ttl_s / 2:
            self.token = await self.engine.store.lead(LEADER, self.owner, self.leader_ttl_s)
        return self.token is not None

    async def enqueue(self) -> bool:
        """One page of the log into the outbox; True when the page was full."""
        store = self.engine.store
        scan = await store.outbox.scan(limit=SCAN_PAGE)
        if scan.last <= scan.cursor:
            return False
        now = self.engine.now()
        deliveries = [
            WebhookDelivery(
                event_id=event.id,
                seq=event.seq,
                task_id=task.id,
                tenant=task.tenant,
                event=str(event.event),
                url=str((task.webhook or {})["url"]),
                payload=payload(event, task),
                next_attempt_at=now,
                created_at=now,
                updated_at=now,
            )
            for event, task in scan.events
            if wants(task.webhook, event)
        ]
        added = await store.outbox.enqueue(deliveries, cursor=scan.last)
        if added:
            log.info("webhooks_queued", extra={"deliveries": added, "seq": scan.last})
        return scan.read >= SCAN_PAGE

    async def deliver_due(self) -> int:
        """Start the due deliveries there is room for; how many were started."""
        free = self.settings.webhook_concurrency - len(self.inflight)
        if free <= 0:
            return 0
        due = await self.engine.store.outbox.due(limit=free + len(self.inflight))
        started = 0
        for delivery in due:
            if started == free:
                break
            if delivery.task_id not in self.inflight:
                self.inflight[delivery.task_id] = asyncio.create_task(self._deliver(delivery))
                started += 1
        return started

    async def _deliver(self, delivery: WebhookDelivery) -> None:
        try:
            attempt = await self.attempt(delivery)
            await self.engine.store.outbox.record(attempt)
            self.outcomes[attempt.outcome] += 1
            _log_attempt(delivery, attempt)
        except asyncio.CancelledError:
            raise
        except Exception:  # the row stays pending: the next round tries again
            log.exception("webhook_record_failed", extra={"event_id": delivery.event_id})
        finally:
            if self._woken is not None:
                self._woken.set()

    async def attempt(self, delivery: WebhookDelivery) -> WebhookAttempt:
        """Send one delivery once and say what came of it (nothing is written here)."""
        timeout_s = self.settings.webhook_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                status, retry_after = await self._post(delivery)
        except Refused as exc:
            return WebhookAttempt(delivery.event_id, FAILED, "refused", error=str(exc))
        except TimeoutError:
            return self._failed_try(delivery, f"no answer within {timeout_s:g} s")
        except (httpx.HTTPError, OSError) as exc:
            return self._failed_try(delivery, f"{type(exc).__name__}: {exc}"[:ERROR_CHARS])
        if 200 <= status < 300:
            return WebhookAttempt(delivery.event_id, DELIVERED, "delivered", response_status=status)
        if status == 410:
            why = "the receiver answered 410 Gone: not sent again"
            return WebhookAttempt(
                delivery.event_id, FAILED, "failed", error=why, response_status=status
            )
        why = f"the receiver answered {status}"
        return self._failed_try(delivery, why, status, retry_after)

    async def _post(self, delivery: WebhookDelivery) -> tuple[int, float | None]:
        body = delivery.payload.encode("utf-8")
        sent_at = int(self.engine.now())
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "kiln-webhooks",
            **signed_headers(self.settings.webhook_secret, delivery.event_id, sent_at, body),
        }
        span = await self._span(delivery)
        if span is not None:  # tracing on: the receiver's spans join the task's trace
            headers.update(tracing.headers_of(span))
        request = await pinned_request(
            self.client,
            delivery.url,
            body,
            headers,
            self.resolve,
            allow_private=self.settings.webhook_allow_private,
        )
        started = self.engine.now()
        response = await self.client.send(request, stream=True)
        await response.aclose()  # the status is the answer; the body is not read
        if span is not None and self.engine.tracing is not None:
            attributes = {**span.attributes, "http.response.status_code": response.status_code}
            error = f"answered {response.status_code}" if response.status_code >= 400 else None
            ended = self.engine.now()
            sent = replace(span, start=started, end=ended, attributes=attributes, error=error)
            self.engine.tracing.emit([sent])
        return response.status_code, retry_after_s(response)

    async def _span(self, delivery: WebhookDelivery) -> tracing.SpanPlan | None:
        """The delivery attempt's span (kiln.tracing), or None when tracing is off."""
        if self.engine.tracing is None:
            return None
        stored = await self.engine.store.trace(delivery.task_id)
        return tracing.webhook_span(
            delivery.task_id, stored, delivery.event_id, delivery.attempts + 1
        )

    def _failed_try(
        self,
        delivery: WebhookDelivery,
        why: str,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> WebhookAttempt:
        settings = self.settings
        attempts = delivery.attempts + 1
        limit = settings.webhook_max_attempts
        if attempts >= limit:  # past the limit only after a redelivery: one more attempt
            done = f"of {limit}" if attempts == limit else f"past the {limit} allowed"
            why = f"{why} (attempt {attempts} {done}: gave up)"
            return WebhookAttempt(
                delivery.event_id, FAILED, "failed", error=why, response_status=status
            )
        delay_s = retry_delay_s(
            attempts,
            settings.webhook_retry_base_s,
            settings.webhook_retry_max_s,
            self.engine.rng.uniform(0.5, 1.0),
        )
        if retry_after is not None:
            delay_s = max(delay_s, min(retry_after, settings.webhook_retry_max_s))
        return WebhookAttempt(
            delivery.event_id,
            PENDING,
            "retrying",
            next_attempt_at=self.engine.now() + delay_s,
            error=why,
            response_status=status,
        )


def _log_attempt(delivery: WebhookDelivery, attempt: WebhookAttempt) -> None:
    extra: dict[str, Any] = {
        "task_id": delivery.task_id,
        "event_id": delivery.event_id,
        "host": _host(delivery.url),
        "attempt": delivery.attempts + 1,
        "outcome": attempt.outcome,
        "status": attempt.response_status,
    }
    if attempt.outcome == "delivered":
        log.info("webhook_delivered", extra=extra)
    else:
        log.warning("webhook_not_delivered", extra={**extra, "error": attempt.error})
