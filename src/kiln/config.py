"""Settings: the only code that reads ``KILN_*`` environment variables."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.errors import InvalidRequest
from kiln.limits import (
    Rate,
    TenantLimit,
    parse_kind_resources,
    parse_pools,
    parse_tenant_limits,
)

RESERVED_TENANTS = frozenset({"admin"})
OUTPUT_URL_MODES = ("proxy", "presigned")
MAX_PRESIGN_TTL_S = 7 * 24 * 3600.0  # the longest S3 signature version 4 allows
DIFFUSERS_DEVICES = ("auto", "cpu", "cuda")
CLAIM_ORDERS = ("fifo", "fair")


def parse_claim_order(raw: str | None) -> str:
    """KILN_CLAIM_ORDER: fifo (priority, then ready time) or fair (tenants take turns)."""
    order = (raw or "fifo").strip().lower()
    if order not in CLAIM_ORDERS:
        raise InvalidRequest(f"KILN_CLAIM_ORDER must be fifo or fair, got {raw!r}")
    return order


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


BREAKER_POLICIES = ("pause", "fail_fast")


def parse_breaker_policy(raw: str | None) -> dict[str, str]:
    """KILN_BREAKER_POLICY ``kind=pause,kind=fail_fast`` → {kind: policy}; ``*`` names
    every kind not listed (unset: pause)."""
    found: dict[str, str] = {}
    for item in (raw or "").split(","):
        if not item.strip():
            continue
        kind, sep, policy = (part.strip() for part in item.partition("="))
        if not sep or not kind or policy.lower() not in BREAKER_POLICIES:
            raise InvalidRequest(
                f"KILN_BREAKER_POLICY entry {item!r} is not kind=pause or kind=fail_fast"
            )
        found[kind] = policy.lower()
    return found


def parse_number(
    name: str, raw: str | None, default: float, ok: Callable[[float], bool], what: str
) -> float:
    """A number setting: ``default`` when unset, else a float that passes ``ok``."""
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan  # fails every check below
    if not ok(value):
        raise InvalidRequest(f"{name} must be {what}, got {raw!r}")
    return value


def parse_unit_fraction(name: str, raw: str | None, default: float) -> float:
    """A fraction in (0, 1] (KILN_BREAKER_FAILURE_RATE)."""
    return parse_number(name, raw, default, lambda v: 0 < v <= 1,
                        "a fraction above 0 and at most 1")  # fmt: skip


RESULT_LOST_POLICIES = ("rerun", "fail")
FLAG_VALUES = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False, "": False}  # fmt: skip


def parse_seconds_or_off(name: str, raw: str | None, default: float) -> float:
    """A period in seconds where 0 turns the feature off (KILN_RECONCILE_INTERVAL_S)."""
    return parse_number(name, raw, default, lambda v: v >= 0, "0 (off) or a number of seconds")


def parse_flag(name: str, raw: str | None) -> bool:
    """1/true/yes/on or 0/false/no/off (unset: off)."""
    try:
        return FLAG_VALUES[(raw or "").strip().lower()]
    except KeyError:
        raise InvalidRequest(f"{name} must be 1 or 0, got {raw!r}") from None


def parse_result_lost_policy(raw: str | None) -> str:
    """KILN_RESULT_LOST_POLICY: rerun (the task runs again) or fail (FAILED result_lost)."""
    policy = (raw or "fail").strip().lower()
    if policy not in RESULT_LOST_POLICIES:
        raise InvalidRequest(f"KILN_RESULT_LOST_POLICY must be rerun or fail, got {raw!r}")
    return policy


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
    #: Retries per second across the cluster (KILN_RETRY_RATE; None: no cap).
    retry_rate: float | None = None
    #: Circuit breakers (kiln.breakers): open when at least this fraction of the calls...
    breaker_failure_rate: float = 0.5
    #: ...of the last ``breaker_window_s`` seconds failed, once there are this many calls;
    breaker_min_calls: int = 10
    breaker_window_s: float = 60.0
    #: stay open this long, then let one probe through (half-open).
    breaker_open_s: float = 30.0
    #: What a kind does while its dependency's breaker is open: pause or fail_fast.
    breaker_policy: dict[str, str] = field(default_factory=dict)
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
    #: Period of the leading supervisor's reconciliation pass (0: no pass).
    reconcile_interval_s: float = 86400.0
    #: An orphan object younger than this is kept.
    reconcile_grace_s: float = 3600.0
    #: Whether the supervisor's pass repairs (deletes old orphans, applies the policy).
    reconcile_repair: bool = False
    #: What a repair does to a SUCCESS task whose output is lost: rerun or fail.
    result_lost_policy: str = "fail"
    presign_ttl_s: float = 900.0
    #: Resource pools shared by every worker: capacity by name (KILN_POOLS).
    pools: dict[str, int] = field(default_factory=dict)
    #: Pool units each kind needs besides what its code declares (KILN_KIND_RESOURCES).
    kind_resources: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Submission rate of every tenant (KILN_TENANT_RATE), and per-tenant limits
    #: (KILN_TENANT_LIMITS: rate and running-task cap).
    tenant_rate: Rate | None = None
    tenant_running: int | None = None
    tenant_limits: dict[str, TenantLimit] = field(default_factory=dict)
    #: Seconds of waiting worth one priority point in the claim order (None: strict).
    priority_aging_s: float | None = None
    #: fifo (priority, then ready time) or fair (tenants take turns) (KILN_CLAIM_ORDER).
    claim_order: str = "fifo"
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
    #: Webhooks (kiln.webhooks): the HMAC-SHA256 signing secret (unset: unsigned).
    webhook_secret: str | None = field(default=None, repr=False)
    #: Attempts per delivery before it is marked failed.
    webhook_max_attempts: int = 8
    #: The whole of one delivery attempt (resolve, connect, send, answer), seconds.
    webhook_timeout_s: float = 10.0
    #: Deliveries in flight at once (per dispatching supervisor).
    webhook_concurrency: int = 16
    #: Backoff between attempts: base·2^(attempt-1), capped, times a jitter in [0.5, 1].
    webhook_retry_base_s: float = 5.0
    webhook_retry_max_s: float = 3600.0
    #: Allow webhooks to loopback, private, link-local and other non-public addresses.
    webhook_allow_private: bool = False

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

    def tenant_limit(self, tenant: str) -> TenantLimit:
        """The tenant's limits: its own entry of KILN_TENANT_LIMITS over the defaults."""
        own = self.tenant_limits.get(tenant) or TenantLimit()
        return TenantLimit(
            rate=own.rate if own.rate is not None else self.tenant_rate,
            running=own.running if own.running is not None else self.tenant_running,
        )

    def kind_needs(self, kind: str, declared: Mapping[str, int]) -> dict[str, int]:
        """What a kind takes: its code's ``resources`` with KILN_KIND_RESOURCES on top."""
        return {**declared, **self.kind_resources.get(kind, {})}

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
            retry_rate=num("KILN_RETRY_RATE", 0.0) or None,
            breaker_failure_rate=parse_unit_fraction(
                "KILN_BREAKER_FAILURE_RATE", env.get("KILN_BREAKER_FAILURE_RATE"), 0.5
            ),
            breaker_min_calls=int(num("KILN_BREAKER_MIN_CALLS", 10)),
            breaker_window_s=num("KILN_BREAKER_WINDOW_S", 60.0),
            breaker_open_s=num("KILN_BREAKER_OPEN_S", 30.0),
            breaker_policy=parse_breaker_policy(env.get("KILN_BREAKER_POLICY")),
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
            pools=parse_pools(env.get("KILN_POOLS")),
            kind_resources=parse_kind_resources(env.get("KILN_KIND_RESOURCES")),
            tenant_rate=(
                Rate.parse(env["KILN_TENANT_RATE"], name="KILN_TENANT_RATE")
                if env.get("KILN_TENANT_RATE")
                else None
            ),
            tenant_running=int(num("KILN_TENANT_RUNNING", 0)) or None,
            tenant_limits=parse_tenant_limits(env.get("KILN_TENANT_LIMITS")),
            priority_aging_s=num("KILN_PRIORITY_AGING_S", 0.0) or None,
            claim_order=parse_claim_order(env.get("KILN_CLAIM_ORDER")),
            db_pool_size=int(num("KILN_DB_POOL_SIZE", 10)),
            retention_s=num("KILN_RETENTION_S", 0.0) or None,
            retention_tenants=parse_retention(env.get("KILN_RETENTION_TENANTS")),
            reconcile_interval_s=parse_seconds_or_off(
                "KILN_RECONCILE_INTERVAL_S", env.get("KILN_RECONCILE_INTERVAL_S"), 86400.0
            ),
            reconcile_grace_s=parse_seconds_or_off(
                "KILN_RECONCILE_GRACE_S", env.get("KILN_RECONCILE_GRACE_S"), 3600.0
            ),
            reconcile_repair=parse_flag("KILN_RECONCILE_REPAIR", env.get("KILN_RECONCILE_REPAIR")),
            result_lost_policy=parse_result_lost_policy(env.get("KILN_RESULT_LOST_POLICY")),
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
            webhook_secret=env.get("KILN_WEBHOOK_SECRET") or None,
            webhook_max_attempts=int(num("KILN_WEBHOOK_MAX_ATTEMPTS", 8)),
            webhook_timeout_s=num("KILN_WEBHOOK_TIMEOUT_S", 10.0),
            webhook_concurrency=int(num("KILN_WEBHOOK_CONCURRENCY", 16)),
            webhook_retry_base_s=num("KILN_WEBHOOK_RETRY_BASE_S", 5.0),
            webhook_retry_max_s=num("KILN_WEBHOOK_RETRY_MAX_S", 3600.0),
            webhook_allow_private=parse_flag(
                "KILN_WEBHOOK_ALLOW_PRIVATE", env.get("KILN_WEBHOOK_ALLOW_PRIVATE")
            ),
        )
