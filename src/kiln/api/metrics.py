"""Prometheus metrics: what the store knows for the whole deployment, plus this process.

The store-backed families (API.md's fixed names) are read at scrape time: the async
scrape handler fetches the numbers, hands them to :class:`StoreCollector`, then renders
the app's own registry (never the global one, so several apps share a test process).
``kiln_state_seconds`` is built from the event log's ``dwell_s``, read incrementally:
each scrape reads only the events written since the previous one.

Who sees what (docs/deployment.md): the families that carry a tenant or a value a tenant
typed (:data:`TENANT_FAMILIES`) go only to the admin key and ``KILN_METRICS_KEY`` while
auth is on; a scrape without a key gets the rest. Label values tenants choose are bounded:
a ``model`` is shown by name only when a live worker holds it loaded or
``KILN_METRICS_MODELS`` lists it (else ``other``), failure codes past the
:data:`MAX_FAILURE_CODES` most frequent are ``other``, and so are HTTP methods outside
:data:`HTTP_METHODS`.
"""

from __future__ import annotations

import asyncio
import bisect
import hmac
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.app_parts import SCHEDULE_OUTCOMES, PoolUsage, WorkerRecord
from kiln.autoscaling import Autoscaling, KindSignals, PoolSignals
from kiln.breakers import STATE_VALUES, shared_state
from kiln.config import Settings
from kiln.counters import (
    BREAKER_TRANSITIONS,
    DEDUP_HITS,
    FAILURES,
    ILLEGAL_TRANSITIONS,
    LEASE_RENEWALS,
    PREEMPTIONS,
    RATE_LIMITED,
    RECOVERED,
    SCHEDULE_FIRES,
    STALE_WRITES,
    TRANSITIONS,
    WEBHOOK_DELIVERIES,
)
from kiln.engine import Engine
from kiln.errors import Unauthorized
from kiln.states import Status

#: Upper bounds (seconds) of the ``kiln_state_seconds`` buckets, kept on one row (unformatted) so
#: the series reads at a glance instead of one number per line.
STATE_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 21600, 86400,
)  # fmt: skip
_EVENT_PAGE = 5000
_DEDUP_TYPES = ("idempotency", "content")

#: The label value of everything a bounded label does not show by name.
OTHER = "other"
#: Families with a ``tenant`` label or values tenants typed (model names): for the admin
#: key and the metrics key only, while auth is on (prometheus_client's names: no
#: ``_total``).
TENANT_FAMILIES = frozenset(
    {"kiln_gpu_seconds", "kiln_worker_models_loaded", "kiln_model_load_seconds"}
)
#: ``kiln_failures_total`` shows this many codes by name, the most frequent; the rest are
#: ``other`` (a handler, or the demo's ``simulate.fail_code``, may say any code).
MAX_FAILURE_CODES = 50
#: The methods ``kiln_api_requests_total`` names; any other a client sends is ``other``.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def sees_tenants(settings: Settings, authorization: str | None) -> bool:
    """Whether a scrape sending this ``Authorization`` header gets :data:`TENANT_FAMILIES`.

    With no key configured at all, everyone does. Otherwise no header, or a tenant's key
    (whose client sends it everywhere), is the operational view; the admin key or
    ``KILN_METRICS_KEY`` is the whole; any other key is 401. Keys are compared in constant
    time, each one.
    """
    guarded = settings.auth_enabled or settings.metrics_key is not None
    if not guarded:
        return True
    if not authorization or not authorization.strip():
        return False
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("send the metrics key as Authorization: Bearer <key>")
    presented = key.strip().encode()
    whole = [k for k in (settings.admin_key, settings.metrics_key) if k is not None]
    if sum(hmac.compare_digest(presented, k.encode()) for k in whole):
        return True
    if sum(hmac.compare_digest(presented, k.encode()) for k in settings.api_keys):
        return False
    raise Unauthorized("the key is not valid: send KILN_METRICS_KEY or the admin key, or none")


def model_label(model: str, shown: Collection[str]) -> str:
    """A ``model`` label: ``""`` (no model) and the models ``shown`` as they are, the rest
    :data:`OTHER`."""
    return model if not model or model in shown else OTHER


