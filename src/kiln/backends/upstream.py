"""Calling an upstream service: breaker, deadline, latency histogram, error classification.

A backend wraps each generation it asks of an upstream in :meth:`Upstream.call`. What the
upstream does then decides the task's error and the breaker's verdict:

| the upstream                          | the attempt fails with          | breaker |
|---------------------------------------|---------------------------------|---------|
| answers 2xx with an image             | (success)                       | success |
| answers 429                           | Retryable `upstream_rate_limited` | failure |
| answers 408, 409 or 5xx               | Retryable `upstream_unavailable`  | failure |
| answers another 4xx (or 3xx)          | Permanent `upstream_rejected`     | success |
| cannot be reached, or times out       | Retryable `upstream_unavailable`  | failure |
| answers 2xx without a usable image    | Retryable `upstream_bad_response` | failure |
| is not called: the breaker is open    | Retryable `upstream_unavailable`  | —       |

A Retry-After (or OpenAI's retry-after-ms) on a retryable answer, and the rest of the
breaker's cool-down when it is open, become the error's ``retry_after_s``: the engine
schedules the next attempt no sooner than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import ssl
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Literal

import httpx

from kiln import tracing
from kiln.circuit import CircuitBreaker
from kiln.errors import Permanent, Retryable, TaskError

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from kiln.config import Settings

RATE_LIMITED = "upstream_rate_limited"
UNAVAILABLE = "upstream_unavailable"
REJECTED = "upstream_rejected"
BAD_RESPONSE = "upstream_bad_response"

Outcome = Literal["ok", "error", "rejected", "open"]

#: Connecting takes at most this long, whatever the backend's overall timeout.
CONNECT_TIMEOUT_S = 10.0
#: A Retry-After longer than this is read as this (the task's deadline still applies).
MAX_RETRY_AFTER_S = 3600.0
SECONDS_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
MESSAGE_CHARS = 500


class UpstreamMetrics:
    """This process's upstream readings, as a Prometheus collector.

    ``kiln_upstream_request_seconds{backend,outcome}``: one sample per generation asked of
    an upstream (outcome ok, error, rejected, or open when the breaker refused it), and
    ``kiln_upstream_breaker_open{backend}``: 1 from when that backend's breaker opens until
    a probe closes it again (open or half-open), read when scraped.

    With ``settings``, the breakers it makes follow the KILN_BREAKER_* settings (and a
    worker shares their state through the store, see :mod:`kiln.breakers`).
    """

    def __init__(self, settings: Settings | None = None) -> None:
        from prometheus_client import Histogram  # only processes that run backends need it

        self.settings = settings

        self.seconds = Histogram(
            "kiln_upstream_request_seconds",
            "Time a generation asked of an upstream service took, by outcome",
            ["backend", "outcome"],
            buckets=SECONDS_BUCKETS,
            registry=None,
        )
        self.breakers: dict[str, CircuitBreaker] = {}

    def new_breaker(self) -> CircuitBreaker:
        """A breaker for one more upstream: per the settings when given."""
        if self.settings is None:
            return CircuitBreaker()
        return CircuitBreaker.from_settings(self.settings)

    def observe(self, backend: str, outcome: Outcome, seconds: float) -> None:
        self.seconds.labels(backend, outcome).observe(seconds)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        yield from self.seconds.collect()
        gauge = GaugeMetricFamily(
            "kiln_upstream_breaker_open",
            "1 from when the backend's circuit breaker opens until a probe closes it",
            labels=["backend"],
        )
        for backend, breaker in sorted(self.breakers.items()):
            gauge.add_metric([backend], float(breaker.state != "closed"))
        yield gauge


class Upstream:
    """One upstream service as a backend calls it: its breaker, its metrics, its client."""

    def __init__(
        self,
        backend: str,
        metrics: UpstreamMetrics,
        breaker: CircuitBreaker | None = None,
        *,
        transport_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.breaker = breaker or metrics.new_breaker()
        self.transport_errors: tuple[type[BaseException], ...] = (
            httpx.TransportError,
            OSError,
            *transport_errors,
        )
        self._tls: ssl.SSLContext | None = None
        metrics.breakers[backend] = self.breaker

    def _client(self, timeout_s: float) -> httpx.AsyncClient:
        """A new HTTP client; the TLS context is built once (building one takes ~0.1 s)."""
        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))
        # The attempt's trace context (kiln.tracing; none when tracing is off).
        headers = tracing.outgoing_headers()
        return httpx.AsyncClient(timeout=timeout, verify=self._tls, headers=headers)

    @contextlib.asynccontextmanager
    async def call(self, *, timeout_s: float) -> AsyncIterator[httpx.AsyncClient]:
        """One generation asked of the upstream, within ``timeout_s`` overall, with an HTTP
        client of its own; Retryable at once, the upstream untouched, while the breaker is
        open."""
        permit = self.breaker.admit()
        if permit is None:
            self.metrics.observe(self.backend, "open", 0.0)
            wait_s = self.breaker.retry_after_s()
            raise Retryable(
                f"{self.backend}: the circuit breaker is open after repeated upstream "
                f"failures; the next probe goes out in {wait_s:.1f} s",
                code=UNAVAILABLE,
                retry_after_s=wait_s,
            )
        started = time.perf_counter()
        outcome: Outcome | None = None  # None: cancelled, no verdict
        try:
            # The client is made before the deadline starts: the first one builds TLS.
            async with self._client(timeout_s) as http, asyncio.timeout(timeout_s):
                yield http
            outcome = "ok"
        except TaskError as exc:
            outcome = "error" if exc.retryable else "rejected"
            raise
        except (TimeoutError, httpx.TimeoutException) as exc:
            outcome = "error"
            message = f"{self.backend} gave no answer within {timeout_s:g} s"
            raise Retryable(message, code=UNAVAILABLE) from exc
        except self.transport_errors as exc:
            outcome = "error"
            message = f"{self.backend} could not be reached: {type(exc).__name__}: {exc}"
            raise Retryable(message[:MESSAGE_CHARS], code=UNAVAILABLE) from exc
        except Exception:
            outcome = "error"
            raise
        finally:
            if outcome is None:
                self.breaker.release(permit)
            else:
                self.breaker.record(permit, ok=outcome in ("ok", "rejected"))
                self.metrics.observe(self.backend, outcome, time.perf_counter() - started)


def check_response(backend: str, response: httpx.Response) -> None:
    """Raise the classified error for an answer that is not 2xx (the body must be read)."""
    status = response.status_code
    if 200 <= status < 300:
        return
    detail = upstream_message(response)
    message = f"{backend} answered {status} {response.reason_phrase}: {detail}"[:MESSAGE_CHARS]
    wait_s = retry_after_s(response.headers)
    if status == 429 and _error_code(response) != "insufficient_quota":
        raise Retryable(message, code=RATE_LIMITED, retry_after_s=wait_s)
    if status in (408, 409) or status >= 500:
        raise Retryable(message, code=UNAVAILABLE, retry_after_s=wait_s)
    # Other 4xx: the request itself is refused (bad params, policy, key, unknown model);
    # an exhausted quota (429 insufficient_quota) will not pass by retrying either.
    raise Permanent(message, code=REJECTED)


def upstream_message(response: httpx.Response) -> str:
    """The upstream's own words: ``error.message`` (+ details) of a JSON body, else text."""
    try:
        body = response.json()
    except (ValueError, UnicodeDecodeError):
        return response.text.strip()[:MESSAGE_CHARS] or "(empty body)"
    error = body.get("error") if isinstance(body, dict) else None
    parts: list[str] = []
    if isinstance(error, dict):
        parts = [str(error[key]) for key in ("message", "details") if error.get(key)]
    elif isinstance(error, str) and error:
        parts = [error]
    parts += _node_errors(body)
    return "; ".join(parts) if parts else json.dumps(body)[:MESSAGE_CHARS]


