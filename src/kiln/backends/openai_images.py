"""The `openai-images` backend: an OpenAI-compatible image generation endpoint.

Request (OpenAI Images API, "create image")::

    POST {KILN_OPENAI_BASE_URL}/images/generations
    Authorization: Bearer {KILN_OPENAI_API_KEY}        (left out when no key is set)
    {"model": "dall-e-3", "prompt": "...", "n": 1, "size": "1024x1024",
     "response_format": "b64_json"}

``response_format`` (``url`` or ``b64_json``) belongs to dall-e-2, dall-e-3 and most
OpenAI-compatible servers. The ``gpt-image-*`` models always answer in base64 and refuse
the field (400 "Unknown parameter: 'response_format'."), so for them it is left out and
``"output_format"`` (``png``, ``jpeg`` or ``webp``) asks for the task's format instead.

Answer, 200::

    {"created": 1713833628,
     "data": [{"b64_json": "<base64 of the image>", "revised_prompt": "..."}],
     "usage": {...}}

An item with ``url`` instead of ``b64_json`` (a server that ignored ``response_format``)
is fetched from that URL, without the API key.

Errors carry ``{"error": {"message": "...", "type": "invalid_request_error", "param":
"size", "code": null}}``: 400 for a bad request or a content-policy refusal, 401/403 for
the key, 404 for an unknown model, 429 for rate limits (``retry-after`` and
``retry-after-ms`` headers; ``"code": "insufficient_quota"`` when billing is the cause),
5xx for the service. :mod:`kiln.backends.upstream` classifies them.

The API takes no seed, steps or negative prompt, so they are not sent: another attempt
of the same task may give another picture. Progress is two stages without steps:
``request`` until the upstream starts answering, then ``download`` while the image comes.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from kiln.backends.upstream import (
    BAD_RESPONSE,
    Upstream,
    UpstreamMetrics,
    check_response,
    require_image,
)
from kiln.circuit import CircuitBreaker
from kiln.config import Settings
from kiln.demo import GenerateParams
from kiln.errors import Retryable

if TYPE_CHECKING:
    from kiln.worker import Context

NAME = "openai-images"


class OpenAIImagesBackend:
    name = NAME
    #: The GPU is the upstream's: only the worker's concurrency bounds the calls.
    resources: Mapping[str, int] = {}

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        timeout_s: float,
        upstream: Upstream,
        api_key: str | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/images/generations"
        self.model = model
        self.timeout_s = timeout_s
        self.upstream = upstream
        self._api_key = api_key

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        metrics: UpstreamMetrics,
        *,
        breaker: CircuitBreaker | None = None,
    ) -> OpenAIImagesBackend:
        return cls(
            base_url=settings.openai_base_url,
            model=settings.openai_model,
            timeout_s=settings.openai_timeout_s,
            upstream=Upstream(NAME, metrics, breaker),
            api_key=settings.openai_api_key,
        )

    def request_body(self, params: GenerateParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": params.prompt,
            "n": 1,
            "size": f"{params.width}x{params.height}",
        }
        if self.model.startswith("gpt-image"):
            body["output_format"] = params.format
        else:
            body["response_format"] = "b64_json"
        return body

    async def generate(self, ctx: Context, params: GenerateParams) -> bytes:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        async with self.upstream.call(timeout_s=self.timeout_s) as http:
            await ctx.progress(None, None, stage="request")
            request = http.build_request(
                "POST", self.url, json=self.request_body(params), headers=headers
            )
            response = await http.send(request, stream=True)
            try:
                if response.is_success:
                    await ctx.progress(None, None, stage="download")
                await response.aread()
            finally:
                await response.aclose()
            check_response(NAME, response)
            return await self._image(http, response)

    async def _image(self, http: httpx.AsyncClient, response: httpx.Response) -> bytes:
        """The image of the answer's first item: its base64, or the bytes at its URL."""
        try:
            item = json.loads(response.content)["data"][0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise Retryable(f"{NAME} answered without data[0]: {exc!r}", code=BAD_RESPONSE) from exc
        if isinstance(item, dict) and isinstance(item.get("b64_json"), str):
            try:
                data = base64.b64decode(item["b64_json"], validate=True)
            except (binascii.Error, ValueError) as exc:
                raise Retryable(f"{NAME} sent invalid base64: {exc}", code=BAD_RESPONSE) from exc
        elif isinstance(item, dict) and isinstance(item.get("url"), str):
            image = await http.get(item["url"])  # no Authorization: the key stays with the API
            check_response(NAME, image)
            data = image.content
        else:
            raise Retryable(f"{NAME} answered neither b64_json nor url", code=BAD_RESPONSE)
        return require_image(NAME, data)
