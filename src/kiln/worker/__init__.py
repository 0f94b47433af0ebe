"""Worker runtime: claim, lease, acquire a resource slot, run, upload, verify, report.

Every write a worker makes is fenced by the task's lease epoch. A refused write
(:class:`~kiln.errors.LeaseLost`) means another actor moved the task on: the worker stops
working on it at once and never touches a newer attempt's storage location.

A worker stops in one of two ways, and neither counts an attempt (DESIGN.md, I9):

- :meth:`Worker.drain` (SIGTERM): it claims nothing more, gives back at once the attempts
  that wait for a resource, lets the running ones finish within the grace period
  (``KILN_SHUTDOWN_GRACE_S``), then gives the rest back and :meth:`Worker.run` returns;
- cancelling :meth:`Worker.run` (a second signal, the end of an App): every attempt is
  given back at once, each write bounded by :data:`RELEASE_TIMEOUT_S`.

An attempt asked to yield its pool slot (preemption, KILN_PREEMPT_AFTER_S: its heartbeat
returns the request, :meth:`Context.should_yield` says so) whose handler raises
:class:`~kiln.errors.Yielded` is given back the same way, uncounted.

Giving an attempt back is the ``release`` event: the task returns to PENDING, its attempt
number goes back by one and its place in the queue is kept (``ready_at``); the epoch is
raised, so the attempt is fenced out. An attempt that cannot be given back in time keeps
its lease until it lapses; the supervisor then expires it, and that attempt counts.

The package, one module per concern (each imports only those above it):

- ``attempt``: the records of claimed work, :class:`Attempt` and :class:`Batch`;
- ``slots``: this process's resource slots (:class:`ResourcePool`), what kinds need, the
  shared pools' lines;
- ``leases``: fenced writes, heartbeats, progress, halting an attempt;
- ``context``: :class:`Context`, what a handler sees (the API for handler authors);
- ``outputs``: the handler's outputs reviewed, uploaded, verified and reported;
- ``running``: one attempt's run and how it ends (done, failed, stopped, given back);
- ``batches``: a batching kind's tasks run through one call of its handler;
- ``draining``: how a worker stops (drain, stop);
- ``runtime``: :class:`Worker`, the claim loop that puts them together.
"""

from kiln.worker.attempt import Attempt, Batch
from kiln.worker.batches import BATCH_FILL_POLL_S
from kiln.worker.context import Context
from kiln.worker.leases import HEARTBEAT_MAX_S, PROGRESS_PERSIST_S, STORE_RETRY_S
from kiln.worker.running import RELEASE_TIMEOUT_S, release_fields
from kiln.worker.runtime import Worker
from kiln.worker.slots import POOL_HEAD_POLL_S, POOL_POLL_S, ResourcePool

__all__ = [
    "BATCH_FILL_POLL_S",
    "HEARTBEAT_MAX_S",
    "POOL_HEAD_POLL_S",
    "POOL_POLL_S",
    "PROGRESS_PERSIST_S",
    "RELEASE_TIMEOUT_S",
    "STORE_RETRY_S",
    "Attempt",
    "Batch",
    "Context",
    "ResourcePool",
    "Worker",
    "release_fields",
]
