"""Settings: the only code that reads ``KILN_*`` environment variables.

One declarative table, :data:`VARIABLES`, lists every variable: its name, the
:class:`Settings` field it sets, how its text is parsed (and what it should look like),
its unit, a help line and the older name it replaces, if any. :meth:`Settings.from_env`,
the command line's options and help, ``kiln settings`` and the configuration docs are all
derived from it. Defaults are the :class:`Settings` field defaults.

A value kiln cannot use raises :class:`~kiln.errors.ConfigError` naming the variable, the
value and what it should be. A variable set under its older name still works and logs one
deprecation line on the ``kiln.config`` logger.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kiln import config_values as values
from kiln.config_values import (
    BREAKER_POLICIES,
    CLAIM_ORDERS,
    DIFFUSERS_DEVICES,
    FLAG_VALUES,
    MAX_PRESIGN_TTL_S,
    OUTPUT_URL_MODES,
    RESERVED_TENANTS,
    RESULT_LOST_POLICIES,
    MemoryRule,
    Parser,
    parse_api_keys,
    parse_breaker_policy,
    parse_retention,
)
from kiln.errors import ConfigError, KilnError
from kiln.limits import Rate, TenantLimit

log = logging.getLogger("kiln.config")


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a kiln process is configured with; :data:`VARIABLES` documents each field."""

    data_dir: Path = Path("./kiln-data")
    database_url: str | None = None
    storage_url: str | None = None
    lease_ttl_s: float = 30.0
    supervisor_interval_s: float = 1.0
    api_keys: dict[str, str] = field(default_factory=dict)
    admin_key: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    retry_base_s: float = 1.0
    retry_max_s: float = 60.0
    retry_rate: float | None = None
    breaker_failure_rate: float = 0.5
    breaker_min_calls: int = 10
    breaker_window_s: float = 60.0
    breaker_open_s: float = 30.0
    breaker_policy: dict[str, str] = field(default_factory=dict)
    cancel_grace_s: float = 10.0
    max_body_bytes: int = 1_048_576
    max_upload_bytes: int = 20_971_520
    max_image_pixels: int = 40_000_000
    bulk_page_rows: int = 2000
    max_header_bytes: int = 32_768
    max_connections: int = 1000
    access_log: bool = False
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    metrics_port: int | None = None
    metrics_key: str | None = field(default=None, repr=False)
    metrics_models: tuple[str, ...] = ()
    sqlite_synchronous: str = "FULL"
    sqlite_submit_process: str = "auto"
    log_format: str = "text"
    log_level: str = "INFO"
    tracing: str = "auto"
    output_urls: str = "proxy"
    db_pool_size: int = 10
    retention_s: float | None = None
    retention_tenants: dict[str, float] = field(default_factory=dict)
    idempotency_ttl_s: float | None = None
    reconcile_interval_s: float = 86400.0
    reconcile_grace_s: float = 3600.0
    reconcile_repair: bool = False
    result_lost_policy: str = "fail"
    presign_ttl_s: float = 900.0
    pools: dict[str, int] = field(default_factory=dict)
    kind_resources: dict[str, dict[str, int]] = field(default_factory=dict)
    tenant_rate: Rate | None = None
    tenant_running: int | None = None
    tenant_limits: dict[str, TenantLimit] = field(default_factory=dict)
    max_tasks_per_request: int = 1000
    max_schedules_per_tenant: int = 100
    priority_aging_s: float | None = None
    claim_order: str = "fifo"
    affinity_wait_s: float = 5.0
    model_memory_gb: float | None = None
    max_loaded_models: int = 8
    generate_memory: MemoryRule | None = None
    generate_batch: tuple[int, float] | None = None
    preempt_after_s: float | None = None
    demo_model_load_s: float = 1.0
    backend: str = "demo"
    openai_base_url: str = "https://api.openai.com/v1"
    openai_api_key: str | None = field(default=None, repr=False)
    openai_model: str = "gpt-image-1"
    openai_timeout_s: float = 120.0
    comfyui_url: str = "http://127.0.0.1:8188"
    comfyui_workflow: Path | None = None
    comfyui_timeout_s: float = 300.0
    diffusers_model_dir: Path | None = None
    diffusers_device: str = "auto"
    diffusers_preview_every: int = 5
    webhook_secret: str | None = field(default=None, repr=False)
    webhook_max_attempts: int = 8
    webhook_timeout_s: float = 10.0
    webhook_concurrency: int = 16
    webhook_retry_base_s: float = 5.0
    webhook_retry_max_s: float = 3600.0
    webhook_allow_private: bool = False
    # The processes' own options (kiln serve / worker / supervisor and the client commands).
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 2
    worker_processes: int | None = None
    no_workers: bool = False
    no_supervisor: bool = False
    insecure: bool = False
    concurrency: int = 2
    kinds: tuple[str, ...] | None = None
    gpus: int = 1
    metrics_host: str = "127.0.0.1"
    shutdown_grace_s: float = 30.0
    startup_timeout_s: float = 30.0
    gc_threshold: int = 20_000
    server: str = "http://127.0.0.1:8000"

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
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, only: Iterable[str] | None = None
    ) -> Settings:
        """Settings from ``environ`` (default ``os.environ``) through :data:`VARIABLES`.

        ``only`` names the fields to read (the client commands read two); the others keep
        their defaults. Raises ConfigError for the first unusable value.
        """
        env = os.environ if environ is None else environ
        wanted = None if only is None else set(only)
        read: dict[str, Any] = {
            var.field: var.read(env) for var in VARIABLES if wanted is None or var.field in wanted
        }
        return cls(**read)


