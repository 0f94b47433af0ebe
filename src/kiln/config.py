"""Settings: the only code that reads ``KILN_*`` environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.errors import InvalidRequest

RESERVED_TENANTS = frozenset({"admin"})
OUTPUT_URL_MODES = ("proxy", "presigned")
MAX_PRESIGN_TTL_S = 7 * 24 * 3600.0  # the longest S3 signature version 4 allows
DIFFUSERS_DEVICES = ("auto", "cpu", "cuda")


def parse_retention(raw: str | None) -> dict[str, float]:
    """``tenant:seconds,tenant:seconds`` → {tenant: seconds}; 0 keeps a tenant's tasks."""
    found: dict[str, float] = {}
    for item in (raw or "").split(","):
        if not item.strip():
            continue
        tenant, sep, seconds = (part.strip() for part in item.partition(":"))
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not sep or not tenant or value < 0:
            raise InvalidRequest(f"KILN_RETENTION_TENANTS entry {item!r} is not tenant:seconds")
        found[tenant] = value
    return found


def parse_diffusers_device(raw: str | None) -> str:
    """KILN_DIFFUSERS_DEVICE: auto (cuda when torch sees a GPU, else cpu), cpu or cuda."""
    device = (raw or "auto").strip().lower()
    if device not in DIFFUSERS_DEVICES:
        raise InvalidRequest(f"KILN_DIFFUSERS_DEVICE must be auto, cpu or cuda, got {raw!r}")
    return device


def parse_preview_every(raw: str | None) -> int:
    """KILN_DIFFUSERS_PREVIEW_EVERY: denoising steps between previews, 0 for none."""
    if raw is None or raw.strip() == "":
        return 5
    try:
        steps = int(raw)
    except ValueError:
        steps = -1
    if steps < 0:
        raise InvalidRequest(f"KILN_DIFFUSERS_PREVIEW_EVERY must be 0 or more steps, got {raw!r}")
    return steps


def parse_api_keys(raw: str | None) -> dict[str, str]:
    """``tenant:key,tenant:key`` → {key: tenant}. The tenant name ``admin`` is reserved."""
    keys: dict[str, str] = {}
    if not raw:
        return keys
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, key = item.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not sep or not tenant or not key:
            raise InvalidRequest(f"KILN_API_KEYS entry {item!r} is not tenant:key")
        if tenant in RESERVED_TENANTS:
            raise InvalidRequest(f"KILN_API_KEYS may not use the reserved tenant {tenant!r}")
        if key in keys:
            raise InvalidRequest("KILN_API_KEYS lists the same key twice")
        keys[key] = tenant
    return keys