class DwellHistogram:
    """Time spent in each status, accumulated from the event log's ``dwell_s``."""

    def __init__(self, bounds: tuple[float, ...] = STATE_BUCKETS_S) -> None:
        self.bounds = bounds
        self.after = 0
        self.buckets: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}
        self._lock = asyncio.Lock()

    def add(self, status: str, seconds: float) -> None:
        counts = self.buckets.setdefault(status, [0] * (len(self.bounds) + 1))
        counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sums[status] = self.sums.get(status, 0.0) + seconds

    async def catch_up(self, engine: Engine) -> None:
        """Fold in every event written since the last call."""
        async with self._lock:
            while True:
                page = await engine.events(after=self.after, limit=_EVENT_PAGE)
                for event in page:
                    if event.from_status is not None and event.dwell_s is not None:
                        self.add(str(event.from_status), max(event.dwell_s, 0.0))
                    self.after = event.seq
                if len(page) < _EVENT_PAGE:
                    return

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "kiln_state_seconds", "Time tasks spent in each status", labels=["status"]
        )
        labels = [repr(float(bound)) for bound in self.bounds] + ["+Inf"]
        for status in sorted(self.buckets):
            cumulative, running = [], 0
            for label, count in zip(labels, self.buckets[status], strict=True):
                running += count
                cumulative.append((label, running))
            family.add_metric([status], cumulative, sum_value=self.sums[status])
        return family


@dataclass(slots=True)
class StoreSnapshot:
    counts: dict[str, int] = field(default_factory=dict)
    ghosts: int = 0
    counters: dict[tuple[str, str], int] = field(default_factory=dict)
    oldest_ready_age_s: float = 0.0
    pools: list[PoolUsage] = field(default_factory=list)
    webhook_pending: int = 0
    #: Circuit breakers' shared states (closed, open, half_open), by name.
    breakers: dict[str, str] = field(default_factory=dict)
    #: The live worker processes (the worker registry).
    workers: list[WorkerRecord] = field(default_factory=list)
    #: What each kind and pool asks of the workers, and what they offer.
    autoscaling: Autoscaling = field(default_factory=lambda: Autoscaling({}, {}))
    #: GPU-seconds by (tenant, kind, model, outcome), from the ledger.
    gpu_seconds: dict[tuple[str, str, str, str], float] = field(default_factory=dict)
    #: The models a ``model`` label shows by name: live workers' and KILN_METRICS_MODELS.
    models: frozenset[str] = frozenset()


#: Counters without labels: (counter, metric, help).
_PLAIN_COUNTERS = (
    (STALE_WRITES, "kiln_stale_writes", "Worker writes refused by fencing"),
    (LEASE_RENEWALS, "kiln_lease_renewals", "Worker heartbeats that extended a lease"),
    (RECOVERED, "kiln_recovered", "Outputs recovered after a lost lease"),
    (RATE_LIMITED, "kiln_rate_limited", "Submissions refused by a tenant's rate limit (429)"),
)

#: The autoscaling gauges per kind: (metric, help, value).
_KIND_GAUGES: tuple[tuple[str, str, Callable[[KindSignals], float]], ...] = (
    (
        "kiln_queue_waiting",
        "Tasks of each kind waiting: ready to claim (PENDING, due RETRYING)"
        " or WAITING_FOR_RESOURCE",
        lambda k: k.waiting,
    ),
    (
        "kiln_queue_running",
        "Tasks of each kind running (GENERATING, UPLOADING)",
        lambda k: k.running,
    ),
    (
        "kiln_queue_oldest_waiting_age_seconds",
        "How long the oldest waiting task of each kind has waited since it became ready;"
        " 0 when none",
        lambda k: k.oldest_waiting_age_s,
    ),
    (
        "kiln_worker_slots",
        "Slots (--concurrency) of the live workers serving each kind",
        lambda k: k.worker_slots,
    ),
)

#: The autoscaling gauges per pool: (metric, help, value).
_POOL_GAUGES: tuple[tuple[str, str, Callable[[PoolSignals], float]], ...] = (
    ("kiln_pool_running", "Tasks holding a slot of each shared pool", lambda p: p.running),
    (
        "kiln_pool_oldest_waiting_age_seconds",
        "How long the oldest task in each shared pool's line has waited in it; 0 when none",
        lambda p: p.oldest_waiting_age_s,
    ),
    (
        "kiln_pool_worker_slots",
        "Slots of the live workers whose kinds take each shared pool",
        lambda p: p.worker_slots,
    ),
)

