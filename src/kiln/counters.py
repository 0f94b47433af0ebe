"""The names of the counters the store keeps (``Store.counters()``, ``Store.bump``).

A counter is a row ``(name, labels, n)`` added to in the same transaction as what it
counts, so it is exact across processes; ``/metrics`` and ``/v1/stats`` read them. Each
name's labels are given beside it. Nothing here does I/O: every layer may import it.
"""

from __future__ import annotations

#: Status changes, labels ``<from>><to>``.
TRANSITIONS = "transitions"
#: Transitions the state table refused, labels ``<status>><wanted>``.
ILLEGAL_TRANSITIONS = "illegal_transitions"
#: Fenced writes refused because the task moved on (no labels).
STALE_WRITES = "stale_writes"
#: Lease renewals by heartbeats (no labels).
LEASE_RENEWALS = "lease_renewals"
#: Submissions answered with an existing task, labels ``idempotency`` or ``content``.
DEDUP_HITS = "dedup_hits"
#: Failed attempts, labels ``<tenant>:<code>``.
FAILURES = "failures"
#: Failed attempts per minute, labels ``<minute since epoch, 10 digits>:<tenant>:<code>``,
#: so a time range is a key range. Buckets older than a day are dropped.
FAILURES_BY_MINUTE = "failures_by_minute"
FAILURE_BUCKETS_KEPT_MIN = 24 * 60
#: Tasks whose outputs the supervisor found complete after a lost lease (no labels).
RECOVERED = "recovered"
#: Final tasks deleted by retention (no labels).
PURGED = "purged"
#: Submissions refused by a tenant's rate limit (no labels).
RATE_LIMITED = "rate_limited"
#: Circuit breaker state changes, labels ``<breaker>><state>``.
BREAKER_TRANSITIONS = "breaker_transitions"
#: Webhook delivery attempts, labels the outcome.
WEBHOOK_DELIVERIES = "webhook_deliveries"
#: Running attempts asked to yield their slot (preemption, KILN_PREEMPT_AFTER_S), labels
#: the pool.
PREEMPTIONS = "preemptions"
#: Ticks of recurring schedules handled by the leading supervisor, labels the outcome
#: (``fired``, ``skipped_overlap``, ``skipped_missed``).
SCHEDULE_FIRES = "schedule_fires"