_FIELDS = {f.name: f for f in fields(Settings)}


def otel_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``OTEL_*`` variables (default: of ``os.environ``). The OpenTelemetry SDK reads
    them itself; kiln reads them only to decide whether tracing is on (kiln.tracing)."""
    env = os.environ if environ is None else environ
    return {name: value for name, value in env.items() if name.startswith("OTEL_")}


@dataclass(frozen=True, slots=True)
class Variable:
    """One row of the table: a ``KILN_*`` variable and the Settings field it sets."""

    name: str
    field: str
    parse: Parser
    help: str
    group: str
    unit: str = ""
    #: The older name this variable replaces; still read, with a deprecation line.
    old: str | None = None
    #: The default as the docs say it, when the field's own default does not say it well.
    shown: str | None = None
    #: Never printed: ``kiln settings`` shows whether it is set, errors hide the value.
    secret: bool = False
    #: A value of blanks is unset (most variables), or refused by the parser (keys).
    blank_unset: bool = True

    @property
    def default(self) -> object:
        """The Settings field's default."""
        spec = _FIELDS[self.field]
        if spec.default_factory is not MISSING:
            return spec.default_factory()
        return spec.default

    @property
    def default_text(self) -> str:
        return self.shown if self.shown is not None else values.text_of(self.default)

    def lookup(self, env: Mapping[str, str]) -> tuple[str, str] | None:
        """(the name it was found under, its text), or None when unset or empty."""
        raw = env.get(self.name)
        if raw is not None and (raw.strip() or (raw and not self.blank_unset)):
            return self.name, raw
        if self.old is None:
            return None
        raw = env.get(self.old)
        if raw is None or not raw.strip():
            return None
        log.warning("%s is deprecated: set %s instead", self.old, self.name)
        return self.old, raw

    def read(self, env: Mapping[str, str]) -> object:
        """The parsed value in ``env``, else the default; ConfigError when unusable."""
        found = self.lookup(env)
        if found is None:
            return self.default
        name, raw = found
        try:
            return self.parse(raw)
        except (ValueError, KilnError) as exc:
            raise self.refusal(name, raw, str(exc)) from None

    def refusal(self, name: str, raw: str, reason: str = "") -> ConfigError:
        """The ConfigError for ``raw`` set under ``name``: one line, a secret's value hidden
        (its parser's reasons never repeat it)."""
        shown = "(hidden)" if self.secret else repr(raw)
        line = f"{name}={shown}: expected {self.parse.expected}"
        if reason:
            line += f" ({reason})"
        return ConfigError(line, variable=name)

    def shown_value(self, value: object) -> str:
        """``value`` as ``kiln settings`` prints it: secrets and URL passwords hidden."""
        if self.secret:
            return "(set)" if value else "unset"
        text = values.text_of(value)
        return _hide_password(text) if "://" in text else text


def _hide_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _v(name: str, field_name: str, parse: Parser, help_text: str, **extra: Any) -> Variable:
    """One row of the table (a shorthand that keeps the rows short)."""
    return Variable(name, field_name, parse, help_text, **extra)