#: Outcomes of webhook delivery attempts (kiln.webhooks), each shown even at zero.
WEBHOOK_OUTCOMES = ("delivered", "retrying", "failed", "refused")


def _split_pair(labels: str) -> tuple[str, str]:
    source, _, target = labels.partition(">")
    return source, target


#: How far behind the clock the GPU-seconds a process has summed are frozen: a ledger row
#: is written at its attempt's end (``ended_at``, the writer's clock) and commits at once,
#: so a row not seen this long after its end never comes.
GPU_FROZEN_AFTER_S = 300.0
GpuKey = tuple[str, str, str, str]


class GpuSeconds:
    """``kiln_gpu_seconds_total``, read from the ledger incrementally: the sums of the rows
    that ended before a mark are kept, and a scrape reads only the rows since the mark
    (one index range on ``ended_at``: the last few minutes), moving the mark on."""

    def __init__(self) -> None:
        self.mark: float | None = None
        self.frozen: dict[GpuKey, float] = {}
        self._lock = asyncio.Lock()

    async def read(self, engine: Engine) -> dict[GpuKey, float]:
        async with self._lock:
            cut = engine.now() - GPU_FROZEN_AFTER_S
            if self.mark is None or cut > self.mark + GPU_FROZEN_AFTER_S:
                older = await engine.gpu_seconds(since=self.mark or 0.0, until=cut)
                for key, seconds in older.items():
                    self.frozen[key] = self.frozen.get(key, 0.0) + seconds
                self.mark = cut
            totals = dict(self.frozen)
            for key, seconds in (await engine.gpu_seconds(since=self.mark)).items():
                totals[key] = totals.get(key, 0.0) + seconds
            return totals


