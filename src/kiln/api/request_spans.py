"""The API's request spans (OpenTelemetry, KILN_TRACING): one ``SERVER`` span per HTTP
request, a child of the request's ``traceparent`` (or the root of a new trace), current
while the request runs, so a task it submits keeps its context (kiln.tracing)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.tracing import Tracing


class RequestSpans:
    """ASGI middleware: the request's span, named by method and route template."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope.get("headers", [])
            if name.lower() in (b"traceparent", b"tracestate")
        }
        with self.tracing.request_span(scope["method"], scope["path"], headers) as span:

            async def send_seen(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.status = int(message["status"])
                await send(message)

            try:
                await self.app(scope, receive, send_seen)
            finally:
                span.route = getattr(scope.get("route"), "path", None)