SECONDS = values.number("a number of seconds", above=0)
SECONDS_OR_OFF = values.number("a number of seconds", least=0, note="0: off")
SECONDS_OR_ZERO = values.number("a number of seconds", least=0)
COUNT = values.number("a whole number", least=1, whole=True)
COUNT_OR_ZERO = values.number("a whole number", least=0, whole=True)


def _count_or_auto(raw: str) -> int | None:
    if raw.strip().lower() == "auto":
        return None
    value = COUNT_OR_ZERO(raw)
    assert isinstance(value, int)
    return value


COUNT_OR_AUTO = values.Parser("auto or a whole number >= 0", _count_or_auto)
PORT = values.port()
TEXT = values.text()
SECRET = values.text()
WEBHOOK_SECRET = values.webhook_secret()
KEY = values.key()
PATH = values.path()
FLAG = values.flag()

DATA = "Data"
PROCESSES = "Processes"
CLIENT = "Client commands"
API = "API"
RETRIES = "Leases and retries"
BREAKERS = "Circuit breakers"
LIMITS = "Pools and tenants"
RETENTION = "Retention and reconciliation"
SCHEDULING = "GPU scheduling"
BACKENDS = "Backends"
WEBHOOKS = "Webhooks"
SERVER = "HTTP server"

#: Every KILN_* variable kiln reads, grouped as the docs show them.
#: Kept unformatted (see the closing line): one packed entry per variable reads as a table and
#: keeps the module under 700 lines; ruff format would spread each entry over five or more.
VARIABLES: tuple[Variable, ...] = (
    _v("KILN_DATA_DIR", "data_dir", PATH, "data directory: the database and the results "
       "live here unless their URLs are set", group=DATA, shown="`./kiln-data`"),
    _v("KILN_DATABASE_URL", "database_url", TEXT, "`sqlite:///path/kiln.db` or "
       "`postgresql://user:password@host:5432/db`", group=DATA,
       shown="SQLite at `<data-dir>/kiln.db`"),
    _v("KILN_STORAGE_URL", "storage_url", TEXT, "`file:///path` or "
       "`s3://bucket/prefix?endpoint_url=...` (credentials from `AWS_ACCESS_KEY_ID`, "
       "`AWS_SECRET_ACCESS_KEY`, `AWS_REGION`)", group=DATA, shown="`<data-dir>/results`"),
    _v("KILN_DB_POOL_SIZE", "db_pool_size", COUNT, "PostgreSQL connections each process "
       "keeps at most (plus one for LISTEN)", group=DATA, unit="connections"),
    _v("KILN_SQLITE_SYNCHRONOUS", "sqlite_synchronous",
       values.choice("OFF", "NORMAL", "FULL", "EXTRA", upper=True), "SQLite durability: "
       "`FULL` (an answered submission survives a power loss; group commit hides the fsync)"
       " or `NORMAL` (WAL-safe, may lose the last commits on power loss)", group=DATA),
    _v("KILN_SQLITE_SUBMIT_PROCESS", "sqlite_submit_process", values.choice("auto", "on",
       "off"), "`kiln serve` on SQLite writes plain submissions in a process of its own, "
       "off the API's interpreter lock; `auto`: on with two cores or more", group=DATA,
       shown="`auto`"),
    _v("KILN_HOST", "host", TEXT, "address `kiln serve` listens on (`--host`)",
       group=PROCESSES),
    _v("KILN_PORT", "port", PORT, "port `kiln serve` listens on (`--port`)",
       group=PROCESSES),
    _v("KILN_WORKERS", "workers", COUNT_OR_ZERO, "tasks `kiln serve` runs at once in its "
       "own process (`--workers`)", group=PROCESSES, unit="tasks"),
    _v("KILN_WORKER_PROCESSES", "worker_processes", COUNT_OR_AUTO, "`kiln worker` "
       "processes `kiln serve` starts beside itself, each running `KILN_WORKERS` tasks at "
       "once (`--worker-processes`); `auto`: one per CPU core beyond the first",
       group=PROCESSES, shown="`auto`"),
    _v("KILN_NO_WORKERS", "no_workers", FLAG, "`1`: `kiln serve` runs no workers, the API "
       "only (`--no-workers`)", group=PROCESSES),
    _v("KILN_NO_SUPERVISOR", "no_supervisor", FLAG, "`1`: no supervisor loop in `kiln serve`"
       "; run `kiln supervisor` processes instead (`--no-supervisor`)", group=PROCESSES),
    _v("KILN_INSECURE", "insecure", FLAG, "`1`: `kiln serve` may listen on a non-loopback "
       "address without API keys (`--insecure`)", group=PROCESSES),
    _v("KILN_CONCURRENCY", "concurrency", COUNT, "attempts `kiln worker` claims and runs at "
       "once (`--concurrency`)", group=PROCESSES, unit="tasks"),
    _v("KILN_KINDS", "kinds", values.names(), "comma-separated task kinds `kiln worker` "
       "claims (`--kinds`)", group=PROCESSES, shown="every registered kind"),
    _v("KILN_GPUS", "gpus", COUNT_OR_ZERO, "GPU slots of a `kiln serve` or `kiln worker` "
       "process (`--gpus`)", group=PROCESSES, unit="slots"),
    _v("KILN_METRICS_PORT", "metrics_port", PORT, "port of the Prometheus `/metrics` of "
       "`kiln worker` and `kiln supervisor` (`--metrics-port`)", group=PROCESSES,
       shown="unset (off)"),
    _v("KILN_METRICS_HOST", "metrics_host", TEXT, "address of that `/metrics` "
       "(`--metrics-host`)", group=PROCESSES),
    _v("KILN_METRICS_KEY", "metrics_key", KEY, "a key (`Authorization: Bearer`) that reads "
       "the API's whole `/metrics`, per-tenant series included, like the admin key; without "
       "either, a scrape gets the operational series only while auth is on", group=PROCESSES,
       secret=True, blank_unset=False),
    _v("KILN_METRICS_MODELS", "metrics_models", values.names(), "models that keep a `model` "
       "label of their own in the metrics even while no live worker holds them loaded (the "
       "others count as `other`)", group=PROCESSES, shown="unset (the loaded ones only)"),
    _v("KILN_SHUTDOWN_GRACE_S", "shutdown_grace_s", SECONDS_OR_ZERO, "on SIGTERM, how long "
       "`kiln serve` and `kiln worker` let running attempts finish before giving them back "
       "uncounted; keep it below the stop timeout (Kubernetes "
       "`terminationGracePeriodSeconds`, systemd `TimeoutStopSec`)", group=PROCESSES,
       unit="s"),
    _v("KILN_STARTUP_TIMEOUT_S", "startup_timeout_s", SECONDS, "how long `kiln serve`, "
       "`kiln worker` and `kiln supervisor` wait for the database and the storage to answer "
       "at startup before they exit 2", group=PROCESSES, unit="s"),
    _v("KILN_GC_THRESHOLD", "gc_threshold", COUNT_OR_ZERO, "allocations between Python's "
       "collections of young objects in `kiln serve`, `kiln worker` and `kiln supervisor`,"
       " whose startup objects are frozen out of collection (docs/deployment.md); `0`: "
       "Python's own collector settings", group=PROCESSES, unit="objects"),
    _v("KILN_LOG_FORMAT", "log_format", values.choice("text", "json"), "`text`, or `json`: "
       "one JSON object per line, one line per transition", group=PROCESSES),
    _v("KILN_LOG_LEVEL", "log_level",
       values.choice("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", upper=True),
       "the lowest level logged", group=PROCESSES),
    _v("KILN_TRACING", "tracing", values.choice("auto", "on", "off"), "OpenTelemetry "
       "traces (the `kiln[otel]` extra, docs/tracing.md): `auto` is on when an "
       "`OTEL_EXPORTER_OTLP_*ENDPOINT` or `OTEL_TRACES_EXPORTER` is set; `on` needs the "
       "extra; `OTEL_SDK_DISABLED=true` turns it off", group=PROCESSES),
    _v("KILN_SERVER", "server", TEXT, "the kiln API the client commands talk to "
       "(`--server`)", group=CLIENT),
    _v("KILN_API_KEY", "api_key", SECRET, "the key the client commands send "
       "(`--api-key`)", group=CLIENT, secret=True),
    _v("KILN_API_KEYS", "api_keys", values.structured(
       "tenant:key pairs, comma-separated, tenant not `admin`", parse_api_keys),
       "`tenant:key,tenant:key`; unset (and no admin key) means no auth and one tenant "
       "`default`", group=API, secret=True),
    _v("KILN_ADMIN_KEY", "admin_key", KEY, "key for admin endpoints; it may act on any "
       "tenant's task", group=API, secret=True, blank_unset=False),
    _v("KILN_MAX_BODY_BYTES", "max_body_bytes", COUNT, "largest JSON request body",
       group=API, unit="bytes"),
    _v("KILN_MAX_UPLOAD_BYTES", "max_upload_bytes", COUNT, "largest upload request",
       group=API, unit="bytes"),
    _v("KILN_MAX_IMAGE_PIXELS", "max_image_pixels", COUNT, "most pixels of an uploaded "
       "image, and of a contact sheet kiln draws", group=API, unit="pixels"),
    _v("KILN_OUTPUT_URLS", "output_urls", values.choice(*OUTPUT_URL_MODES), "`proxy`: the "
       "API sends an output's bytes; `presigned`: a 307 redirect to a presigned URL",
       group=API),
    _v("KILN_PRESIGN_TTL_S", "presign_ttl_s",
       values.number("a number of seconds", above=0, most=MAX_PRESIGN_TTL_S),
       "lifetime of a presigned output URL", group=API, unit="s"),
    _v("KILN_MAX_HEADER_BYTES", "max_header_bytes", COUNT, "largest request head (request "
       "line and headers) `kiln serve` reads; more is 431", group=SERVER, unit="bytes"),
    _v("KILN_MAX_CONNECTIONS", "max_connections", COUNT, "connections `kiln serve` holds at "
       "once (streams included); more are answered 503 and closed", group=SERVER,
       unit="connections"),
    _v("KILN_ACCESS_LOG", "access_log", FLAG, "`1`: `kiln serve` logs a line per request "
       "on the `uvicorn.access` logger (`?access_token=` redacted); off, requests are counted "
       "in `kiln_api_requests` by route and status", group=SERVER),
    _v("KILN_HEADER_TIMEOUT_S", "header_timeout_s", SECONDS, "time a client has to send a "
       "request head, from the connection or its first byte; then 408 and closed",
       group=SERVER, unit="s"),
    _v("KILN_BODY_TIMEOUT_S", "body_timeout_s", SECONDS, "time a client has to send a "
       "request body, from the end of its head; then 408, or closed when the body was "
       "answered unread", group=SERVER, unit="s"),
    _v("KILN_LEASE_TTL_S", "lease_ttl_s", SECONDS, "lease of a running attempt; workers "
       "renew it every min(TTL/3, 2 s)", group=RETRIES, unit="s", old="KILN_LEASE_TTL"),
    _v("KILN_SUPERVISOR_INTERVAL_S", "supervisor_interval_s", SECONDS, "sweep period of the "
       "supervisor (`kiln supervisor --interval-s`)", group=RETRIES, unit="s",
       old="KILN_SUPERVISOR_INTERVAL"),
    _v("KILN_CANCEL_GRACE_S", "cancel_grace_s", SECONDS, "time a running task has to honour "
       "a cancel before the supervisor forces it", group=RETRIES, unit="s"),
    _v("KILN_RETRY_BASE_S", "retry_base_s", SECONDS, "retry backoff: full jitter over "
       "base·2^(attempt-1)", group=RETRIES, unit="s"),
    _v("KILN_RETRY_MAX_S", "retry_max_s", SECONDS, "cap of the retry backoff",
       group=RETRIES, unit="s"),
    _v("KILN_RETRY_RATE_PER_S", "retry_rate", values.number("a number per second", above=0),
       "most retries per second across the cluster", group=RETRIES, unit="per s",
       old="KILN_RETRY_RATE", shown="unset (no cap)"),
    _v("KILN_BREAKER_FAILURE_RATE", "breaker_failure_rate",
       values.number("a fraction", above=0, most=1), "a circuit breaker opens when at "
       "least this fraction of the calls of its window failed", group=BREAKERS,
       unit="fraction"),
    _v("KILN_BREAKER_MIN_CALLS", "breaker_min_calls", COUNT, "...once there are this many "
       "calls in the window", group=BREAKERS, unit="calls"),
    _v("KILN_BREAKER_WINDOW_S", "breaker_window_s", SECONDS, "the window of calls a breaker "
       "judges", group=BREAKERS, unit="s"),
    _v("KILN_BREAKER_OPEN_S", "breaker_open_s", SECONDS, "how long an open breaker refuses "
       "calls before one probe goes through", group=BREAKERS, unit="s"),
    _v("KILN_BREAKER_POLICY", "breaker_policy", values.structured(
       "kind=pause or kind=fail_fast, comma-separated", parse_breaker_policy),
       "what a kind does while a breaker it depends on is open, `kind=pause,kind=fail_fast`"
       " (`*`: the kinds not listed)", group=BREAKERS, shown="every kind `pause`"),
    _v("KILN_POOLS", "pools", values.limits_parser(
       "name:capacity pairs, comma-separated", "pools"), "shared resource pools, "
       "`name:capacity,...`", group=LIMITS),
    _v("KILN_KIND_RESOURCES", "kind_resources", values.limits_parser(
       "kind=pool:units+pool:units, comma-separated", "kind_resources"), "what a kind takes "
       "besides its code's `resources`", group=LIMITS),
    _v("KILN_TENANT_RATE_PER_S", "tenant_rate", values.limits_parser(
       "<per second>[/<burst>], a rate > 0 and a burst >= 1", "rate"), "tasks per second "
       "every tenant may create (a pipeline's steps and schedules' ticks included), "
       "`rate[/burst]` (429 over it)", group=LIMITS, unit="per s",
       old="KILN_TENANT_RATE", shown="unset (no limit)"),
    _v("KILN_TENANT_RUNNING", "tenant_running", COUNT, "claimed-and-unfinished tasks a "
       "tenant may have at once", group=LIMITS, unit="tasks", shown="unset (no cap)"),
    _v("KILN_TENANT_LIMITS", "tenant_limits", values.limits_parser(
       "tenant=rate:N/B+running:N, comma-separated", "tenant_limits"), "per-tenant "
       "overrides, `tenant=rate:5/20+running:4,...`", group=LIMITS),
    _v("KILN_MAX_TASKS_PER_REQUEST", "max_tasks_per_request", COUNT, "the most tasks one "
       "request may create (a batch's items, a pipeline and every copy of its steps); more "
       "is 413 `too_many_tasks`", group=LIMITS, unit="tasks"),
    _v("KILN_MAX_SCHEDULES_PER_TENANT", "max_schedules_per_tenant", COUNT, "the most "
       "schedules a tenant may hold (the admin key is exempt); more is 409 "
       "`too_many_schedules`", group=LIMITS, unit="schedules"),
    _v("KILN_CLAIM_ORDER", "claim_order", values.choice(*CLAIM_ORDERS), "`fifo`: priority, "
       "then ready time; `fair`: tenants take turns", group=LIMITS),
    _v("KILN_PRIORITY_AGING_S", "priority_aging_s", SECONDS, "seconds of waiting worth one "
       "priority point in the claim order", group=LIMITS, unit="s",
       shown="unset (strict priority)"),
    _v("KILN_BULK_PAGE_ROWS", "bulk_page_rows", COUNT, "a page of bulk cancel or retry "
       "takes no more tasks once its transaction changed this many rows (the task that "
       "reached it is finished, a pipeline with its steps); the cursor resumes after it",
       group=LIMITS, unit="rows"),
    _v("KILN_AFFINITY_WAIT_S", "affinity_wait_s", SECONDS_OR_OFF, "the most a task whose "
       "model an idle worker holds loaded is left to that worker before any worker may take "
       "it; a worker's claim puts the tasks of the models it holds this far ahead "
       "(warm-model routing)", group=SCHEDULING, unit="s"),
    _v("KILN_MODEL_MEMORY_GB", "model_memory_gb", values.number("a number of GiB", above=0),
       "the memory a worker process's loaded models may take together; past it the least "
       "recently used model is unloaded before another loads", group=SCHEDULING, unit="GiB",
       shown="unset (no limit)"),
    _v("KILN_MAX_LOADED_MODELS", "max_loaded_models", COUNT, "the most models a worker "
       "process holds loaded at once, within KILN_MODEL_MEMORY_GB or without it; past it the "
       "least recently used idle model is unloaded before another loads", group=SCHEDULING,
       unit="models"),
    _v("KILN_GENERATE_MEMORY", "generate_memory", values.structured(
       "pool:base or pool:base+per/mpx, in GiB", values.parse_memory_rule), "what an "
       "`image.generate` task takes of a pool of memory (memory admission): `gpu-mem:4+1.5/mpx`"
       " is 4 GiB plus 1.5 per megapixel, rounded up, of the pool `gpu-mem` (KILN_POOLS)",
       group=SCHEDULING, shown="unset (a `gpu` slot)"),
    _v("KILN_GENERATE_BATCH", "generate_batch", values.structured(
       "size or size/wait_ms, size 1 to 256, wait 0 to 60000", values.parse_batch),
       "durable dynamic batching of `image.generate`: a worker runs up to `size` tasks of "
       "the same model, width, height and steps in one call, waiting at most `wait_ms` for "
       "more to come (`8/50`)", group=SCHEDULING, shown="unset (one task a call)"),
    _v("KILN_PREEMPT_AFTER_S", "preempt_after_s", SECONDS, "preemption at step boundaries: "
       "when a full shared pool has a waiter of higher priority than a running attempt that "
       "has waited in its line this long, the leading supervisor asks one such attempt (the "
       "lowest priority, then the latest started) to yield at its next step; it goes back "
       "to the queue uncounted", group=SCHEDULING, unit="s", shown="unset (off)"),
    _v("KILN_DEMO_MODEL_LOAD_S", "demo_model_load_s", SECONDS_OR_ZERO, "how long the demo "
       "backend takes to load a model a task names (`model` param), to show routing and "
       "the `loading_model` stage", group=SCHEDULING, unit="s"),
    _v("KILN_RETENTION_S", "retention_s", SECONDS, "final tasks are purged this long after "
       "they finished (also the dedup window)", group=RETENTION, unit="s",
       shown="unset (kept forever)"),
    _v("KILN_RETENTION_TENANTS", "retention_tenants", values.structured(
       "tenant:seconds pairs, comma-separated", parse_retention), "per-tenant retention, "
       "`tenant:seconds,...` (`0`: forever)", group=RETENTION),
    _v("KILN_IDEMPOTENCY_TTL_S", "idempotency_ttl_s", SECONDS, "an Idempotency-Key answers "
       "with its task this long; then the same key makes a new task", group=RETENTION,
       unit="s", shown="unset (as long as its task)"),
    _v("KILN_RECONCILE_INTERVAL_S", "reconcile_interval_s", SECONDS_OR_OFF, "period of the "
       "leading supervisor's reconciliation pass (`0`: none)", group=RETENTION, unit="s"),
    _v("KILN_RECONCILE_GRACE_S", "reconcile_grace_s", SECONDS_OR_ZERO, "an orphan object "
       "younger than this is kept (`kiln reconcile --grace-s`)", group=RETENTION, unit="s"),
    _v("KILN_RECONCILE_REPAIR", "reconcile_repair", FLAG, "`1`: the supervisor's pass "
       "repairs instead of only reporting", group=RETENTION),
    _v("KILN_RESULT_LOST_POLICY", "result_lost_policy", values.choice(*RESULT_LOST_POLICIES),
       "what a repair does to a SUCCESS task whose output is lost: `fail` or `rerun` "
       "(`kiln reconcile --result-lost`)", group=RETENTION),
    _v("KILN_BACKEND", "backend", values.text(lower=True), "what serves `image.generate`: "
       "`demo`, `openai-images`, `comfyui` or `diffusers`", group=BACKENDS),
    _v("KILN_OPENAI_BASE_URL", "openai_base_url", TEXT, "the OpenAI-compatible endpoint",
       group=BACKENDS),
    _v("KILN_OPENAI_API_KEY", "openai_api_key", SECRET, "its key", group=BACKENDS,
       secret=True),
    _v("KILN_OPENAI_MODEL", "openai_model", TEXT, "the model", group=BACKENDS),
    _v("KILN_OPENAI_TIMEOUT_S", "openai_timeout_s", SECONDS, "the most one generation may "
       "take", group=BACKENDS, unit="s"),
    _v("KILN_COMFYUI_URL", "comfyui_url", TEXT, "the ComfyUI server", group=BACKENDS),
    _v("KILN_COMFYUI_WORKFLOW", "comfyui_workflow", PATH, "an API-format workflow JSON with "
       "`{{prompt}}`, `{{seed}}`, ... placeholders", group=BACKENDS),
    _v("KILN_COMFYUI_TIMEOUT_S", "comfyui_timeout_s", SECONDS, "the most one generation may "
       "take, queue wait included", group=BACKENDS, unit="s"),
    _v("KILN_DIFFUSERS_MODEL_DIR", "diffusers_model_dir", PATH, "a local diffusers pipeline "
       "folder (`model_index.json` beside its parts)", group=BACKENDS),
    _v("KILN_DIFFUSERS_DEVICE", "diffusers_device", values.choice(*DIFFUSERS_DEVICES),
       "`auto` (CUDA when torch sees a GPU, else CPU), `cpu` or `cuda`", group=BACKENDS),
    _v("KILN_DIFFUSERS_PREVIEW_EVERY_STEPS", "diffusers_preview_every", COUNT_OR_ZERO,
       "denoising steps between live previews (`0`: none)", group=BACKENDS, unit="steps",
       old="KILN_DIFFUSERS_PREVIEW_EVERY"),
    _v("KILN_WEBHOOK_SECRET", "webhook_secret", WEBHOOK_SECRET, "the HMAC-SHA256 key that signs "
       "webhook deliveries (`whsec_<base64>`: a Standard Webhooks key)", group=WEBHOOKS,
       secret=True, shown="unset (unsigned)"),
    _v("KILN_WEBHOOK_MAX_ATTEMPTS", "webhook_max_attempts", COUNT, "attempts per delivery "
       "before it is marked failed", group=WEBHOOKS, unit="attempts"),
    _v("KILN_WEBHOOK_TIMEOUT_S", "webhook_timeout_s", SECONDS, "the most one delivery attempt"
       " may take (lookup, connect, send, answer)", group=WEBHOOKS, unit="s"),
    _v("KILN_WEBHOOK_CONCURRENCY", "webhook_concurrency", COUNT, "deliveries in flight at "
       "once per dispatching supervisor", group=WEBHOOKS, unit="deliveries"),
    _v("KILN_WEBHOOK_RETRY_BASE_S", "webhook_retry_base_s", SECONDS, "delivery backoff: "
       "base·2^(attempt-1), capped, times a jitter in [0.5, 1]", group=WEBHOOKS, unit="s"),
    _v("KILN_WEBHOOK_RETRY_MAX_S", "webhook_retry_max_s", SECONDS, "cap of the delivery "
       "backoff", group=WEBHOOKS, unit="s"),
    _v("KILN_WEBHOOK_ALLOW_PRIVATE", "webhook_allow_private", FLAG, "`1`: webhooks may reach "
       "loopback, private, link-local and other non-public addresses", group=WEBHOOKS),
)  # fmt: skip