class StoreCollector:
    """Renders the deployment-wide families from the latest snapshot of the store."""

    def __init__(self, histogram: DwellHistogram) -> None:
        self.snapshot = StoreSnapshot()
        self.histogram = histogram

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        snap = self.snapshot
        tasks = GaugeMetricFamily("kiln_tasks", "Tasks per status", labels=["status"])
        for status in Status:
            tasks.add_metric([str(status)], snap.counts.get(str(status), 0))
        yield tasks
        yield GaugeMetricFamily(
            "kiln_ghost_tasks", "Running tasks whose lease lapsed unswept", value=snap.ghosts
        )
        yield GaugeMetricFamily(
            "kiln_queue_oldest_age_seconds",
            "How long the oldest ready (PENDING or due RETRYING) task has waited; 0 when none",
            value=snap.oldest_ready_age_s,
        )
        yield self._pairs(TRANSITIONS, "kiln_transitions", "Status transitions")
        yield self._pairs(
            ILLEGAL_TRANSITIONS,
            "kiln_illegal_transitions",
            "Transitions the state table forbids that reached the engine",
        )
        failures = CounterMetricFamily(
            "kiln_failures", "Failed attempts by reason code", labels=["code"]
        )
        for code, n in sorted(self._failures().items()):
            failures.add_metric([code], n)
        yield failures
        dedup = CounterMetricFamily(
            "kiln_dedup_hits", "Submissions answered with an existing task", labels=["type"]
        )
        for kind in _DEDUP_TYPES:
            dedup.add_metric([kind], snap.counters.get((DEDUP_HITS, kind), 0))
        yield dedup
        for counter, metric, doc in _PLAIN_COUNTERS:
            yield CounterMetricFamily(metric, doc, value=snap.counters.get((counter, ""), 0))
        for field_name, doc in (
            ("capacity", "Slots of each shared resource pool"),
            ("held", "Slots of each shared pool held now"),
            ("waiting", "Tasks waiting in each shared pool's line"),
        ):
            family = GaugeMetricFamily(f"kiln_pool_{field_name}", doc, labels=["pool"])
            for pool in snap.pools:
                family.add_metric([pool.name], getattr(pool, field_name))
            yield family
        yield from self._webhooks()
        yield from self._autoscaling()
        yield from self._breakers()
        yield self.histogram.family()
        yield self._gpu_seconds()

    def _gpu_seconds(self) -> Metric:
        family = CounterMetricFamily(
            "kiln_gpu_seconds",
            "GPU-seconds of ended attempts (seconds generating x batch share), from the ledger",
            labels=["tenant", "kind", "model", "outcome"],
        )
        shown = self.snapshot.models
        bounded: dict[tuple[str, str, str, str], float] = {}
        for (tenant, kind, model, outcome), seconds in self.snapshot.gpu_seconds.items():
            key = (tenant, kind, model_label(model, shown), outcome)
            bounded[key] = bounded.get(key, 0.0) + seconds
        for labels, seconds in sorted(bounded.items()):
            family.add_metric(list(labels), seconds)
        return family

    def _autoscaling(self) -> Iterable[Metric]:
        """docs/autoscaling.md's signals: per kind, then per pool (kiln_pool_capacity,
        _held and _waiting are above)."""
        signals = self.snapshot.autoscaling
        for name, doc, value in _KIND_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["kind"])
            for kind, found in sorted(signals.kinds.items()):
                family.add_metric([kind], value(found))
            yield family
        for name, doc, pool_value in _POOL_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool, usage in sorted(signals.pools.items()):
                family.add_metric([pool], pool_value(usage))
            yield family

    def _breakers(self) -> Iterable[Metric]:
        state = GaugeMetricFamily(
            "kiln_breaker_state",
            "Circuit breaker state shared in the store: 0 closed, 1 half-open, 2 open",
            labels=["breaker"],
        )
        for name, value in sorted(self.snapshot.breakers.items()):
            state.add_metric([name], STATE_VALUES[value])
        yield state
        transitions = CounterMetricFamily(
            "kiln_breaker_transitions",
            "Circuit breaker transitions of every process, by the state entered",
            labels=["breaker", "to"],
        )
        for (counter, labels), n in sorted(self.snapshot.counters.items()):
            if counter == BREAKER_TRANSITIONS:
                name, _, to = labels.rpartition(">")
                transitions.add_metric([name, to], n)
        yield transitions

    def _webhooks(self) -> Iterable[Metric]:
        attempts = CounterMetricFamily(
            "kiln_webhook_deliveries",
            "Webhook delivery attempts by outcome (delivered, retrying, failed: gave up, "
            "refused: the address guard said no)",
            labels=["outcome"],
        )
        counters = self.snapshot.counters
        for outcome in WEBHOOK_OUTCOMES:
            attempts.add_metric([outcome], counters.get((WEBHOOK_DELIVERIES, outcome), 0))
        yield attempts
        yield GaugeMetricFamily(
            "kiln_webhook_pending",
            "Webhook deliveries not yet delivered or given up",
            value=self.snapshot.webhook_pending,
        )
        yield from self._workers()
        yield self._schedules()
        yield self._preemptions()

    def _preemptions(self) -> Metric:
        asked = CounterMetricFamily(
            "kiln_preemptions",
            "Running attempts the leading supervisor asked to yield their slot of each pool "
            "to a task of higher priority (KILN_PREEMPT_AFTER_S)",
            labels=["pool"],
        )
        for (counter, labels), n in sorted(self.snapshot.counters.items()):
            if counter == PREEMPTIONS:
                asked.add_metric([labels], n)
        return asked

    def _schedules(self) -> Metric:
        fires = CounterMetricFamily(
            "kiln_schedule_fires",
            "Ticks of recurring schedules by outcome (fired; skipped_overlap: the last tick's "
            "task was not final; skipped_missed: missed by more than the grace; rate_limited: "
            "put off, its tenant over its rate)",
            labels=["outcome"],
        )
        for outcome in SCHEDULE_OUTCOMES:  # each shown even at zero
            fires.add_metric([outcome], self.snapshot.counters.get((SCHEDULE_FIRES, outcome), 0))
        return fires

    def _workers(self) -> Iterable[Metric]:
        serving: dict[str, int] = {}
        holding: dict[str, int] = {}
        for worker in self.snapshot.workers:
            for kind in worker.kinds:
                serving[kind] = serving.get(kind, 0) + 1
            for model in worker.models:
                holding[model] = holding.get(model, 0) + 1
        workers = GaugeMetricFamily(
            "kiln_workers", "Live worker processes serving each kind", labels=["kind"]
        )
        for kind, n in sorted(serving.items()):
            workers.add_metric([kind], n)
        yield workers
        models = GaugeMetricFamily(
            "kiln_worker_models_loaded",
            "Live worker processes holding each model loaded",
            labels=["model"],
        )
        for model, n in sorted(holding.items()):
            models.add_metric([model], n)
        yield models

    def _pairs(self, name: str, metric: str, doc: str) -> CounterMetricFamily:
        family = CounterMetricFamily(metric, doc, labels=["from", "to"])
        for (counter, labels), n in sorted(self.snapshot.counters.items()):
            if counter == name:
                family.add_metric(list(_split_pair(labels)), n)
        return family

    def _failures(self) -> dict[str, int]:
        """Failures by code: the :data:`MAX_FAILURE_CODES` most frequent by name, the
        rest summed as :data:`OTHER`."""
        found: dict[str, int] = {}
        for (counter, labels), n in self.snapshot.counters.items():
            if counter == FAILURES:
                code = labels.partition(":")[2] or labels
                found[code] = found.get(code, 0) + n
        ranked = sorted(found.items(), key=lambda item: (-item[1], item[0]))
        shown = dict(ranked[:MAX_FAILURE_CODES])
        rest = sum(n for _, n in ranked[MAX_FAILURE_CODES:])
        if rest:
            shown[OTHER] = shown.get(OTHER, 0) + rest
        return shown