def _node_errors(body: object) -> list[str]:
    """ComfyUI's ``node_errors``: ``{"<node id>": {"errors": [{"message", "details"}],
    "class_type"}}``, as ``node 4 (CheckpointLoaderSimple): <message>: <details>``."""
    found = body.get("node_errors") if isinstance(body, dict) else None
    lines = []
    for node_id, entry in (found or {}).items() if isinstance(found, dict) else []:
        for error in entry.get("errors", []) if isinstance(entry, dict) else []:
            words = [str(error[key]) for key in ("message", "details") if error.get(key)]
            lines.append(f"node {node_id} ({entry.get('class_type')}): {': '.join(words)}")
    return lines


def _error_code(response: httpx.Response) -> str | None:
    try:
        error = response.json().get("error")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The wait an answer asks for: ``retry-after-ms``, or ``Retry-After`` in seconds or as
    an HTTP date; None when absent or unreadable."""
    wait_s: float | None = None
    if raw_ms := headers.get("retry-after-ms"):
        with contextlib.suppress(ValueError):
            wait_s = float(raw_ms) / 1000
    raw = headers.get("retry-after")
    if wait_s is None and raw:
        try:
            wait_s = float(raw)
        except ValueError:
            with contextlib.suppress(TypeError, ValueError, IndexError):
                when = email.utils.parsedate_to_datetime(raw)
                wait_s = when.timestamp() - (time.time() if now is None else now)
    if wait_s is None or wait_s != wait_s:  # absent, or NaN
        return None
    return min(max(wait_s, 0.0), MAX_RETRY_AFTER_S)


def sniff(data: bytes) -> str | None:
    """The image format of ``data`` from its first bytes: png, jpeg, webp, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def require_image(backend: str, data: bytes) -> bytes:
    """``data`` when it is a PNG, JPEG or WEBP image; else the upstream answered wrongly."""
    if sniff(data) is None:
        raise Retryable(
            f"{backend} answered without a PNG, JPEG or WEBP image ({len(data)} bytes)",
            code=BAD_RESPONSE,
        )
    return data