#: The table by Settings field.
BY_FIELD: dict[str, Variable] = {var.field: var for var in VARIABLES}


def variable(field_name: str) -> Variable:
    """The table's row for a Settings field."""
    return BY_FIELD[field_name]


def groups() -> list[str]:
    """The table's groups, in table order."""
    return list(dict.fromkeys(var.group for var in VARIABLES))


def _doc_row(var: Variable) -> str:
    name = f"`{var.name}`" + (f" (was `{var.old}`)" if var.old else "")
    if var.shown is not None:
        default = var.shown
    else:
        text = values.text_of(var.default)
        default = text if text == "unset" else f"`{text}`"
    return f"| {name} | {var.help} | {var.unit} | {default} |"


def markdown(only: Iterable[str] | None = None) -> str:
    """The table as Markdown: a heading and a table per group (``only``: those groups)."""
    chosen = groups() if only is None else list(only)
    lines: list[str] = []
    for group in chosen:
        lines += [
            f"### {group}",
            "",
            "| variable | meaning | unit | default |",
            "|---|---|---|---|",
        ]
        lines += [_doc_row(var) for var in VARIABLES if var.group == group]
        lines.append("")
    return "\n".join(lines)


__all__ = [
    "BREAKER_POLICIES",
    "BY_FIELD",
    "CLAIM_ORDERS",
    "DIFFUSERS_DEVICES",
    "FLAG_VALUES",
    "MAX_PRESIGN_TTL_S",
    "OUTPUT_URL_MODES",
    "RESERVED_TENANTS",
    "RESULT_LOST_POLICIES",
    "VARIABLES",
    "Settings",
    "Variable",
    "groups",
    "markdown",
    "otel_env",
    "variable",
]