@dataclass(frozen=True, slots=True)
class Settings:
    data_dir: Path = Path("./kiln-data")
    database_url: str | None = None
    storage_url: str | None = None
    lease_ttl_s: float = 30.0
    supervisor_interval_s: float = 1.0
    api_keys: dict[str, str] = field(default_factory=dict)
    admin_key: str | None = None
    api_key: str | None = None
    retry_base_s: float = 1.0
    retry_max_s: float = 60.0
    cancel_grace_s: float = 10.0
    max_body_bytes: int = 1_048_576
    max_upload_bytes: int = 20_971_520
    max_image_pixels: int = 40_000_000
    metrics_port: int | None = None
    sqlite_synchronous: str = "NORMAL"
    log_format: str = "text"
    log_level: str = "INFO"
    output_urls: str = "proxy"
    #: Connections each process keeps open to PostgreSQL at most (KILN_DB_POOL_SIZE).
    db_pool_size: int = 10
    #: Final tasks are purged this long after they finished (None: kept forever).
    retention_s: float | None = None
    #: Per-tenant retention overrides, seconds (0: forever).
    retention_tenants: dict[str, float] = field(default_factory=dict)
    presign_ttl_s: float = 900.0
    #: What serves the `image.generate` kind: demo, openai-images or comfyui (KILN_BACKEND).
    backend: str = "demo"
    openai_base_url: str = "https://api.openai.com/v1"
    openai_api_key: str | None = field(default=None, repr=False)
    openai_model: str = "gpt-image-1"
    openai_timeout_s: float = 120.0
    comfyui_url: str = "http://127.0.0.1:8188"
    #: An API-format workflow JSON with {{prompt}}, {{seed}}, ... placeholders.
    comfyui_workflow: Path | None = None
    comfyui_timeout_s: float = 300.0
    #: A local diffusers pipeline folder (model_index.json beside its parts).
    diffusers_model_dir: Path | None = None
    #: auto (cuda when torch sees a GPU, else cpu), cpu or cuda.
    diffusers_device: str = "auto"
    #: Denoising steps between previews (0: none).
    diffusers_preview_every: int = 5

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'kiln.db').as_posix()}"

    @property
    def resolved_storage_url(self) -> str:
        if self.storage_url:
            return self.storage_url
        return (self.data_dir / "results").resolve().as_uri()

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys) or self.admin_key is not None

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ

        def num(name: str, default: float) -> float:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                value = float(raw)
            except ValueError:
                raise InvalidRequest(f"{name} must be a number, got {raw!r}") from None
            if value <= 0:
                raise InvalidRequest(f"{name} must be positive, got {raw!r}")
            return value

        metrics = env.get("KILN_METRICS_PORT")
        workflow = env.get("KILN_COMFYUI_WORKFLOW")
        model_dir = env.get("KILN_DIFFUSERS_MODEL_DIR")
        output_urls = (env.get("KILN_OUTPUT_URLS") or "proxy").lower()
        if output_urls not in OUTPUT_URL_MODES:
            raise InvalidRequest(
                f"KILN_OUTPUT_URLS must be 'proxy' or 'presigned', got {env['KILN_OUTPUT_URLS']!r}"
            )
        presign_ttl_s = num("KILN_PRESIGN_TTL_S", 900.0)
        if presign_ttl_s > MAX_PRESIGN_TTL_S:
            raise InvalidRequest(
                f"KILN_PRESIGN_TTL_S may be at most {MAX_PRESIGN_TTL_S:.0f} (7 days), "
                f"got {env['KILN_PRESIGN_TTL_S']!r}"
            )
        return cls(
            data_dir=Path(env.get("KILN_DATA_DIR") or "./kiln-data"),
            database_url=env.get("KILN_DATABASE_URL") or None,
            storage_url=env.get("KILN_STORAGE_URL") or None,
            lease_ttl_s=num("KILN_LEASE_TTL", 30.0),
            supervisor_interval_s=num("KILN_SUPERVISOR_INTERVAL", 1.0),
            api_keys=parse_api_keys(env.get("KILN_API_KEYS")),
            admin_key=env.get("KILN_ADMIN_KEY") or None,
            api_key=env.get("KILN_API_KEY") or None,
            retry_base_s=num("KILN_RETRY_BASE_S", 1.0),
            retry_max_s=num("KILN_RETRY_MAX_S", 60.0),
            cancel_grace_s=num("KILN_CANCEL_GRACE_S", 10.0),
            max_body_bytes=int(num("KILN_MAX_BODY_BYTES", 1_048_576)),
            max_upload_bytes=int(num("KILN_MAX_UPLOAD_BYTES", 20_971_520)),
            max_image_pixels=int(num("KILN_MAX_IMAGE_PIXELS", 40_000_000)),
            metrics_port=int(metrics) if metrics else None,
            sqlite_synchronous=(env.get("KILN_SQLITE_SYNCHRONOUS") or "NORMAL").upper(),
            log_format=(env.get("KILN_LOG_FORMAT") or "text").lower(),
            log_level=(env.get("KILN_LOG_LEVEL") or "INFO").upper(),
            output_urls=output_urls,
            presign_ttl_s=presign_ttl_s,
            db_pool_size=int(num("KILN_DB_POOL_SIZE", 10)),
            retention_s=num("KILN_RETENTION_S", 0.0) or None,
            retention_tenants=parse_retention(env.get("KILN_RETENTION_TENANTS")),
            backend=(env.get("KILN_BACKEND") or "demo").strip().lower(),
            openai_base_url=env.get("KILN_OPENAI_BASE_URL") or "https://api.openai.com/v1",
            openai_api_key=env.get("KILN_OPENAI_API_KEY") or None,
            openai_model=env.get("KILN_OPENAI_MODEL") or "gpt-image-1",
            openai_timeout_s=num("KILN_OPENAI_TIMEOUT_S", 120.0),
            comfyui_url=env.get("KILN_COMFYUI_URL") or "http://127.0.0.1:8188",
            comfyui_workflow=Path(workflow) if workflow else None,
            comfyui_timeout_s=num("KILN_COMFYUI_TIMEOUT_S", 300.0),
            diffusers_model_dir=Path(model_dir) if model_dir else None,
            diffusers_device=parse_diffusers_device(env.get("KILN_DIFFUSERS_DEVICE")),
            diffusers_preview_every=parse_preview_every(env.get("KILN_DIFFUSERS_PREVIEW_EVERY")),
        )