class _Operational:
    """The families of a registry but :data:`TENANT_FAMILIES`: what a scrape without a key
    gets while auth is on."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        return (m for m in self.registry.collect() if m.name not in TENANT_FAMILIES)


class ApiMetrics:
    """The per-app registry: store-backed families plus this process's API counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.operational = CollectorRegistry(auto_describe=False)
        self.operational.register(_Operational(self.registry))
        self.histogram = DwellHistogram()
        self.store_collector = StoreCollector(self.histogram)
        self.gpu_seconds = GpuSeconds()
        self.registry.register(self.store_collector)
        self.requests = Counter(
            "kiln_api_requests",
            "HTTP requests answered by this process",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.streams = Gauge(
            "kiln_api_streams_open",
            "Event streams open on this process",
            ["transport"],
            registry=self.registry,
        )
        for transport in ("sse", "websocket"):
            self.streams.labels(transport)
        self.coalesced = Counter(
            "kiln_api_coalesced_submissions",
            "Submissions answered by an identical concurrent one in this process",
            registry=self.registry,
        )

    def models_shown(self) -> frozenset[str]:
        """The models a ``model`` label shows by name, as of the latest scrape."""
        return self.store_collector.snapshot.models

    async def render(
        self, engine: Engine, *, tenants: bool = True, models: Iterable[str] = ()
    ) -> bytes:
        """The registry's text, with the store-backed families read through ``engine``:
        every family, or (``tenants`` false) all but :data:`TENANT_FAMILIES`. ``models``
        are shown by name in a ``model`` label besides those live workers hold."""
        stats = await engine.stats(None)
        counters = await engine.counters()
        await self.histogram.catch_up(engine)
        oldest = stats.oldest_ready_at
        age_s = max(0.0, engine.now() - oldest) if oldest is not None else 0.0
        pools, workers = await engine.pools(), await engine.workers()
        snapshot = StoreSnapshot(
            dict(stats.counts),
            stats.ghosts,
            counters,
            age_s,
            pools,
            await engine.webhook_pending(),
        )
        now = engine.now()
        snapshot.breakers = {
            record.name: shared_state(record, now) for record in await engine.shared_breakers()
        }
        snapshot.workers = workers
        snapshot.autoscaling = await engine.autoscaling(workers=workers, pools=pools)
        snapshot.models = frozenset(models).union(*(w.models for w in workers))
        if tenants:
            snapshot.gpu_seconds = await self.gpu_seconds.read(engine)
        self.store_collector.snapshot = snapshot
        return generate_latest(self.registry if tenants else self.operational)


class RequestMetrics:
    """ASGI middleware counting answered requests by method, route template and status."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics
        # The counter of each (method, route, status), looked up once: labels() checks
        # and locks on every call.
        self._counters: dict[tuple[str, str, int], Counter] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in HTTP_METHODS else OTHER
            key = (method, route, status)
            counter = self._counters.get(key)
            if counter is None:
                counter = self._counters[key] = self.metrics.requests.labels(*key[:2], status)
            counter.inc()
