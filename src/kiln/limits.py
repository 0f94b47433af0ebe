"""Tenant limits: submission rate limits (token buckets kept in the store, so they hold
across API nodes) and running-task caps (enforced by the claim).

``KILN_TENANT_RATE`` is ``<per second>[/<burst>]`` for every tenant;
``KILN_TENANT_LIMITS`` overrides per tenant: ``acme=rate:5/20+running:4,beta=running:1``.

The rate counts tasks, not requests: a request takes one token for every task it creates
(:func:`tasks_in`: a pipeline is itself a task, plus every copy of every step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln import pipelines
from kiln.errors import InvalidRequest, TooManyTasks


@dataclass(frozen=True, slots=True)
class Rate:
    """A token bucket: ``per_s`` tokens a second, at most ``burst`` saved up."""

    per_s: float
    burst: float

    @classmethod
    def parse(cls, raw: str, *, name: str) -> Rate:
        per_s_raw, _, burst_raw = raw.strip().partition("/")
        try:
            per_s = float(per_s_raw)
            burst = float(burst_raw) if burst_raw else max(per_s, 1.0)
        except ValueError:
            raise InvalidRequest(f"{name}: {raw!r} is not <per second>[/<burst>]") from None
        if per_s <= 0 or burst < 1:
            raise InvalidRequest(f"{name}: {raw!r} needs a positive rate and a burst of 1 or more")
        return cls(per_s, burst)


@dataclass(frozen=True, slots=True)
class TenantLimit:
    rate: Rate | None = None
    #: Tasks of the tenant that may be claimed (WAITING_FOR_RESOURCE, GENERATING,
    #: UPLOADING) at once, across every worker.
    running: int | None = None


def bucket_take(
    tokens: float | None, updated_at: float | None, now: float, rate: Rate, n: int = 1
) -> tuple[float, float]:
    """Take ``n`` tokens from a bucket last seen holding ``tokens`` at ``updated_at`` (None:
    a new, full bucket). Returns (tokens left, 0.0) when taken, else (tokens now, seconds
    until enough are there) and nothing is taken.

    ``n`` is taken once the bucket holds ``min(n, burst)``: a request larger than the burst
    is let through from a full bucket and leaves it below zero, a debt paid back at
    ``per_s`` before anything else is let through. Over any stretch of time the tenant
    never gets more than the burst plus ``per_s`` a second, plus at most one such
    request's excess."""
    if tokens is None or updated_at is None:
        tokens, updated_at = rate.burst, now
    tokens = min(rate.burst, tokens + max(now - updated_at, 0.0) * rate.per_s)
    needed = min(float(n), rate.burst)
    if tokens >= needed:
        return tokens - n, 0.0
    return tokens, (needed - tokens) / rate.per_s


def rate_bucket(tenant: str) -> str:
    """The name of the tenant's token bucket: its requests and its schedules' ticks share it."""
    return f"submit:{tenant}"


def tasks_in(kind: str, params: Any) -> int:
    """The tasks a submission of ``kind`` with (valid) ``params`` creates at most: one, or
    for a pipeline itself plus every copy of every step (``repeat``)."""
    if kind != pipelines.KIND or not isinstance(params, dict):
        return 1
    steps = params.get("steps")
    if not isinstance(steps, list):
        return 1
    return 1 + sum(_repeat(step) for step in steps)


def check_tasks_per_request(count: int, limit: int) -> None:
    """Refuse (TooManyTasks, 413) a request that would create ``count`` tasks when one
    request may create ``limit`` (KILN_MAX_TASKS_PER_REQUEST), before anything is stored."""
    if count > limit:
        raise TooManyTasks(
            f"this request would create {count} tasks; one request may create at most "
            f"{limit} (KILN_MAX_TASKS_PER_REQUEST allows more): split it",
            details=[
                {
                    "loc": ["body"],
                    "msg": "too many tasks",
                    "type": "too_many_tasks",
                    "count": count,
                    "limit": limit,
                    "setting": "KILN_MAX_TASKS_PER_REQUEST",
                }
            ],
        )


def _repeat(step: Any) -> int:
    repeat = step.get("repeat", 1) if isinstance(step, dict) else 1
    return repeat if type(repeat) is int and repeat > 0 else 1


def parse_tenant_limits(
    raw: str | None, *, name: str = "KILN_TENANT_LIMITS"
) -> dict[str, TenantLimit]:
    """``acme=rate:5/20+running:4,beta=running:1`` → per-tenant limits."""
    limits: dict[str, TenantLimit] = {}
    for item in (raw or "").split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, spec = item.partition("=")
        tenant = tenant.strip()
        if not sep or not tenant or not spec.strip():
            raise InvalidRequest(f"{name} entry {item!r} is not tenant=rate:N/B+running:N")
        rate: Rate | None = None
        running: int | None = None
        for part in spec.split("+"):
            key, _, value = part.strip().partition(":")
            if key == "rate":
                rate = Rate.parse(value, name=name)
            elif key == "running":
                try:
                    running = int(value)
                except ValueError:
                    raise InvalidRequest(
                        f"{name}: running:{value!r} is not a whole number"
                    ) from None
                if running < 1:
                    raise InvalidRequest(f"{name}: running must be 1 or more, got {value!r}")
            else:
                raise InvalidRequest(f"{name}: unknown limit {key!r} in {item!r} (rate, running)")
        limits[tenant] = TenantLimit(rate, running)
    return limits


def parse_pools(raw: str | None, *, name: str = "KILN_POOLS") -> dict[str, int]:
    """``gpu-a100:8,upstream-images-api:10`` → capacities."""
    pools: dict[str, int] = {}
    for item in (raw or "").split(","):
        item = item.strip()
        if not item:
            continue
        pool, sep, capacity = item.rpartition(":")
        try:
            size = int(capacity)
        except ValueError:
            size = 0
        if not sep or not pool.strip() or size < 1:
            raise InvalidRequest(f"{name} entry {item!r} is not name:capacity (capacity ≥ 1)")
        pools[pool.strip()] = size
    return pools


def parse_kind_resources(
    raw: str | None, *, name: str = "KILN_KIND_RESOURCES"
) -> dict[str, dict[str, int]]:
    """``image.generate=gpu-a100:1+upstream-images-api:1`` → what each kind needs."""
    kinds: dict[str, dict[str, int]] = {}
    for item in (raw or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind, sep, spec = item.partition("=")
        if not sep or not kind.strip():
            raise InvalidRequest(f"{name} entry {item!r} is not kind=pool:units+pool:units")
        needs: dict[str, int] = {}
        for part in spec.split("+"):
            pool, _, units = part.strip().rpartition(":")
            try:
                n = int(units)
            except ValueError:
                n = 0
            if not pool or n < 1:
                raise InvalidRequest(f"{name}: {part!r} in {item!r} is not pool:units")
            needs[pool] = n
        kinds[kind.strip()] = needs
    return kinds
